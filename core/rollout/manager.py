"""The rollout manager: runs the ``rollout`` hook with the parts that serve it, and keeps what outlives a rollout.

The parts, one job each: :class:`~.sample_runner.SampleRunner` (seed, generate and score a
group under the concurrency limit and the abort), :class:`~.group_filter.GroupFilter`
(dynamic sampling), :class:`~.group_ledger.GroupLedger` (where each drawn group went, by
group id), :class:`~.tracked_data.TrackedData` (the data cursor the plugin sees),
:class:`~.rollout_functions.RolloutFunctions` (the Miles-style functions run after a
rollout). The manager keeps the rollout plugin's run-long ``state`` (tasks in it are
cancelled by :meth:`RolloutManager.dispose`), the weight version last synced, the data
state snapshotted at the end of each rollout, and each rollout's metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time

from furlong.hooks import PluginError, RolloutContext, RolloutEngine, RunConfig, Sample, Status

from ..plugins.manager import FurlongPluginManager
from ..plugins.selection import Selection
from .data_cursor import DataCursor
from .data_state import data_state
from .failed_rollout import dump_failed_rollout
from .generation_progress import GenerationProgress
from .group_filter import GroupFilter
from .group_ledger import GroupLedger, group_id
from .rollout_functions import RolloutFunctions
from .rollout_metrics import accounting_metrics
from .sample_runner import SampleRunner
from .tracked_data import TrackedData

__all__ = ["RolloutManager"]

log = logging.getLogger("furlong.rollout")


class RolloutManager:
    """Generates rollouts (``await manager.generate(rollout_id)``) and evaluation groups (:meth:`generate_group`).

    :raises PluginError: at construction, a dotted-path flag names no callable.
    """

    def __init__(self, config: RunConfig, pm: FurlongPluginManager, selection: Selection,
                 engine: RolloutEngine, cursor: DataCursor):
        self.config = config
        self.pm = pm
        self.selection = selection
        self.engine = engine
        self.cursor = cursor
        self.ledger = GroupLedger()
        self._progress = GenerationProgress()
        self.runner = SampleRunner(config, pm, selection, engine, self._progress)
        self.group_filter = GroupFilter(config, pm, selection, self.ledger)
        self.functions = RolloutFunctions(config, pm, selection)
        self.data = TrackedData(cursor, self.ledger, self._progress)
        self.rollout_state: dict = {}
        self.weight_version: int | None = None
        self.data_states: dict[int, dict] = {}
        self.rollout_metrics: dict[int, dict] = {}

    async def generate(self, rollout_id: int) -> list[list[Sample]]:
        """Run the chosen ``rollout`` plugin for ``rollout_id``; return the groups to train on.

        Right after accounting, the data state (:meth:`data_state`) is kept in
        ``data_states[rollout_id]`` (the last two rollouts): train-async saves it with rollout
        ``rollout_id``'s checkpoint while rollout ``rollout_id + 1`` is already drawing
        (docs/modes.md, "train-async").

        :raises PluginError: the plugin (or a generate/reward it called) failed; the
            rollout's samples were first written to ``failed_rollout_<id>.jsonl``.
        """
        self.runner.clear_abort()
        self._progress.restart()
        self.cursor.rollout_id = rollout_id
        buffered_before = {group_id(g) for g in self.cursor.buffer}
        context = RolloutContext(engine=self.engine, data=self.data, generate_group=self.runner.generate_group,
                                 filter_group=self.group_filter.filter_group, abort=self.runner.abort,
                                 state=self.rollout_state, weight_version=self.weight_version)
        name, flag = self.selection.chosen["rollout"]
        start = time.perf_counter()
        try:
            groups = await self.pm.call_chosen("rollout", name, flag, config=self.config, rollout_id=rollout_id,
                                               context=context)
        except Exception as exc:
            path = dump_failed_rollout(self.config, rollout_id, self.ledger.handed_out_groups())
            self.ledger.new_window()
            message = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}"
            raise PluginError(f"rollout {rollout_id} failed: {message}\n"
                              f"  The rollout's samples are in {path}.") from exc
        finally:
            self.runner.clear_abort()
        self._check_groups(name, groups)
        groups.sort(key=lambda g: g[0].index)
        await self.functions.run(groups, self.ledger.handed_out_groups(), self.cursor)
        buffered_now = {group_id(g) for g in self.cursor.buffer} - buffered_before
        window = self.ledger.settle(groups, buffered_now, self.cursor.counters)
        context.metrics.update(accounting_metrics(window, self.cursor.counters, self.cursor.buffer_len()))
        self.data_states[rollout_id] = self.data_state()
        for old in [r for r in self.data_states if r < rollout_id - 1]:
            del self.data_states[old]
        context.metrics["perf/rollout_time"] = time.perf_counter() - start
        self.rollout_metrics[rollout_id] = context.metrics
        return groups

    async def generate_group(self, group: list[Sample], evaluation: bool = False,
                             sampling_params: dict | None = None) -> list[Sample]:
        """Generate and score ``group`` in place (:meth:`SampleRunner.generate_group`); return it."""
        return await self.runner.generate_group(group, evaluation=evaluation, sampling_params=sampling_params)

    @property
    def progress(self) -> dict[str, int]:
        """``samples_done``, ``samples_total``, ``tokens`` of the rollout generating now."""
        return self._progress.as_dict()

    def set_weight_version(self, version: int) -> None:
        """Record the weight version the trainer just pushed to the engine.

        :raises PluginError: ``version`` is older than the one recorded (versions never go back).
        """
        if self.weight_version is not None and version < self.weight_version:
            raise PluginError(f"weight version went backwards: {version} after {self.weight_version}; "
                              "each weight sync must increase it.")
        self.weight_version = int(version)

    def data_state(self) -> dict:
        """The data side's checkpoint state now: the cursor's, with the groups the rollout plugin holds buffered."""
        return data_state(self.cursor, self.ledger.held())

    async def dispose(self) -> None:
        """End of the run: cancel and await every ``asyncio.Task`` kept in the rollout plugin's ``state``;
        close the sample runner's connections."""
        await self.runner.close()
        loop = asyncio.get_running_loop()
        tasks = [t for t in self.rollout_state.values()
                 if isinstance(t, asyncio.Task) and not t.done() and t.get_loop() is loop]
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # noqa: BLE001 - the run is over; report, do not mask the run's outcome
                log.warning("rollout plugin task %s ended with %s: %s", task.get_name(), type(exc).__name__, exc)

    def _check_groups(self, name: str, groups: list[list[Sample]]) -> None:
        if len(groups) != self.config.rollout_batch_size:
            raise PluginError(f"rollout plugin '{name}' returned {len(groups)} groups; "
                              f"--rollout-batch-size is {self.config.rollout_batch_size}.")
        for group in groups:
            for sample in group:
                if sample.status in (Status.ABORTED, Status.PENDING):
                    raise PluginError(f"rollout plugin '{name}' returned sample {sample.index} with status "
                                      f"{sample.status.value}; only generated samples can be trained on.")
