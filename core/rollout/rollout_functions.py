"""The Miles-style functions run on a rollout's groups: ``--rollout-sample-filter-path`` and
``--rollout-all-samples-process-path`` (each ``module.function(args, ...)``, plain or ``async def``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from furlong.hooks import PluginError, RunConfig, Sample

from ..plugins.adapters import import_dotted
from .data_cursor import DataCursor
from .group_ledger import group_id, is_finished

__all__ = ["RolloutFunctions"]

SAMPLE_FILTER = "rollout_sample_filter_path"
ALL_SAMPLES_PROCESS = "rollout_all_samples_process_path"


class RolloutFunctions:
    """Imports both functions at construction (a bad path fails at set-up) and runs them after a rollout.

    :raises PluginError: a flag names something that cannot be imported or is not callable.
    """

    def __init__(self, config: RunConfig):
        self.config = config
        self.sample_filter = _function(SAMPLE_FILTER, config.rollout_sample_filter_path)
        self.all_samples_process = _function(ALL_SAMPLES_PROCESS, config.rollout_all_samples_process_path)

    async def run(self, groups: list[list[Sample]], handed_out: list[list[Sample]], cursor: DataCursor) -> None:
        """``--rollout-sample-filter-path`` on the groups to train on (it may set ``remove_sample``),
        then ``--rollout-all-samples-process-path`` on every group that finished generating this
        rollout, kept or not, sorted by first index, with the data cursor.

        :param groups: the groups to train on.
        :param handed_out: every group handed out this rollout (buffered ones, to be resumed, are skipped).
        :raises PluginError: a function raised (the message names its flag).
        """
        if self.sample_filter:
            await self._call(SAMPLE_FILTER, self.config.rollout_sample_filter_path, self.sample_filter, groups)
        if self.all_samples_process:
            seen = {group_id(g) for g in cursor.buffer}
            finished = []
            for group in [*groups, *handed_out]:
                if group_id(group) not in seen and is_finished(group):
                    seen.add(group_id(group))
                    finished.append(group)
            finished.sort(key=lambda g: g[0].index)
            await self._call(ALL_SAMPLES_PROCESS, self.config.rollout_all_samples_process_path,
                             self.all_samples_process, finished, cursor)

    async def _call(self, dest: str, path: str, fn: Callable, *fn_args) -> None:
        try:
            result = fn(self.config.namespace(), *fn_args)
            if inspect.isawaitable(result):
                await result
        except PluginError:
            raise
        except Exception as exc:  # noqa: BLE001 - name the function at fault
            raise PluginError(f"{_flag(dest)} '{path}' failed: {type(exc).__name__}: {exc}") from exc


def _function(dest: str, path: str | None) -> Callable | None:
    if not path:
        return None
    fn = import_dotted(path, _flag(dest))
    if not callable(fn):
        raise PluginError(f"{_flag(dest)} '{path}': '{path.rpartition('.')[2]}' is a {type(fn).__name__}, "
                          f"not callable; point the flag at a function.")
    return fn


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")
