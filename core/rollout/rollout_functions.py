"""The Miles-style functions run on a rollout's groups: ``--rollout-sample-filter-path`` and
``--rollout-all-samples-process-path`` (each ``module.function(args, ...)``, plain or ``async def``),
called through their adapter plugins (:mod:`furlong.core.plugins.path_specs`)."""

from __future__ import annotations

from furlong.hooks import RunConfig, Sample

from ..plugins.manager import FurlongPluginManager
from ..plugins.selection import Selection
from .data_cursor import DataCursor
from .group_ledger import group_id, is_finished

__all__ = ["RolloutFunctions"]


class RolloutFunctions:
    """Runs the functions the selection registered (``selection.paths``) after a rollout."""

    def __init__(self, config: RunConfig, pm: FurlongPluginManager, selection: Selection):
        self.config, self.pm, self.paths = config, pm, selection.paths

    async def run(self, groups: list[list[Sample]], handed_out: list[list[Sample]], cursor: DataCursor) -> None:
        """``--rollout-sample-filter-path`` on the groups to train on (it may set ``remove_sample``),
        then ``--rollout-all-samples-process-path`` on every group that finished generating this
        rollout, kept or not, sorted by first index, with the data cursor.

        :param groups: the groups to train on.
        :param handed_out: every group handed out this rollout (buffered ones, to be resumed, are skipped).
        :raises PluginError: a function raised (the message names its flag).
        """
        if "rollout_sample_filter" in self.paths:
            await self.pm.call_chosen("rollout_sample_filter", *self.paths["rollout_sample_filter"],
                                      config=self.config, samples=groups)
        if "rollout_all_samples_process" in self.paths:
            seen = {group_id(g) for g in cursor.buffer}
            finished = []
            for group in [*groups, *handed_out]:
                if group_id(group) not in seen and is_finished(group):
                    seen.add(group_id(group))
                    finished.append(group)
            finished.sort(key=lambda g: g[0].index)
            await self.pm.call_chosen("rollout_all_samples_process", *self.paths["rollout_all_samples_process"],
                                      config=self.config, all_samples=finished, data_source=cursor)
