"""Eval datasets from ``--eval-config`` or ``--eval-prompt-data``, with per-field inheritance.

Each field of an eval dataset resolves, first set wins:
dataset entry -> ``eval.defaults`` -> ``--eval-<field>`` flag -> the training rollout's
flag. ``stop``, ``stop_token_ids`` and ``min_new_tokens`` skip the ``--eval-`` step (there
is no such flag); ``n_samples_per_eval_prompt`` ends at ``--n-samples-per-eval-prompt``
and never falls back to ``--n-samples-per-prompt``; ``rm_type``,
``custom_generate_function_path`` and ``metadata_overrides`` end at the config (None or
``{}`` mean: the run's own setting applies). A key the config does not know is an error.
This module does not read the dataset files; the eval loop does, through the data source.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import logging
import math
import os
from typing import Any, Callable

import attrs

from furlong.hooks import PluginError, RunConfig
from .flag_access import flag_value

__all__ = ["DATASET_KEYS", "EvalDataset", "load_eval_datasets", "sampling_params"]

log = logging.getLogger("furlong.eval")

LONE_PATH_NAME = "aime"


@attrs.define
class EvalDataset:
    """One resolved eval dataset; every field already has its inherited value.

    ``temperature`` float (0 = greedy allowed), ``top_p`` float, ``top_k`` int (-1 = off),
    ``max_response_len`` tokens or None, ``stop`` list of strings or None,
    ``stop_token_ids`` list of ints or None, ``min_new_tokens`` tokens or None.
    ``rm_type`` None means the run's ``--rm-type`` scores it; when set the eval loop puts it
    in each sample's ``metadata["rm_type"]``. ``metadata_overrides`` is merged into each
    sample's metadata. ``custom_generate_function_path`` None means the run's generate.
    """

    name: str
    path: str
    rm_type: str | None = None
    input_key: str | None = "input"
    label_key: str | None = None
    tool_key: str | None = "tools"
    metadata_key: str | None = "metadata"
    n_samples_per_eval_prompt: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_len: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    custom_generate_function_path: str | None = None
    metadata_overrides: dict = attrs.field(factory=dict)


# --- value checks --------------------------------------------------------------------


def _str(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError("must be a non-empty string")
    return v


def _int(minimum: int | None) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError("must be an integer")
        if minimum is not None and v < minimum:
            raise ValueError(f"must be >= {minimum}")
        return v

    return check


def _float(low: float, high: float | None, low_open: bool) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError("must be a number")
        v = float(v)
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        if (v <= low if low_open else v < low) or (high is not None and v > high):
            raise ValueError(f"must be in {'(' if low_open else '['}{low}, {high if high is not None else 'inf'}]")
        return v

    return check


def _str_list(v: Any) -> list[str]:
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("must be a string or a list of strings")
    return list(v)


def _int_list(v: Any) -> list[int]:
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ValueError("must be an integer or a list of integers")
    return list(v)


def _mapping(v: Any) -> dict:
    if not isinstance(v, dict):
        raise ValueError("must be a mapping")
    return dict(v)


# Every key a dataset entry may set, with its check.
DATASET_KEYS: dict[str, Callable[[Any], Any]] = {
    "name": _str,
    "path": _str,
    "rm_type": _str,
    "input_key": _str,
    "label_key": _str,
    "tool_key": _str,
    "metadata_key": _str,
    "n_samples_per_eval_prompt": _int(1),
    "temperature": _float(0.0, None, low_open=False),
    "top_p": _float(0.0, 1.0, low_open=True),
    "top_k": _int(-1),
    "max_response_len": _int(1),
    "stop": _str_list,
    "stop_token_ids": _int_list,
    "min_new_tokens": _int(0),
    "custom_generate_function_path": _str,
    "metadata_overrides": _mapping,
}
_DEFAULT_KEYS = tuple(k for k in DATASET_KEYS if k not in ("name", "path"))

# field -> (``--eval-<field>`` attribute or None, training-rollout attribute or None)
_FALLBACKS: dict[str, tuple[str | None, str | None]] = {
    "temperature": ("eval_temperature", "rollout_temperature"),
    "top_p": ("eval_top_p", "rollout_top_p"),
    "top_k": ("eval_top_k", "rollout_top_k"),
    "max_response_len": ("eval_max_response_len", "rollout_max_response_len"),
    "input_key": ("eval_input_key", "input_key"),
    "label_key": ("eval_label_key", "label_key"),
    "tool_key": ("eval_tool_key", "tool_key"),
    "metadata_key": (None, "metadata_key"),
    "stop": (None, "rollout_stop"),
    "stop_token_ids": (None, "rollout_stop_token_ids"),
    "n_samples_per_eval_prompt": ("n_samples_per_eval_prompt", None),
    "min_new_tokens": (None, None),
    "rm_type": (None, None),
    "custom_generate_function_path": (None, None),
    "metadata_overrides": (None, None),
}


def _check_entry(entry: dict, where: str, source: str, allowed: tuple[str, ...]) -> dict:
    """Validate the keys and values of one mapping of the config; drop ``null`` values."""
    out = {}
    for key, value in entry.items():
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise PluginError(
                f"{source}: unknown key {key!r} in {where}.{hint} "
                f"Known keys: {', '.join(allowed)}. Fix or remove it."
            )
        if value is None:
            continue
        try:
            out[key] = DATASET_KEYS[key](value)
        except ValueError as exc:
            raise PluginError(f"{source}: {where}: {key!r} {exc}, got {value!r}.") from None
    return out


def _resolve(name: str, path: str, entry: dict, defaults: dict, config: RunConfig) -> EvalDataset:
    values: dict[str, Any] = {"name": name, "path": path}
    for field, (eval_flag, rollout_flag) in _FALLBACKS.items():
        chain = [entry.get(field), defaults.get(field)]
        chain += [flag_value(config, flag) for flag in (eval_flag, rollout_flag) if flag]
        value = next((v for v in chain if v is not None), None)
        if value is None:
            continue  # keep the attrs default
        if field in ("stop", "stop_token_ids", "metadata_overrides"):
            value = list(value) if field != "metadata_overrides" else dict(value)
        values[field] = value
    return EvalDataset(**values)


def _read_config(spec: str) -> tuple[Any, str]:
    """Parse ``--eval-config`` (a YAML path or ``base64:<YAML>``); return (data, source label)."""
    import yaml

    if spec.startswith("base64:"):
        source = "--eval-config (base64)"
        try:
            text = base64.b64decode(spec[len("base64:") :], validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise PluginError(f"{source}: not valid base64-encoded UTF-8 YAML ({exc}).") from exc
    else:
        source = f"--eval-config {spec!r}"
        if not os.path.isfile(spec):
            raise PluginError(f"{source}: no such file. Pass a YAML file path or base64:<encoded YAML>.")
        with open(spec, encoding="utf-8") as f:
            text = f.read()
    try:
        return yaml.safe_load(text), source
    except yaml.YAMLError as exc:
        raise PluginError(f"{source}: not valid YAML: {exc}") from exc


def _from_config(spec: str, config: RunConfig) -> list[EvalDataset]:
    data, source = _read_config(spec)
    if not isinstance(data, dict) or not isinstance(data.get("eval"), dict):
        raise PluginError(f"{source}: expected a mapping with a top-level 'eval:' mapping holding 'datasets'.")
    if set(data) != {"eval"}:
        extra = ", ".join(repr(k) for k in data if k != "eval")
        raise PluginError(f"{source}: unknown top-level key {extra}; only 'eval' is read. Fix or remove it.")
    section = data["eval"]
    unknown = [k for k in section if k not in ("defaults", "datasets")]
    if unknown:
        raise PluginError(
            f"{source}: unknown key {unknown[0]!r} in eval; it takes 'defaults' and 'datasets'. Fix or remove it."
        )
    raw_defaults = section.get("defaults") or {}
    if not isinstance(raw_defaults, dict):
        raise PluginError(f"{source}: eval.defaults must be a mapping.")
    defaults = _check_entry(raw_defaults, "eval.defaults", source, _DEFAULT_KEYS)
    datasets = section.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise PluginError(f"{source}: eval.datasets must be a non-empty list of {{name, path, ...}} mappings.")
    out = []
    for i, raw in enumerate(datasets):
        where = f"eval.datasets[{i}]"
        if not isinstance(raw, dict):
            raise PluginError(f"{source}: {where} must be a mapping with at least 'name' and 'path'.")
        if isinstance(raw.get("name"), str) and raw["name"]:
            where = f"dataset {raw['name']!r} ({where})"
        entry = _check_entry(raw, where, source, tuple(DATASET_KEYS))
        for required in ("name", "path"):
            if required not in entry:
                raise PluginError(
                    f"{source}: {where} has no {required!r}; every dataset needs 'name' and 'path'."
                )
        out.append(_resolve(entry["name"], entry["path"], entry, defaults, config))
    return out


def _from_prompt_data(values: list[str], config: RunConfig) -> list[EvalDataset]:
    if len(values) == 1:
        pairs = [(LONE_PATH_NAME, values[0])]
    elif len(values) % 2:
        raise PluginError(
            f"--eval-prompt-data takes NAME PATH pairs (or one lone PATH, named {LONE_PATH_NAME!r}); "
            f"got {len(values)} values: {' '.join(values)}. Add the missing name or path."
        )
    else:
        pairs = list(zip(values[0::2], values[1::2]))
    return [_resolve(name, path, {}, {}, config) for name, path in pairs]


def load_eval_datasets(config: RunConfig) -> list[EvalDataset]:
    """Resolve the run's eval datasets, in config order.

    ``config.eval_config`` (a YAML path or ``base64:<YAML>``) with top-level
    ``eval: {defaults: {...}, datasets: [{name, path, ...}, ...]}`` replaces
    ``config.eval_prompt_data`` (flat ``name path`` pairs; one lone value is named ``aime``).
    Neither given: an empty list.

    :raises PluginError: the config file is missing or not YAML; a key in ``eval.defaults``
        or a dataset entry is unknown (the message names it and the dataset) or has a bad
        value; a dataset lacks ``name`` or ``path``; two datasets share a name;
        ``--eval-prompt-data`` has an odd number of values other than one.
    """
    spec = config.eval_config
    prompt_data = config.eval_prompt_data
    if spec:
        if prompt_data:
            log.warning("--eval-config replaces --eval-prompt-data; ignoring %s", " ".join(prompt_data))
        datasets = _from_config(spec, config)
        source = "--eval-config"
    elif prompt_data:
        datasets = _from_prompt_data(list(prompt_data), config)
        source = "--eval-prompt-data"
    else:
        return []
    seen = set()
    for ds in datasets:
        if ds.name in seen:
            raise PluginError(f"{source}: eval dataset name {ds.name!r} is used twice; give each dataset its own name.")
        seen.add(ds.name)
    return datasets


def sampling_params(ds: EvalDataset, config: RunConfig) -> dict:
    """SGLang-style ``sampling_params`` for every request of eval dataset ``ds``.

    Keys: ``temperature``, ``top_p``, ``top_k``, ``max_new_tokens`` (tokens, None when no
    cap is set), ``stop``, ``stop_token_ids`` (None = the model's default),
    ``skip_special_tokens`` (``config.rollout_skip_special_tokens``), ``no_stop_trim`` True,
    ``spaces_between_special_tokens`` False, and ``min_new_tokens`` only when set.
    """
    params = {
        "temperature": ds.temperature,
        "top_p": ds.top_p,
        "top_k": ds.top_k,
        "max_new_tokens": ds.max_response_len,
        "stop": list(ds.stop) if ds.stop is not None else None,
        "stop_token_ids": list(ds.stop_token_ids) if ds.stop_token_ids is not None else None,
        "skip_special_tokens": bool(config.rollout_skip_special_tokens),
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    if ds.min_new_tokens is not None:
        params["min_new_tokens"] = ds.min_new_tokens
    return params
