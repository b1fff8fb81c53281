"""Evaluation rollouts over the eval datasets (SPEC.md 5.3): no filters, no abort, no group RM."""

from __future__ import annotations

import argparse
import asyncio
import copy
import time

from furlong.hooks import PluginError, Sample

from .eval_config import EvalDataset, load_eval_datasets, sampling_params
from .metrics_log import eval_metrics
from .plugins import FurlongPluginManager
from .rollout_manager import RolloutManager
from .selection import Selection

__all__ = ["Evaluator"]


class Evaluator:
    """Loads every eval dataset once (through the ``data_source`` hook), then evaluates on demand.

    Construct it before any model loads: bad eval files fail here, naming file and line.
    """

    def __init__(self, args: argparse.Namespace, pm: FurlongPluginManager, selection: Selection):
        self.args = args
        self.datasets: list[tuple[EvalDataset, list[dict]]] = []
        name, flag = selection.chosen["data_source"]
        for ds in load_eval_datasets(args):
            ds_args = copy.copy(args)
            ds_args.prompt_data = ds.path
            ds_args.prompt_data_flag = (f"--eval-config dataset '{ds.name}'" if getattr(args, "eval_config", None)
                                        else f"--eval-prompt-data {ds.name}")
            ds_args.input_key = ds.input_key
            ds_args.label_key = ds.label_key
            ds_args.metadata_key = ds.metadata_key
            ds_args.tool_key = ds.tool_key
            ds_args.rollout_shuffle = False
            ds_args.rollout_max_prompt_len = args.eval_max_prompt_len
            source = pm.call_chosen_sync("data_source", name, flag, args=ds_args)
            if not hasattr(source, "__len__"):
                raise PluginError(f"{flag} '{name}': an eval data source must define __len__ (eval set '{ds.name}').")
            self.datasets.append((ds, source.next_rows(len(source))))

    def __bool__(self) -> bool:
        return bool(self.datasets)

    async def evaluate(self, manager: RolloutManager) -> dict:
        """Generate and score every eval dataset concurrently; return ``eval/...`` metrics."""
        start = time.perf_counter()
        per_set = await asyncio.gather(*(self._one(manager, ds, rows) for ds, rows in self.datasets))
        metrics: dict = {}
        for (ds, _), samples in zip(self.datasets, per_set):
            metrics.update(eval_metrics(ds.name, samples, self.args.eval_reward_key or self.args.reward_key))
        metrics["perf/eval_time"] = time.perf_counter() - start
        return metrics

    async def _one(self, manager: RolloutManager, ds: EvalDataset, rows: list[dict]) -> list[Sample]:
        params = sampling_params(ds, self.args)
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
