"""What the logger plugins share: scalar selection, step values and the end of a run.

There is no end-of-run hook, so a logger tells the run's last event from the observer calls
themselves (:func:`is_last_event`): the ``on_rollout_end`` of rollout ``--num-rollout - 1``
when no evaluation follows it, else the ``on_eval_end`` of that rollout's evaluation (the loop
always evaluates after the final rollout when ``--eval-interval`` and eval data are set; with
the eval fleet, ``--eval-num-gpus``, evaluations of earlier rollouts may end after the final
rollout, and that of the final rollout ends last),
or the single evaluation of a ``--num-rollout 0`` run. Loggers flush on every call, so
a killed run loses nothing, and close at that last event; anything still open is closed at
interpreter exit.
"""

from __future__ import annotations

import math
from typing import Any

from furlong.hooks import RunConfig

__all__ = ["eval_follows_last_rollout", "is_last_event", "rollout_axis_step", "run_dir", "scalars"]


def scalars(metrics: dict, skip_prefixes: tuple[str, ...] = ()) -> dict[str, float]:
    """The finite numeric values of ``metrics`` as floats, in order.

    Python and numpy numbers and one-element tensors count (``.item()``); bools become 0.0/1.0;
    None, NaN, +-inf, strings, lists and keys starting with one of ``skip_prefixes`` are left out.

    Example: ``scalars({"a": 1, "b": None, "c": float("nan"), "train/x": 2.0}, ("train/",))``
    is ``{"a": 1.0}``.
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        key = str(key)
        if key.startswith(skip_prefixes):
            continue
        number = _number(value)
        if number is not None:
            out[key] = number
    return out


def _number(value: Any) -> float | None:
    if hasattr(value, "numel") and callable(value.numel):  # torch tensor
        if value.numel() != 1:
            return None
        value = value.item()
    elif hasattr(value, "item") and callable(value.item) and getattr(value, "size", 2) == 1:  # numpy scalar
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        value = float(value)
        return value if math.isfinite(value) else None
    return None


def run_dir(config: RunConfig) -> str | None:
    """The run's output folder: ``--save``, else ``--log-dir``, else None."""
    return config.save or config.log_dir


def eval_follows_last_rollout(config: RunConfig) -> bool:
    """Whether the loop evaluates after the final rollout: ``--eval-interval`` is set and
    eval data exists (``--eval-prompt-data`` or ``--eval-config``)."""
    return bool(config.eval_interval
                and (config.eval_prompt_data or config.eval_config))


def is_last_event(hook: str, config: RunConfig, rollout_id: int, last_rollout_seen: bool) -> bool:
    """Whether this observer call is the run's last (see the module docstring).

    :param hook: ``"on_rollout_end"``, ``"on_eval_end"`` or another observer hook (never last).
    :param last_rollout_seen: ``on_rollout_end`` of rollout ``--num-rollout - 1`` was seen.
    """
    num_rollout = config.num_rollout
    if num_rollout is None:
        return False
    if hook == "on_rollout_end":
        return rollout_id >= num_rollout - 1 and not eval_follows_last_rollout(config)
    if hook == "on_eval_end":
        return num_rollout == 0 or (last_rollout_seen and rollout_id >= num_rollout - 1)
    return False


def rollout_axis_step(config: RunConfig, rollout_id: int, use_train_step: bool) -> int:
    """x value of rollout and eval metrics: ``rollout_id``, or with ``use_train_step`` the
    optimizer step reached at the start of that rollout, ``rollout_id * S`` with
    ``S = --num-steps-per-rollout = rollout_batch_size * n_samples_per_prompt / global_batch_size``
    (``--wandb-always-use-train-step``)."""
    if not use_train_step:
        return int(rollout_id)
    steps = config.num_steps_per_rollout
    if not steps:
        steps = config.rollout_batch_size * config.n_samples_per_prompt // config.global_batch_size
    return int(rollout_id) * int(steps)
