"""Drop groups holding an aborted sample (Miles' partial-rollout companion filter)."""

from __future__ import annotations

from furlong.hooks import FilterResult, Status, hookimpl

__all__ = ["filter"]


@hookimpl
def filter(samples):
    """Keep the group iff none of its samples is ``aborted``.

    Flags: none.

    :param samples: one prompt's group.
    :returns: ``FilterResult(True)``, or ``FilterResult(False, "group_has_aborted")``.
    """
    if any(s.status == Status.ABORTED for s in samples):
        return FilterResult(False, "group_has_aborted")
    return FilterResult(True)
