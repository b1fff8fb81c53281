"""Dynamic sampling: keep or drop one finished group, recording the drop in the ledger."""

from __future__ import annotations

from furlong.hooks import FilterResult, RunConfig, Sample

from ..plugins.manager import FurlongPluginManager
from ..plugins.selection import Selection
from .group_ledger import GroupLedger, is_aborted

__all__ = ["GroupFilter"]


class GroupFilter:
    """Runs the chosen ``filter`` plugins (``--dynamic-sampling-filter`` and its path flag) in flag order."""

    def __init__(self, config: RunConfig, pm: FurlongPluginManager, selection: Selection, ledger: GroupLedger):
        self.config = config
        self.pm = pm
        self.selection = selection
        self.ledger = ledger

    async def filter_group(self, group: list[Sample], rollout_id: int) -> FilterResult:
        """Reject a group with an aborted sample (reason ``aborted``), then run the chosen filters;
        the first that rejects gives the reason, which the ledger counts.

        :raises PluginError: a filter failed or returned something else than a FilterResult or bool.
        """
        if is_aborted(group):
            result = FilterResult(keep=False, reason="aborted")
        else:
            result = FilterResult(keep=True)
            for name, flag in self.selection.filters:
                result = await self.pm.run_filters([name], flag, config=self.config, samples=group,
                                                   rollout_id=rollout_id)
                if not result.keep:
                    break
        if not result.keep:
            self.ledger.reject(group, result.reason)
        return result
