"""The data cursor as a rollout plugin sees it (``context.data``): every group it hands out is on the ledger."""

from __future__ import annotations

from furlong.hooks import Sample

from .data_cursor import DataCursor
from .generation_progress import GenerationProgress
from .group_ledger import GroupLedger

__all__ = ["TrackedData"]


class TrackedData:
    """``context.data``: ``get_samples``, ``add_samples``, ``hold``, ``release``, ``buffer_len``, ``drop_counts``."""

    def __init__(self, cursor: DataCursor, ledger: GroupLedger, progress: GenerationProgress):
        self._cursor = cursor
        self._ledger = ledger
        self._progress = progress

    async def get_samples(self, k: int) -> list[list[Sample]]:
        """``k`` groups (buffer first, then fresh), recorded as handed out."""
        groups = await self._cursor.get_samples(k)
        self._ledger.handed_out(groups)
        self._progress.drawn(groups)
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Put partial groups into the buffer (they are no longer held)."""
        self._cursor.add_samples(groups)
        self._ledger.unhold(groups)

    def hold(self, groups: list[list[Sample]]) -> None:
        """The plugin keeps ``groups`` after its call returns: do not count them yet."""
        self._ledger.hold(groups)

    def release(self, groups: list[list[Sample]]) -> None:
        """The plugin dropped these held groups: count them (surplus or aborted_dropped) at the end of the rollout."""
        self._ledger.release(groups)

    def buffer_len(self) -> int:
        """Groups in the partial-rollout buffer."""
        return self._cursor.buffer_len()

    @property
    def drop_counts(self) -> dict:
        """Groups dropped by the filters this rollout, per reason."""
        return self._ledger.drop_counts()
