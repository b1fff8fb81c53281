"""FIFO dequeue of buffered partial-rollout groups (the Miles default buffer filter)."""

from __future__ import annotations

from furlong.hooks import hookimpl

__all__ = ["buffer_pop"]


@hookimpl
def buffer_pop(buffer, num_samples):
    """Remove and return the oldest ``min(len(buffer), num_samples)`` groups.

    ``j = min(len(buffer), num_samples)`` (0 when ``num_samples <= 0``); ``buffer[:j]`` is
    returned in order and deleted from ``buffer`` in place. The core takes the remaining
    ``num_samples - j`` groups from the dataset.

    Flags: none (chosen by ``--buffer-filter pop_first``, the default).

    :param buffer: groups waiting in the partial-rollout buffer, oldest first; mutated.
    :param num_samples: the most groups to return.
    :returns: the popped groups, oldest first (possibly an empty list).
    """
    j = max(0, min(len(buffer), num_samples))
    popped = buffer[:j]
    del buffer[:j]
    return popped
