"""The rollout side of a run: data, rollout manager, rewards and evaluation, in one object the executor places.

The loop talks to it only through coroutines that take and return plain data (rollout
ids, groups of :class:`~furlong.hooks.Sample`, metrics, JSON states), so an executor can
keep it in the driver's process (``local``) or put it in an actor of its own (``ray``: the
rollout-manager actor). Where it runs it builds everything itself from the launch flags
and the selection: the plugin manager (unless it runs in the driver's process), the data
source and cursor, the evaluation sets, the :class:`~furlong.core.rollout.manager.RolloutManager`.
"""

from __future__ import annotations

import os
from typing import Any

from furlong.hooks import PluginError, RunConfig, Sample

from .data_cursor import DataCursor
from .datasets import train_dataset
from .debug_data import load_rollout, rollout_path, save_rollout
from .engines import EngineSet, NoEngine
from .evaluation import Evaluator
from .rewards import check_first_rows_name_a_reward
from .manager import RolloutManager
from ..plugins.selection import Selection, plugins_of_this_process

__all__ = ["RolloutSide", "RolloutSideFactory"]


class RolloutSide:
    """The rollout-manager role: ``generate``, ``evaluate``, data state, weight versions.

    Call order: :meth:`load_data` (before any model loads: bad data fails first), then
    :meth:`start` once the engines exist, then the rest; :meth:`dispose` at the end.
    """

    def __init__(self, config: RunConfig, selection: Selection, pm: Any = None) -> None:
        self.config, self.selection, self.pm = config, selection, pm
        self.cursor: DataCursor | None = None
        self.evaluator: Evaluator | None = None
        self.manager: RolloutManager | None = None
        self.fleet: RolloutManager | None = None  # generates on the dedicated eval engines (--eval-num-gpus)
        self.debug_files_checked = False

    async def load_data(self) -> bool:
        """Create the train and eval data sources; return whether there are eval sets.

        :raises PluginError: the data source plugin's own error (bad files are named there).
        """
        if self.pm is None:  # a process of its own (the rollout-manager actor)
            self.pm = plugins_of_this_process(self.config)
        sel = self.selection
        source = await self.pm.call_chosen("data_source", *sel.chosen["data_source"],
                                           config=self.config, dataset=train_dataset(self.config))
        rollout_plugin = self.pm.get_plugin(sel.chosen["rollout"][0])
        if sel.reward is None and getattr(rollout_plugin, "NEEDS_REWARD", True):
            check_first_rows_name_a_reward(self.config, self.pm, source)
        self.cursor = DataCursor(self.config, self.pm, source, sel.chosen["buffer_pop"])
        self.evaluator = Evaluator(self.config, self.pm, sel)
        await self.evaluator.load()
        return bool(self.evaluator)

    async def dataset_size(self) -> int | None:
        """Prompts in the train data source (``len()``), or None when it cannot tell (``--num-epoch``)."""
        source = self.cursor.source if self.cursor is not None else None
        return len(source) if hasattr(source, "__len__") else None

    async def start(self, engines: list, state: dict | None) -> None:
        """Resume the data position from a checkpoint's ``state`` (or start fresh) and build the manager."""
        if state:
            self.cursor.load_state(state)
        engine = NoEngine() if not engines else engines[0] if len(engines) == 1 else EngineSet(engines)
        self.manager = RolloutManager(self.config, self.pm, self.selection, engine, self.cursor)

    async def start_eval_fleet(self, engines: list) -> None:
        """Build the manager that evaluates on the dedicated eval engines (``--eval-num-gpus``); after :meth:`start`."""
        engine = engines[0] if len(engines) == 1 else EngineSet(engines)
        self.fleet = RolloutManager(self.config, self.pm, self.selection, engine, self.cursor)

    async def generate(self, rollout_id: int) -> list[list[Sample]]:
        """The groups to train on for ``rollout_id``: the ``rollout`` hook and everything it calls, or the
        file of ``--load-debug-rollout-data``; written to ``--save-debug-rollout-data``'s file when given.

        :raises PluginError: a loaded rollout does not have ``--rollout-batch-size`` groups (or see
            :func:`~.debug_data.load_rollout`).
        """
        config = self.config
        if config.load_debug_rollout_data:
            if not self.debug_files_checked:  # every file the run will read, before it trains on the first
                _check_debug_files(config, rollout_id)
                self.debug_files_checked = True
            groups = load_rollout(config.load_debug_rollout_data, rollout_id)
            _check_loaded(config, rollout_id, groups)
        else:
            groups = await self.manager.generate(rollout_id)
        if config.save_debug_rollout_data:
            save_rollout(config.save_debug_rollout_data, rollout_id, (s for g in groups for s in g))
        return groups

    async def evaluate(self, rollout_id: int = 0, hf_dir: str | None = None, start: bool = False) -> dict:
        """Generate and score every eval set (the evaluation of ``rollout_id``); ``eval/...`` metrics.

        :param hf_dir: None: on the rollout engines; else the snapshot the dedicated eval engines hold now (they
            generate, :meth:`start_eval_fleet`).
        :param start: the weights rollout ``rollout_id`` starts from (errors say "before rollout N").
        """
        manager = self.manager if hf_dir is None else self.fleet
        return await self.evaluator.evaluate(manager, rollout_id, hf_dir, start)

    async def data_state(self, rollout_id: int | None = None) -> dict | None:
        """The data side's checkpoint state now, or as it was when ``rollout_id``'s batch was drawn."""
        if rollout_id is None:
            return self.manager.data_state()
        return self.manager.data_states.get(rollout_id)

    async def pop_metrics(self, rollout_id: int) -> dict:
        """The ``rollout/...`` metrics the rollout of ``rollout_id`` gathered (once)."""
        return self.manager.rollout_metrics.pop(rollout_id, {})

    async def set_weight_version(self, version: int) -> None:
        self.manager.set_weight_version(version)

    async def progress(self) -> dict:
        """``samples_done``, ``samples_total``, ``tokens`` of the rollout generating now."""
        return dict(self.manager.progress)

    async def dispose(self) -> None:
        """Stop work a rollout plugin keeps across rollouts."""
        if self.manager is not None:
            await self.manager.dispose()
        if self.fleet is not None:
            await self.fleet.dispose()


def _check_debug_files(config: RunConfig, first: int) -> None:
    """Each rollout from ``first`` to the run's last has its ``--load-debug-rollout-data`` file, or one error
    naming the missing ones (before anything trains)."""
    template = config.load_debug_rollout_data
    last = config.num_rollout - 1 if config.num_rollout else first  # unknown here (--num-epoch): the first only
    missing = [(i, rollout_path(template, i)) for i in range(first, last + 1)
               if not os.path.isfile(rollout_path(template, i))]
    if missing:
        shown = ", ".join(f"{i} ({path})" for i, path in missing[:3]) + (" ..." if len(missing) > 3 else "")
        raise PluginError(f"--load-debug-rollout-data {template}: no file for {len(missing)} of rollouts {first}.."
                          f"{last}: {shown}. Write them in an earlier run with "
                          f"--save-debug-rollout-data {template}, or lower --num-rollout.")


def _check_loaded(config: RunConfig, rollout_id: int, groups: list[list[Sample]]) -> None:
    if len(groups) != config.rollout_batch_size:
        raise PluginError(f"--load-debug-rollout-data {config.load_debug_rollout_data}: rollout {rollout_id}'s file "
                          f"holds {len(groups)} groups (by group_index) but --rollout-batch-size is "
                          f"{config.rollout_batch_size}; launch with the batch flags of the run that saved it.")


class RolloutSideFactory:
    """``make_rollout_side()`` for :meth:`furlong.hooks.Executor.start_rollout_side`.

    Picklable: a copy sent to another process builds its own plugin manager there.
    """

    def __init__(self, config: RunConfig, selection: Selection, pm: Any = None) -> None:
        self.config, self.selection, self.pm = config, selection, pm

    def __call__(self) -> RolloutSide:
        return RolloutSide(self.config, self.selection, self.pm)

    def __getstate__(self) -> dict:
        return {"config": self.config, "selection": self.selection, "pm": None}
