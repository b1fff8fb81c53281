"""The checks of what a plugin returns, shared by the core and the contract test kit.

The core calls these where a plugin's output enters it (the rollout manager, the reward
scorer, the filters, the advantage stages, the loss objective), and
:mod:`furlong.hooks.testing` calls the same functions on a plugin under test, so a
plugin that passes the kit passes the core's checks. Each check raises
:class:`~furlong.hooks.PluginError` whose message starts with ``where`` (the plugin, and
the flag that chose it when there is one) and states the rule that was broken.
"""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Sequence

import pluggy

from . import specs
from .errors import PluginError
from .rows import SplitRows
from .types import AdvantageOutput, FilterResult, LossOutput, Sample, Status

__all__ = [
    "argument_name_problems",
    "check_advantage_output",
    "check_buffer_pop",
    "check_filter_result",
    "check_generate_result",
    "check_loss_output",
    "check_loss_reducer_output",
    "check_reward_list",
    "check_reward_value",
    "no_hookimpl_problem",
    "unknown_hook_problems",
]

GENERATED = (Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED)


# --- registration: what pluggy's validation and the hook names say ------------------------


# still accepted, with a DeprecationWarning, until the next minor version (PLUGINS.md, "Deprecations")
DEPRECATED_ARGUMENTS = frozenset({"args"})


def argument_name_problems(pm: pluggy.PluginManager, plugin: object) -> str:
    """Why pluggy refuses ``plugin``: each implementation argument its hookspec lacks, with the valid names.

    :param pm: a plugin manager holding furlong's hookspecs (``pm.add_hookspecs(furlong.hooks.specs)``).
    :returns: one sentence per bad argument, or "" when every argument is a spec's.
    """
    problems = []
    for hook in specs.__all__:
        if pm.parse_hookimpl_opts(plugin, hook) is None:
            continue
        try:
            params = [p.name for p in inspect.signature(getattr(plugin, hook)).parameters.values()
                      if p.default is inspect.Parameter.empty
                      and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            continue
        valid = getattr(pm.hook, hook).spec.argnames
        current = [a for a in valid if a not in DEPRECATED_ARGUMENTS]
        for arg in [a for a in params if a not in valid]:
            close = difflib.get_close_matches(arg, current, n=1)
            problems.append(f"`{hook}({', '.join(params)})` takes '{arg}', which is not an argument of hook "
                            f"`{hook}`; its arguments are: {', '.join(current)} (take any of them, by name)"
                            + (f"; did you mean '{close[0]}'?" if close else "."))
    return " ".join(problems)


def unknown_hook_problems(pm: pluggy.PluginManager, plugin: object, also: tuple[str, ...] = ()) -> str:
    """The ``@hookimpl`` functions of a registered ``plugin`` whose names are no furlong hook (nor in
    ``also``), or ""."""
    known = sorted([*specs.__all__, *also])
    bad = []
    for caller in pm.get_hookcallers(plugin) or []:
        if caller.name not in known:
            close = difflib.get_close_matches(caller.name, known, n=1)
            bad.append(f"`{caller.name}`" + (f" (did you mean `{close[0]}`?)" if close else ""))
    return "implements unknown hook " + ", ".join(bad) if bad else ""


def no_hookimpl_problem(pm: pluggy.PluginManager, plugin: object) -> str:
    """Why a registered ``plugin`` that implements no hook is useless, hinting at ``@hookimpl``; else ""."""
    if pm.get_hookcallers(plugin):
        return ""
    unmarked = [h for h in specs.__all__ if callable(getattr(plugin, h, None))]
    if unmarked:
        listed = ", ".join(f"`{h}`" for h in unmarked)
        return (f"defines {listed} without @hookimpl: decorate each hook function with @hookimpl "
                "(from furlong.hooks import hookimpl).")
    return ("implements no hook: no function is marked @hookimpl; decorate each hook function with @hookimpl "
            "(from furlong.hooks import hookimpl) and name it after its hook (furlong.hooks.specs lists the hooks).")


# --- what a hook returns ------------------------------------------------------------------


def check_generate_result(result: Any, where: str, index: int | None) -> list[Sample]:
    """What a ``generate`` implementation returned, as the list of samples it holds.

    Rules: a :class:`Sample` or a non-empty list of them; each one's status is no longer
    ``pending``; ``tokens`` holds at least ``response_length`` ids; ``loss_mask``,
    ``rollout_log_probs`` (and the other per-token lists) hold exactly
    ``response_length`` entries; ``loss_mask`` entries are 0 or 1; rollout log-probs are
    finite and not above 0 (they are log-probabilities, in nats).

    :param result: the implementation's return value.
    :param where: who returned it, e.g. ``"generate plugin 'multi_turn' (pkg 0.1.0)"``.
    :param index: the index of the sample the plugin was given (for the message).
    :returns: the samples, in order.
    :raises PluginError: a rule is broken; the message names ``where``, the sample and the field.
    """
    samples = result if isinstance(result, list) else [result]
    if not samples or not all(isinstance(s, Sample) for s in samples):
        got = "an empty list" if isinstance(result, list) and not result else _kind(result)
        raise PluginError(f"{where} returned {got} for sample {index}; `generate` returns the Sample it was given "
                          "(filled) or a non-empty list of Samples.")
    for sample in samples:
        label = f"{where} returned sample {sample.index}"
        if sample.status not in GENERATED:
            raise PluginError(f"{label} with status {sample.status.value}; set sample.status to completed, "
                              "truncated, aborted or failed.")
        try:
            sample.validate()
        except ValueError as exc:
            detail = str(exc).partition(": ")[2]
            raise PluginError(f"{label} whose per-token fields disagree: {detail}; loss_mask and "
                              "rollout_log_probs hold one entry per response token (the last response_length "
                              "ids of tokens).") from None
        if sample.loss_mask is not None and any(m not in (0, 1) for m in sample.loss_mask):
            bad = next(m for m in sample.loss_mask if m not in (0, 1))
            raise PluginError(f"{label} with loss_mask entry {bad!r}; loss_mask entries are 0 or 1.")
        if sample.rollout_log_probs is not None:
            for t, lp in enumerate(sample.rollout_log_probs):
                if not _log_prob(lp):
                    raise PluginError(f"{label} with rollout_log_probs[{t}] = {lp!r}; a rollout log-prob is a "
                                      "finite float <= 0 (use 0.0 for tokens the model did not generate).")
    return samples


def check_reward_list(rewards: Any, n: int, where: str, first_index: int | None) -> list:
    """The list a ``reward`` implementation returned for ``n`` samples.

    Rules: a list or tuple (not a bare number, a string or None), one entry per sample.

    :raises PluginError: a rule is broken (the message names ``where`` and the first sample index).
    """
    if isinstance(rewards, (str, bytes, dict)) or not isinstance(rewards, (list, tuple)):
        raise PluginError(f"{where} returned {_kind(rewards)} for {n} sample(s) (first sample index "
                          f"{first_index}); `reward` returns a list with one reward per sample, e.g. [1.0].")
    if len(rewards) != n:
        raise PluginError(f"{where} returned {len(rewards)} rewards for {n} samples "
                          f"(first sample index {first_index}); return one per sample.")
    return list(rewards)


def check_reward_value(value: Any, where: str, index: int | None) -> None:
    """One reward: None, a finite number (a 0-dim tensor counts) or a dict.

    :raises PluginError: a string, a list, NaN or infinity (the message names ``where`` and the sample).
    """
    if value is None or isinstance(value, dict):
        return
    if isinstance(value, bool) or isinstance(value, (int, float)) or (
            hasattr(value, "item") and getattr(value, "ndim", 1) == 0):
        if not math.isfinite(float(value)):
            raise PluginError(f"{where} returned {float(value)} for sample {index}; a reward must be "
                              "a finite number.")
        return
    raise PluginError(f"{where} returned {value!r} for sample {index}; a reward must be a number, None, "
                      "or a dict whose --reward-key entry is the training scalar.")


def check_filter_result(result: Any, where: str) -> FilterResult:
    """A ``filter`` result as a :class:`FilterResult` (a bare bool means keep, no reason).

    :raises PluginError: anything else (the message names ``where``).
    """
    if isinstance(result, bool):
        return FilterResult(keep=result)
    if not isinstance(result, FilterResult):
        raise PluginError(f"{where} returned {type(result).__name__} from `filter`; expected FilterResult or bool.")
    return result


def check_buffer_pop(result: Any, num_samples: int, where: str) -> list:
    """A ``buffer_pop`` result: a list of at most ``num_samples`` groups (lists of Samples).

    :raises PluginError: not a list, too many groups, or a group that is not a list of Samples.
    """
    if not isinstance(result, list):
        raise PluginError(f"{where} returned {_kind(result)} from `buffer_pop`; expected a list of groups.")
    if len(result) > num_samples:
        raise PluginError(f"{where} returned {len(result)} groups from `buffer_pop`; at most num_samples="
                          f"{num_samples} may leave the buffer.")
    for group in result:
        if not isinstance(group, list) or not all(isinstance(s, Sample) for s in group):
            raise PluginError(f"{where} returned a group that is {_kind(group)} from `buffer_pop`; a group is a "
                              "list of Samples taken from the buffer.")
    return result


def check_advantage_output(out: Any, loss_masks: Sequence, where: str) -> AdvantageOutput:
    """An ``advantage`` result: ``AdvantageOutput`` with one [T_i] tensor per sample.

    :param loss_masks: the batch's N masks [T_i].
    :raises PluginError: the wrong type, count or length (the message names ``where``).
    """
    if not isinstance(out, AdvantageOutput):
        raise PluginError(f"{where}: `advantage` returned {type(out).__name__}; it must return AdvantageOutput.")
    fields = [("advantages", out.advantages)] + ([("returns", out.returns)] if out.returns is not None else [])
    _check_per_token(fields, loss_masks, where, "a batch",
                     lambda label, i, n, t: f"{label}[{i}] has {n} values but sample {i} has {t} response tokens.")
    return out


def check_loss_output(out: Any, loss_masks: Sequence, where: str) -> LossOutput:
    """A ``loss`` result: ``LossOutput`` whose ``token_loss`` and every metric hold one [T_i] tensor per sample.

    :raises PluginError: the wrong type, count or length (the message names ``where``).
    """
    if not isinstance(out, LossOutput):
        raise PluginError(f"{where}: `loss` returned {type(out).__name__}; it must return LossOutput.")
    fields = [("token_loss", out.token_loss)] + [(f"token_metrics['{k}']", v) for k, v in out.token_metrics.items()]
    _check_per_token(fields, loss_masks, where, "a micro-batch",
                     lambda label, i, n, t: f"{label}[{i}] has {n} values but the sample has {t} response tokens; "
                                            "return per-token values and let the core reduce them.")
    return out


def _check_per_token(fields: list, loss_masks: Sequence, where: str, batch: str, mismatch) -> None:
    """Each ``(label, rows)`` of ``fields`` holds one tensor per mask, of the mask's length."""
    for label, rows in fields:
        if rows is None or len(rows) != len(loss_masks):
            count = "None" if rows is None else f"{len(rows)} tensors"
            raise PluginError(f"{where}: {label} has {count} for {batch} of {len(loss_masks)} samples; "
                              "return one per-token tensor per sample.")
        if all(isinstance(x, SplitRows) and x.intact() for x in (rows, loss_masks)) and rows.lengths == loss_masks.lengths:
            continue
        for i, (row, mask) in enumerate(zip(rows, loss_masks)):
            if _numel(row) != _numel(mask):
                raise PluginError(f"{where}: {mismatch(label, i, _numel(row), _numel(mask))}")


def _log_prob(value: Any) -> bool:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(value) and value <= 1e-4  # rounding may lift log(1) a hair above 0


def check_loss_reducer_output(value: Any, where: str) -> Any:
    """A ``loss_reducer`` result: one number as a float tensor (0-dim or one element).

    :raises PluginError: anything else (the message names ``where``).
    """
    if not hasattr(value, "numel") or not hasattr(value, "dtype") or value.numel() != 1 \
            or not value.dtype.is_floating_point:
        shape = f" of shape {list(value.shape)}" if hasattr(value, "shape") else ""
        raise PluginError(f"{where}: the reducer returned {type(value).__name__}{shape}; expected a 0-dim float "
                          "tensor (the micro-batch's weighted sum).")
    return value


def _numel(row: Any) -> int:
    return row.numel() if hasattr(row, "numel") else len(row)


def _kind(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, (str, int, float)):
        return f"{type(value).__name__} {value!r}"
    return f"a {type(value).__name__}"
