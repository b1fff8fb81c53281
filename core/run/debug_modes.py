"""What Miles' debug flags leave out of a run (docs/miles.md, "Debugging").

``--debug-train-only`` (implied by ``--load-debug-rollout-data``) starts no rollout engine:
no weight sync, no evaluation; the rollouts come from saved files. ``--debug-rollout-only``
starts no trainer: no training, no weight sync, no checkpoint. ``--debug-exit-after-rollout N``
ends the loop after the N-th rollout of this run (counted from the rollout it starts at).
"""

from __future__ import annotations

from furlong.hooks import RunConfig

__all__ = ["exits_after", "starts_engines", "starts_trainer", "syncs_weights"]


def starts_engines(config: RunConfig) -> bool:
    """Whether the run starts rollout engines (not under ``--debug-train-only``)."""
    return not config.debug_train_only


def starts_trainer(config: RunConfig) -> bool:
    """Whether the run starts train workers (not under ``--debug-rollout-only``)."""
    return not config.debug_rollout_only


def syncs_weights(config: RunConfig) -> bool:
    """Whether weights go from the trainer to the engines: only when the run has both."""
    return starts_engines(config) and starts_trainer(config)


def exits_after(config: RunConfig, rollout_id: int, start_id: int) -> bool:
    """Whether the loop stops after ``rollout_id``: ``--debug-exit-after-rollout N`` and this is the N-th rollout
    since ``start_id`` (the run's first)."""
    limit = config.debug_exit_after_rollout
    return limit is not None and rollout_id - start_id + 1 >= limit
