"""``--eval-function-path``: a user's function runs a whole evaluation (Miles' eval rollout function).

The function is called as Miles calls its eval rollout function, ``fn(args, rollout_id, context,
evaluation=True)`` (:func:`furlong.core.plugins.path_specs.eval_function`), with an
:class:`EvalContext` where Miles passes its data source: the engine the evaluation runs on (the
rollout engines, or the dedicated eval fleet under ``--eval-num-gpus``), ``generate_group`` and
the eval sets the flags loaded. Its result is Miles' eval data, logged under the names the
built-in evaluation uses (:func:`data_metrics`).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Awaitable, Callable

import attrs

from furlong.hooks import PluginError, RunConfig, Sample

from ..run.extra_metrics import eval_set_metrics

__all__ = ["EvalContext", "EvalSet", "data_metrics", "eval_samples", "read_result"]


def eval_samples(row: dict, metadata_overrides: dict | None, rm_type: str | None, index: int,
                 group_index: int) -> Sample:
    """A fresh eval :class:`Sample` of dataset ``row``: its prompt, label and metadata (deep copies) with the eval
    set's ``metadata_overrides`` and ``rm_type`` applied."""
    metadata = copy.deepcopy(row.get("metadata") or {})
    metadata.update(metadata_overrides or {})
    if rm_type:
        metadata["rm_type"] = rm_type
    return Sample(prompt=copy.deepcopy(row["prompt"]), label=copy.deepcopy(row.get("label")), metadata=metadata,
                  group_index=group_index, index=index)


@attrs.define
class EvalSet:
    """One eval set as the flags loaded it: ``name``, its ``rows`` (``{"prompt", "label", "metadata"}``), the
    ``sampling_params`` of its requests and ``n_samples_per_eval_prompt``."""

    name: str
    rows: list[dict]
    sampling_params: dict
    n_samples_per_eval_prompt: int
    metadata_overrides: dict | None = None
    rm_type: str | None = None

    def groups(self) -> list[list[Sample]]:
        """Fresh sample groups, one per row with ``n_samples_per_eval_prompt`` samples, indexed as the built-in
        evaluation indexes them (sample ``p * n + j`` of prompt ``p``), so their sampling seeds match it."""
        n = self.n_samples_per_eval_prompt
        return [[eval_samples(row, self.metadata_overrides, self.rm_type, p * n + j, p) for j in range(n)]
                for p, row in enumerate(self.rows)]


@attrs.define
class EvalContext:
    """What an ``--eval-function-path`` function gets in place of Miles' data source.

    ``engine``: the :class:`~furlong.hooks.RolloutEngine` of this evaluation (``engine.tokenizer``
    tokenizes). ``generate_group(group, sampling_params=None)``: coroutine generating and scoring every
    sample of ``group`` in place (the ``generate`` and ``reward`` hooks, ``evaluation=True``), returning it;
    pass the set's ``sampling_params`` (None: the rollout's, ``--rollout-temperature``...).
    ``eval_sets``: the :class:`EvalSet` of every eval set. ``rollout_id``: the rollout whose weights are
    evaluated. ``hf_dir``: the weight snapshot the eval fleet loaded for it, or None (inline evaluation).
    """

    engine: Any
    generate_group: Callable[..., Awaitable[list[Sample]]]
    eval_sets: list[EvalSet]
    rollout_id: int
    hf_dir: str | None = None


def read_result(value: Any, flag: str) -> tuple[dict, dict]:
    """``(data, metrics)`` of what an eval function returned: Miles' data dict, a ``(data, metrics)`` pair, or an
    object with ``data`` (and ``metrics``) attributes.

    :raises PluginError: another shape, a set entry without a ``rewards`` list, or ``samples``/``truncated`` of
        another length (named by ``flag`` and set).
    """
    if hasattr(value, "data") and not isinstance(value, dict):
        data, metrics = value.data, getattr(value, "metrics", None)
    elif isinstance(value, tuple) and len(value) == 2:
        data, metrics = value
    else:
        data, metrics = value, None
    if not isinstance(data, dict):
        raise PluginError(f"{flag} returned {type(value).__name__}; return Miles' eval data "
                          '{set name: {"rewards": [...], "truncated": [...], "samples": [...]}}, or (data, metrics).')
    if metrics is not None and not isinstance(metrics, dict):
        raise PluginError(f"{flag}: its metrics are a {type(metrics).__name__}; return a dict of numbers.")
    for name, entry in data.items():
        rewards = entry.get("rewards") if isinstance(entry, dict) else None
        if not isinstance(rewards, (list, tuple)):
            raise PluginError(f'{flag}: eval set {name!r} has no "rewards" list (got {type(entry).__name__}).')
        for key in ("truncated", "samples"):
            if entry.get(key) is not None and len(entry[key]) != len(rewards):
                raise PluginError(f'{flag}: eval set {name!r} has {len(entry[key])} "{key}" for {len(rewards)} '
                                  "rewards; give one per reward.")
    return data, dict(metrics or {})


def data_metrics(config: RunConfig, name: str, entry: dict, group_size: int, flag: str) -> dict:
    """The ``eval/...`` metrics of eval set ``name`` from Miles' eval data ``entry``, with the built-in names.

    With ``samples`` (:class:`~furlong.hooks.Sample` objects): :func:`~furlong.core.run.extra_metrics.eval_set_metrics`
    of them (lengths, pass@k, reward categories). Then from ``rewards`` (None counts 0, as Miles counts it): ``eval/<name>`` (mean) and
    ``eval/<name>-none_reward_ratio``; from ``truncated``: ``eval/<name>-truncated_ratio``.

    :raises PluginError: a reward that is not a number or None.
    """
    samples = list(entry.get("samples") or ())
    ours = bool(samples) and all(isinstance(s, Sample) for s in samples)  # others carry no lengths to count
    out = eval_set_metrics(config, name, samples, group_size) if ours else {}
    rewards = list(entry["rewards"])
    for r in rewards:
        if r is not None and (not isinstance(r, (int, float)) or math.isnan(r)):
            raise PluginError(f"{flag}: eval set {name!r} has reward {r!r}; rewards are numbers or None.")
    if rewards:
        out[f"eval/{name}"] = sum(float(r) for r in rewards if r is not None) / len(rewards)
        out[f"eval/{name}-none_reward_ratio"] = sum(r is None for r in rewards) / len(rewards)
    truncated = entry.get("truncated")
    if truncated:
        out[f"eval/{name}-truncated_ratio"] = sum(bool(t) for t in truncated) / len(truncated)
    return out
