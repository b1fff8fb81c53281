"""Reward functions as TRL and verl users wrote them, named by ``--custom-rm-path`` with no wrapper.

The form is read from the function's parameter names:

- **verl** (``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)``, or
  one of verl's per-data-set scorers such as ``gsm8k.compute_score(solution_str, ground_truth, ...)``:
  a number or a dict with ``score`` per sample): called per sample by keyword with ``solution_str``
  the response, ``ground_truth`` the label and, when the function takes them, ``data_source =
  metadata["data_source"]`` and ``extra_info = metadata["extra_info"]`` (the whole metadata when it
  has no such key).
- **TRL** (``reward_func(prompts, completions, **kwargs) -> list[float | None]``, a batch per call):
  called with the samples of one reward call as lists: ``prompts``, ``completions`` (chat messages
  ``[{"role": "assistant", "content": ...}]`` under ``--apply-chat-template``, as TRL gives a
  conversational data set's, else text), ``completion_ids``, the label under the last part of
  ``--label-key``'s name (``solution``, ``ground_truth``) and every metadata key, as TRL passes a
  data set's columns.
- anything else: Miles' ``fn(args, sample)`` (``fn(args, samples)`` under ``--group-rm``).

Both TRL and verl decode responses without special tokens: a TRL or verl function's ``configure``
turns ``--rollout-skip-special-tokens`` on when it was not given (a ``<|im_end|>`` at the end of a
response would fail their format checks), and a verl function's sets ``--reward-key score`` (verl
trains on a dict reward's ``score``). What they return is checked like every reward's.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from furlong.hooks import PluginError, hookimpl
from ..config.flag_access import flag_value

__all__ = ["VERL_ARGS", "reward_adapter", "reward_form"]

VERL_ARGS = ("solution_str", "ground_truth")
"""The parameters that make a function a verl reward (verl calls them by these names)."""


def _parameters(fn: Callable) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def reward_form(fn: Callable) -> str:
    """``"verl"``, ``"trl"`` or ``"miles"``: how ``fn`` is called, from its parameter names."""
    names = set(_parameters(fn))
    if set(VERL_ARGS) <= names:
        return "verl"
    if "completions" in names:
        return "trl"
    return "miles"


async def _resolve(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _accepted(fn: Callable, path: str, offered: dict) -> dict:
    """The entries of ``offered`` that ``fn`` takes (all with ``**kwargs``).

    :raises PluginError: ``fn`` needs an argument that is not offered (named, with what is).
    """
    params = _parameters(fn)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    needed = [n for n, p in params.items() if p.default is inspect.Parameter.empty
              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in offered]
    if needed:
        raise PluginError(f"--custom-rm-path {path}: the function needs {', '.join(needed)}, which the samples do not "
                          f"give; they give {', '.join(sorted(offered))} (the label under the last part of "
                          "--label-key, and each metadata key).")
    return {k: v for k, v in offered.items() if k in params}


def _derive(report, args, dest: str, value: Any, note: str) -> None:
    """``args.<dest> = value`` with a note, unless the flag was given."""
    if not report.given(args, dest) and flag_value(args, dest) != value:
        report.default(args, dest, value)
        report.info(note)


def _text_mode(report, args, path: str, form: str) -> None:
    _derive(report, args, "rollout_skip_special_tokens", True,
            f"--custom-rm-path {path} is a {form} reward: responses are decoded without special tokens, as {form} "
            "does (--rollout-skip-special-tokens).")


class _FormAdapter:
    """A reward function written for another framework, adapted; the plugin manager knows adapters by
    ``dotted_path_adapter`` (core/plugins/adapters.MilesStyle)."""

    dotted_path_adapter = True

    def __init__(self, fn: Callable, path: str):
        self.fn, self.path = fn, path


class TrlRewardAdapter(_FormAdapter):
    """A TRL reward function as a furlong ``reward`` plugin (see the module doc)."""

    @hookimpl
    def configure(self, args, report):
        """Decode responses without special tokens, as TRL does, unless the flag was given."""
        _text_mode(report, args, self.path, "TRL")

    @hookimpl
    async def reward(self, config, samples):
        """Call the function once on ``samples`` as TRL calls a batch; return its list."""
        offered = {
            "prompts": [s.prompt for s in samples],
            "completions": [[{"role": "assistant", "content": s.response}] if config.apply_chat_template
                            else s.response for s in samples],
            "completion_ids": [list(s.tokens[len(s.tokens) - s.response_length:]) for s in samples],
        }
        for key in sorted({k for s in samples for k in (s.metadata or {})}):
            offered.setdefault(key, [(s.metadata or {}).get(key) for s in samples])
        if config.label_key:
            offered[config.label_key.rsplit(".", 1)[-1]] = [s.label for s in samples]
        return await _resolve(self.fn(**_accepted(self.fn, self.path, offered)))


class VerlRewardAdapter(_FormAdapter):
    """A verl ``compute_score`` as a furlong ``reward`` plugin (see the module doc)."""

    @hookimpl
    def configure(self, args, report):
        """verl's decoding and dict convention, and a warning when ``data_source`` cannot reach the function."""
        _text_mode(report, args, self.path, "verl")
        _derive(report, args, "reward_key", "score", f"--custom-rm-path {self.path} is a verl compute_score: a dict "
                "it returns trains on its 'score' (--reward-key score).")
        keys = [k.strip().rsplit(".", 1)[-1] for k in (args.metadata_key or "").split(",")]
        if "data_source" in _parameters(self.fn) and "data_source" not in keys:
            report.warn(f"--custom-rm-path {self.path} is a verl compute_score, which gets data_source from each "
                        f"sample's metadata, but --metadata-key {args.metadata_key} does not bring it: pass "
                        "--metadata-key data_source,extra_info (verl's Parquet columns), or every call gets "
                        "data_source=None.")

    @hookimpl
    async def reward(self, config, samples):
        """One ``compute_score`` call per sample, by keyword, as verl's reward manager makes it."""
        out = []
        for s in samples:
            metadata = s.metadata or {}
            offered = {"data_source": metadata.get("data_source"), "solution_str": s.response,
                       "ground_truth": s.label, "extra_info": metadata.get("extra_info", metadata)}
            out.append(await _resolve(self.fn(**_accepted(self.fn, self.path, offered))))
        return out


def reward_adapter(fn: Callable, path: str, miles_adapter: type) -> object:
    """The adapter that calls ``fn`` (named by dotted ``path``) in its form (:func:`reward_form`); Miles' form
    uses ``miles_adapter(fn)``."""
    form = reward_form(fn)
    if form == "miles":
        return miles_adapter(fn)
    return (VerlRewardAdapter if form == "verl" else TrlRewardAdapter)(fn, path)
