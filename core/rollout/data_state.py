"""The rollout side's checkpoint state: the data cursor's, plus the groups a rollout plugin holds."""

from __future__ import annotations

from furlong.hooks import Sample

from .data_cursor import DataCursor
from .group_ledger import is_finished

__all__ = ["data_state"]


def data_state(cursor: DataCursor, held: list[list[Sample]]) -> dict:
    """The cursor's checkpoint state (:meth:`DataCursor.state`) with the ``held`` groups added to its buffer.

    Held groups (in flight or queued by a plugin that works across rollouts) were drawn
    already: on resume they come back through the buffer. Finished ones keep their
    responses and rewards; unfinished ones are saved reset for a fresh start.

    :returns: a JSON-serializable dict (``data_source``, ``group_index``, ``sample_index``,
        ``buffer``, ``counters``).
    """
    state = cursor.state()
    for group in held:
        state["buffer"].append([_resumable(s, finished=is_finished(group)) for s in group])
    return state


def _resumable(sample: Sample, finished: bool) -> dict:
    """``sample.to_dict()``, or for a group still generating, the sample reset to start over."""
    if finished:
        return sample.to_dict()
    fresh = Sample.from_dict(sample.to_dict())
    fresh.reset_for_retry()
    return fresh.to_dict()
