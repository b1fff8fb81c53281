"""Metrics users see: the ``metrics.jsonl`` log, the console line, rollout and eval metrics.

``MetricsLog`` appends one JSON object per line (flushed per line, so a killed run keeps
everything it logged). ``rollout_metrics`` and ``eval_metrics`` compute the sample-side
metrics of PLUGINS.md's "Metrics reference" from ``furlong.hooks.Sample`` objects.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from typing import Any, Iterable

from furlong.hooks import Sample, Status
from furlong.kit.rewards import reward_scalar

__all__ = ["SUPERSEDED_NAME", "MetricsLog", "eval_metrics", "one_row_per_step", "rollout_metrics", "scalar_reward",
           "set_aside_rows_from", "summary_line", "to_json_value", "zero_spread_warning"]

STEP_KEYS = ("rollout/step", "train/step", "eval/step")


def to_json_value(value: Any) -> Any:
    """Plain JSON value of a metric: tensors and numpy values become Python numbers
    (``.tolist()``), NaN and +-inf become None, containers are converted item by item."""
    if hasattr(value, "tolist") and callable(value.tolist):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    try:
        return to_json_value(float(value))
    except (TypeError, ValueError):
        return str(value)


class MetricsLog:
    """Appends metrics to a JSONL file, one object per call.

    Each object is the metrics dict plus its step key (``rollout/step``, ``train/step`` or
    ``eval/step``) and ``time`` (Unix seconds). ``path`` is the file, or a directory (then
    ``<path>/metrics.jsonl``); None disables writing (calls are no-ops). The file is opened
    in append mode, so a resumed run continues the same log.

    Example::

        log = MetricsLog("/ckpt")               # writes /ckpt/metrics.jsonl
        log.log({"rollout/raw_reward": 0.41}, "rollout/step", 3)
    """

    def __init__(self, path: str | None) -> None:
        if path is not None and (os.path.isdir(path) or not path.endswith(".jsonl")):
            path = os.path.join(path, "metrics.jsonl")
        self.path = path
        self._file = None

    def log(self, metrics: dict, step_key: str, step: int) -> dict:
        """Write ``metrics`` with ``{step_key: step, "time": now}``; return the written object.

        :raises ValueError: ``step_key`` is not one of ``STEP_KEYS``.
        """
        if step_key not in STEP_KEYS:
            raise ValueError(f"step key {step_key!r} is not one of {', '.join(STEP_KEYS)}")
        record = {str(k): to_json_value(v) for k, v in metrics.items()}
        record[step_key] = int(step)
        record["time"] = time.time()
        if self.path is not None:
            if self._file is None:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


SUPERSEDED_NAME = "metrics.superseded.jsonl"
"""Beside ``metrics.jsonl``: the rows a resumed run set aside (logged after the checkpoint it resumes from)."""


def set_aside_rows_from(path: str, rollout_id: int, steps_per_rollout: int) -> int:
    """Move the rows of ``metrics.jsonl`` at ``path`` that belong to rollout ``rollout_id`` or later into
    ``metrics.superseded.jsonl`` beside it; return how many moved.

    A run resumed at rollout ``rollout_id`` (from the checkpoint of ``rollout_id - 1``) logs those
    rollouts again: without this the file would hold them twice. Rows count as later when their
    ``rollout/step`` or ``eval/step`` is at least ``rollout_id``, or their ``train/step`` at least
    ``rollout_id * steps_per_rollout``. The file is rewritten atomically (a new file renamed over
    it); lines that are not JSON are kept where they are. A missing file moves nothing.
    """
    if not os.path.isfile(path):
        return 0
    first = {"rollout/step": rollout_id, "eval/step": rollout_id, "train/step": rollout_id * steps_per_rollout}
    kept, moved = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                kept.append(line)
                continue
            later = isinstance(row, dict) and any(isinstance(row.get(k), int) and row[k] >= v for k, v in first.items())
            (moved if later else kept).append(line)
    if not moved:
        return 0
    with open(os.path.join(os.path.dirname(path), SUPERSEDED_NAME), "a", encoding="utf-8") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line in moved)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return len(moved)


def one_row_per_step(rows: list[dict]) -> list[dict]:
    """``rows`` with one row per step key and step: a later row of the same ``rollout/step``,
    ``train/step`` or ``eval/step`` replaces the earlier one, in its place (the rows of a file two runs
    appended to, or written before :func:`set_aside_rows_from` existed). Rows without a step key stay."""
    out: list[dict] = []
    where: dict[tuple[str, int], int] = {}
    for row in rows:
        key = next(((k, row[k]) for k in STEP_KEYS if k in row), None)
        if key is not None and key in where:
            out[where[key]] = row
            continue
        if key is not None:
            where[key] = len(out)
        out.append(row)
    return out


# (label, metric keys tried in order, format spec, unit)
_SUMMARY_FIELDS = (
    ("reward", ("rollout/raw_reward",), "6.3f", ""),
    ("len", ("rollout/response_len/mean", "rollout/response_lengths"), "7.1f", ""),
    ("zero-spread", ("rollout/zero_std/share",), "4.2f", ""),
    ("kl", ("train/ppo_kl",), "7.4f", ""),
    ("clip", ("train/pg_clipfrac",), "5.3f", ""),
)
NEARLY_ALL_ZERO_SPREAD = 0.9
"""A rollout whose share of zero-spread groups is at least this gets a warning (:func:`zero_spread_warning`)."""
_MISMATCH_KL = "train/train_rollout_kl"
_MISMATCH_SHOWN_FROM = 1e-6  # below: float rounding between the engine's and the trainer's forward
_SUMMARY_TIMES = (
    ("rollout", "perf/rollout_time"),
    ("train", "perf/train_time"),
    ("sync", "perf/update_weights_time"),
)


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    width = int(spec.split(".")[0])
    value = to_json_value(value)
    if value is None or isinstance(value, (list, dict, str)):
        return "-".rjust(width) + " " * len(unit)
    return format(float(value), spec) + unit


def summary_line(rollout_id: int, metrics: dict) -> str:
    """One fixed-width console line for a finished rollout; missing values print ``-``.

    Fields: reward = ``rollout/raw_reward``; len = ``rollout/response_len/mean`` (else
    ``rollout/response_lengths``), tokens; zero-spread = ``rollout/zero_std/share`` (the share of
    groups whose samples all scored the same); kl = ``train/ppo_kl``; clip =
    ``train/pg_clipfrac``; times in seconds = ``perf/rollout_time``, ``perf/train_time``,
    ``perf/update_weights_time``. When ``train/train_rollout_kl`` (the KL between the
    trainer's and the engine's log-probs of the same tokens) is at least 1e-6, a
    ``rollout-kl`` field follows ``clip``: the generating policy differs from the trained one
    (train-async, fully async, partial rollout, or a precision mismatch).

    Example: ``rollout    3 | reward  0.412 | len    11.2 | zero-spread 0.25 | kl  0.0012 | clip 0.031 |
    rollout-kl 6.2e-02 | rollout   4.1s train   1.2s sync   0.1s``.
    """
    parts = [f"rollout {rollout_id:>4}"]
    for label, keys, spec, unit in _SUMMARY_FIELDS:
        value = next((metrics[k] for k in keys if metrics.get(k) is not None), None)
        parts.append(f"{label} {_fmt(value, spec, unit)}")
    mismatch = to_json_value(metrics.get(_MISMATCH_KL))
    if isinstance(mismatch, (int, float)) and abs(mismatch) >= _MISMATCH_SHOWN_FROM:
        parts.append(f"rollout-kl {mismatch:.1e}")
    times = " ".join(f"{label} {_fmt(metrics.get(key), '5.1f', 's')}" for label, key in _SUMMARY_TIMES)
    parts.append(times)
    return " | ".join(parts).rstrip()


def zero_spread_warning(rollout_id: int, metrics: dict, groups: int) -> str | None:
    """A warning when nearly every group of a rollout (:data:`NEARLY_ALL_ZERO_SPREAD`) scored one reward
    on all its samples, else None: a group-relative advantage (GRPO's) is 0 for such a group, so the
    rollout trains (almost) nothing, which the reward alone does not show.

    :param groups: the number of groups the rollout trained on.
    """
    share = to_json_value(metrics.get("rollout/zero_std/share"))
    if not isinstance(share, (int, float)) or share < NEARLY_ALL_ZERO_SPREAD or groups <= 0:
        return None
    same = round(share * groups)
    return (f"rollout {rollout_id}: {same} of {groups} groups ({share:.0%}) scored the same reward on every sample "
            "(all wrong or all right), so a group-relative advantage is 0 for them and they train nothing. More "
            "samples per prompt (--n-samples-per-prompt), a higher --rollout-temperature, prompts nearer the model's "
            "level, or dynamic sampling (--dynamic-sampling-filter check_reward_nonzero_std with "
            "--over-sampling-batch-size) give groups with a spread. The rollout line's zero-spread field shows the "
            "share; this warning is not repeated.")


# --- sample-side metrics ---------------------------------------------------------------


def scalar_reward(sample: Sample, reward_key: str | None, flag: str) -> float | None:
    """The sample's reward as a float (dicts reduced with ``reward_key``), None if unscored.

    :raises PluginError: a dict reward without ``reward_key``, without that key, or not a number there
        (:func:`furlong.kit.rewards.reward_scalar`; the message names the sample and ``flag``).
    """
    return reward_scalar(sample.reward, reward_key, f"sample {sample.index}", flag)


def _length_stats(prefix: str, lengths: list[int]) -> dict:
    return {
        f"{prefix}/mean": statistics.fmean(lengths),
        f"{prefix}/median": float(statistics.median(lengths)),
        f"{prefix}/max": max(lengths),
        f"{prefix}/min": min(lengths),
    }


def _fraction(flags: Iterable[bool], n: int) -> float:
    return sum(1 for f in flags if f) / n


def rollout_metrics(groups: list[list[Sample]], reward_key: str | None, zero_std: bool = True) -> dict:
    """Rollout-side metrics of the groups trained on. Empty input: ``{}``.

    ``rollout/raw_reward``: mean scalar reward (dicts reduced with ``reward_key``; an
    unscored sample counts 0). ``rollout/response_lengths``: mean ``response_length``
    (tokens). ``rollout/response_len/{mean,median,max,min}``: over effective lengths
    (``sum(loss_mask)``). ``rollout/truncated`` and ``rollout/truncated_ratio``: fraction of
    samples with status ``truncated``. With ``zero_std`` (the loop always asks for it):
    ``rollout/zero_std/count_<r>`` = number of groups whose rewards are all equal to ``r``
    (``r`` rounded to 1 decimal, e.g. ``count_1.0``), and
    ``rollout/zero_std/all_{zero,one}_percentage`` = fraction (0..1) of all groups whose
    rewards are all 0 / all 1 (the Miles names and definitions), and
    ``rollout/zero_std/share`` = fraction (0..1) of groups whose rewards are all equal,
    whatever the value (such a group has zero GRPO advantage: no gradient).

    :raises PluginError: a dict reward without ``reward_key`` or lacking that key.
    """
    samples = [s for g in groups for s in g]
    if not samples:
        return {}
    n = len(samples)
    rewards = [scalar_reward(s, reward_key, "--reward-key") or 0.0 for s in samples]
    truncated = _fraction((s.status == Status.TRUNCATED for s in samples), n)
    out = {
        "rollout/raw_reward": statistics.fmean(rewards),
        "rollout/response_lengths": statistics.fmean(s.response_length for s in samples),
        **_length_stats("rollout/response_len", [s.effective_response_length for s in samples]),
        "rollout/truncated": truncated,
        "rollout/truncated_ratio": truncated,
    }
    if zero_std:
        counts: dict[str, int] = {}
        for group in groups:
            values = [scalar_reward(s, reward_key, "--reward-key") or 0.0 for s in group]
            if values and all(v == values[0] for v in values):
                label = str(round(values[0], 1))
                counts[label] = counts.get(label, 0) + 1
        out.update({f"rollout/zero_std/count_{r}": c for r, c in counts.items()})
        out["rollout/zero_std/all_zero_percentage"] = counts.get("0.0", 0) / len(groups)
        out["rollout/zero_std/all_one_percentage"] = counts.get("1.0", 0) / len(groups)
        out["rollout/zero_std/share"] = sum(counts.values()) / len(groups)
    return out


def eval_metrics(name: str, samples: list[Sample], reward_key: str | None) -> dict:
    """Metrics of one eval dataset. Empty input: ``{}``.

    ``eval/<name>``: mean reward, an unscored (None) sample counting 0;
    ``eval/<name>-truncated_ratio``: fraction with status ``truncated``;
    ``eval/<name>-none_reward_ratio``: fraction with reward None;
    ``eval/<name>/response_len/{mean,median,max,min}``: effective lengths in tokens.

    :raises PluginError: a dict reward without ``reward_key`` (``--eval-reward-key``) or
        lacking that key.
    """
    if not samples:
        return {}
    n = len(samples)
    rewards = [scalar_reward(s, reward_key, "--eval-reward-key") for s in samples]
    return {
        f"eval/{name}": sum(r for r in rewards if r is not None) / n,
        f"eval/{name}-truncated_ratio": _fraction((s.status == Status.TRUNCATED for s in samples), n),
        f"eval/{name}-none_reward_ratio": _fraction((r is None for r in rewards), n),
        **_length_stats(f"eval/{name}/response_len", [s.effective_response_length for s in samples]),
    }
