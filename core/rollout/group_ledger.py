"""Where each group drawn during a rollout went, keyed by its group id.

A group's id is the ``group_index`` its samples carry: the data cursor assigns it from a
run-wide counter when it draws the group, checkpoints keep it, and a buffered partial
group brings it back on resume, so a group keeps its id across aborts, the buffer and
restarts.

On the committed timeline: drawn = trained + filtered + surplus + aborted_dropped + buffered
(+ held, the groups a rollout plugin keeps across rollouts).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from furlong.hooks import PluginError, Sample, Status

__all__ = ["GroupLedger", "group_id", "is_finished", "is_aborted"]

Group = list[Sample]


def group_id(group: Group) -> int:
    """The id of ``group``: the ``group_index`` its first sample carries.

    :raises PluginError: the group is empty or its first sample has no ``group_index``
        (groups handed to the core keep the samples the data cursor drew).
    """
    if not group or group[0].group_index is None:
        what = "an empty group" if not group else f"a group whose sample {group[0].index} has no group_index"
        raise PluginError(f"the rollout handed the core {what}; keep the samples (and their group_index) "
                          "of the groups context.data hands out.")
    return int(group[0].group_index)


def is_finished(group: Group) -> bool:
    """Every sample of ``group`` finished generating (completed, truncated or failed)."""
    return all(s.status in (Status.COMPLETED, Status.TRUNCATED, Status.FAILED) for s in group)


def is_aborted(group: Group) -> bool:
    """A sample of ``group`` was aborted."""
    return any(s.status == Status.ABORTED for s in group)


class GroupLedger:
    """The groups of the rollout counting now (a window) and the groups a rollout plugin holds.

    A window runs from the end of one rollout call to the end of the next: what a plugin
    does between two calls (a producer working across rollouts) is counted at the end of
    the next one. Held groups outlive windows until they are returned, buffered, rejected
    or released.
    """

    def __init__(self) -> None:
        self._handed_out: list[Group] = []
        self._drops: Counter = Counter()
        self._rejected: set[int] = set()
        self._held: dict[int, Group] = {}

    def handed_out(self, groups: Iterable[Group]) -> None:
        """The data cursor handed ``groups`` to the rollout plugin."""
        self._handed_out.extend(groups)

    def hold(self, groups: Iterable[Group]) -> None:
        """The plugin keeps ``groups`` after its call returns: do not count them yet."""
        for group in groups:
            self._held[group_id(group)] = group

    def release(self, groups: Iterable[Group]) -> None:
        """The plugin dropped these held groups: count them (surplus or aborted_dropped) at the end of the window."""
        for group in groups:
            self._held.pop(group_id(group), None)
            self._handed_out.append(group)

    def unhold(self, groups: Iterable[Group]) -> None:
        """``groups`` went back to the buffer (or were trained): no longer held."""
        for group in groups:
            self._held.pop(group_id(group), None)

    def reject(self, group: Group, reason: str | None) -> None:
        """A filter dropped ``group`` for ``reason`` (``unspecified`` when the filter gave none)."""
        self._drops[reason or "unspecified"] += 1
        gid = group_id(group)
        self._rejected.add(gid)
        self._held.pop(gid, None)

    def drop_counts(self) -> dict[str, int]:
        """Groups dropped by the filters this window, per reason."""
        return dict(self._drops)

    def held(self) -> list[Group]:
        """The groups the plugin holds, in the order it took them."""
        return list(self._held.values())

    def handed_out_groups(self) -> list[Group]:
        """Every group handed out (or released) this window, in order; a group may appear twice."""
        return list(self._handed_out)

    def settle(self, trained: list[Group], buffered_now: set[int], counters: dict) -> dict[str, float]:
        """Count the window into ``counters`` and start the next window.

        :param trained: the groups the rollout returned.
        :param buffered_now: ids of the groups that entered the buffer this rollout.
        :param counters: the cursor's run-wide ``SampleCounters``, updated in place.
        :returns: ``drops`` (per reason), ``drawn`` (groups handed out), ``kept``, ``filtered``, ``held``.
        """
        trained_ids = {group_id(g) for g in trained}
        self.unhold(trained)
        filtered = sum(self._drops.values())
        counters["trained"] += len(trained)
        counters["filtered"] += filtered
        seen: set[int] = set()
        for group in self._handed_out:
            gid = group_id(group)
            if gid in seen or gid in trained_ids or gid in buffered_now or gid in self._rejected or gid in self._held:
                continue
            seen.add(gid)
            if any(s.status in (Status.ABORTED, Status.PENDING) for s in group):
                counters["aborted_dropped"] += 1
            else:
                counters["surplus"] += 1
        window = {"drops": dict(self._drops), "drawn": len(self._handed_out), "kept": len(trained),
                  "filtered": filtered, "held": len(self._held)}
        self.new_window()
        return window

    def new_window(self) -> None:
        """Forget this window's hand-outs, drops and rejections (held groups stay)."""
        self._handed_out = []
        self._drops = Counter()
        self._rejected = set()
