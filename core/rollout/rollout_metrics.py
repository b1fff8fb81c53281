"""The ``rollout/dynamic_filter/*`` and ``rollout/accounting/*`` metrics of one rollout."""

from __future__ import annotations

__all__ = ["accounting_metrics"]


def accounting_metrics(window: dict, counters: dict, buffered: int) -> dict[str, float]:
    """Metrics of a settled window (:meth:`~furlong.core.rollout.group_ledger.GroupLedger.settle`).

    :param window: ``drops`` (``{reason: groups}``), ``drawn``, ``kept``, ``filtered``, ``held``.
    :param counters: the cursor's run-wide ``SampleCounters`` after settling.
    :param buffered: groups in the partial-rollout buffer now.
    :returns: ``rollout/dynamic_filter/drop_<reason>``, ``.../groups_drawn``, ``.../groups_kept``,
        ``.../groups_dropped``, then ``rollout/accounting/<counter>`` for every counter,
        ``.../buffered`` and ``.../held``; every value a float count of groups.
    """
    metrics = {f"rollout/dynamic_filter/drop_{reason}": float(count) for reason, count in window["drops"].items()}
    metrics["rollout/dynamic_filter/groups_drawn"] = float(window["drawn"])
    metrics["rollout/dynamic_filter/groups_kept"] = float(window["kept"])
    metrics["rollout/dynamic_filter/groups_dropped"] = float(window["filtered"])
    metrics.update({f"rollout/accounting/{k}": float(v) for k, v in counters.items()})
    metrics["rollout/accounting/buffered"] = float(buffered)
    metrics["rollout/accounting/held"] = float(window["held"])
    return metrics
