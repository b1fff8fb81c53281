"""Evaluation rollouts over the eval datasets: no filters, no abort, no group RM."""

from __future__ import annotations

import asyncio
import copy
import time

from furlong.hooks import DatasetSpec, PluginError, RunConfig, Sample, Status

from ..plugins.data_choice import data_source_for
from .datasets import eval_dataset
from .debug_data import save_rollout
from ..config.eval_config import EvalDataset, load_eval_datasets, sampling_params
from ..run.extra_metrics import eval_set_metrics
from ..run.metrics_log import scalar_reward
from ..plugins.manager import FurlongPluginManager
from .manager import RolloutManager
from ..plugins.selection import Selection

__all__ = ["Evaluator"]


class Evaluator:
    """Loads every eval dataset once (through the ``data_source`` hook), then evaluates on demand.

    Construct it before any model loads, then call :meth:`load` (:meth:`evaluate` calls it
    first; the rollout side calls it right after construction), so bad eval files fail
    early, naming file and line.
    """

    def __init__(self, config: RunConfig, pm: FurlongPluginManager, selection: Selection):
        self.config = config
        self.pm = pm
        self.source = selection.chosen["data_source"]
        self.custom_log = selection.paths.get("eval_rollout_log")
        self.datasets: list[tuple[EvalDataset, list[dict]]] = []
        self._to_load = []
        for ds in load_eval_datasets(config):
            spec = eval_dataset(config, ds)
            self._to_load.append((ds, spec, self._reader(spec)))

    def _reader(self, spec: DatasetSpec) -> tuple[str, str]:
        """``(plugin, flag)`` reading eval set ``ds``: the data source flags' choice, else the plugin that
        claims its file (:mod:`furlong.core.plugins.data_choice`), else ``--data-source``'s default."""
        by_file = data_source_for(self.config, self.pm, spec.path, spec.flag)
        if by_file is not None:
            return by_file
        if self.source[1] == "--prompt-data":  # the training file chose its reader; this file claims none
            return self.config.data_source, "--data-source"
        return self.source

    async def load(self) -> None:
        """Create the eval data sources not created yet, awaiting the ``data_source`` hook.

        :raises PluginError: a data source without ``__len__``, or the plugin's own error.
        """
        while self._to_load:
            ds, spec, reader = self._to_load[0]
            source = await self.pm.call_chosen("data_source", *reader, config=self.config, dataset=spec)
            self._add(ds, reader, source)
            self._to_load.pop(0)

    def _add(self, ds: EvalDataset, reader: tuple[str, str], source) -> None:
        name, flag = reader
        if not hasattr(source, "__len__"):
            raise PluginError(f"{flag} '{name}': an eval data source must define __len__ (eval set '{ds.name}').")
        self.datasets.append((ds, source.next_rows(len(source))))

    def __bool__(self) -> bool:
        return bool(self.datasets or self._to_load)

    async def evaluate(self, manager: RolloutManager, rollout_id: int = 0) -> dict:
        """Generate and score every eval dataset concurrently; return ``eval/...`` metrics.

        With ``--save-debug-rollout-data`` every set's samples are written as evaluation ``rollout_id``
        (:func:`~.debug_data.save_rollout`). ``--custom-eval-rollout-log-function-path`` sees every set's
        samples first; when it returns True only ``perf/eval_time`` is returned.
        """
        await self.load()
        start = time.perf_counter()
        per_set = await asyncio.gather(*(self._one(manager, ds, rows) for ds, rows in self.datasets))
        if self.config.save_debug_rollout_data:
            save_rollout(self.config.save_debug_rollout_data, rollout_id, (s for set_ in per_set for s in set_),
                         evaluation=True, metadata={"sets": [ds.name for ds, _ in self.datasets]})
        extra = {"perf/eval_time": time.perf_counter() - start}
        if self.custom_log is not None and await self._custom_log(rollout_id, per_set, extra):
            return extra
        metrics: dict = {}
        for (ds, _), samples in zip(self.datasets, per_set):
            metrics.update(eval_set_metrics(self.config, ds.name, samples, ds.n_samples_per_eval_prompt))
        return {**metrics, **extra}

    async def _custom_log(self, rollout_id: int, per_set: list[list[Sample]], extra: dict) -> bool:
        key = self.config.eval_reward_key or self.config.reward_key
        data = {ds.name: {"rewards": [scalar_reward(s, key, "--eval-reward-key") for s in samples],
                          "truncated": [s.status == Status.TRUNCATED for s in samples], "samples": samples}
                for (ds, _), samples in zip(self.datasets, per_set)}
        return await self.pm.call_chosen("eval_rollout_log", *self.custom_log, config=self.config,
                                         rollout_id=rollout_id, data=data, extra=dict(extra))

    async def _one(self, manager: RolloutManager, ds: EvalDataset, rows: list[dict]) -> list[Sample]:
        params = sampling_params(ds, self.config)
        groups = [[_eval_sample(row, ds, p * ds.n_samples_per_eval_prompt + j, p)
                   for j in range(ds.n_samples_per_eval_prompt)] for p, row in enumerate(rows)]
        await asyncio.gather(*(manager.generate_group(g, evaluation=True, sampling_params=params) for g in groups))
        return sorted((s for g in groups for s in g), key=lambda s: s.index)


def _eval_sample(row: dict, ds: EvalDataset, index: int, group_index: int) -> Sample:
    metadata = copy.deepcopy(row.get("metadata") or {})
    metadata.update(ds.metadata_overrides or {})
    if ds.rm_type:
        metadata["rm_type"] = ds.rm_type
    return Sample(prompt=copy.deepcopy(row["prompt"]), label=copy.deepcopy(row.get("label")), metadata=metadata,
                  group_index=group_index, index=index)
