"""Evaluation rollouts over the eval datasets: no filters, no abort, no group RM."""

from __future__ import annotations

import asyncio
import logging
import time

from furlong.hooks import DatasetSpec, PluginError, RunConfig, Sample, Status
from furlong.kit.rewards import reward_key_of

from ..plugins.data_choice import data_source_for
from .datasets import eval_dataset
from .debug_data import save_rollout
from .failed_rollout import dump_failed_rollout
from .eval_function import EvalContext, EvalSet, data_metrics, read_result
from ..config.eval_config import LONE_PATH_NAME, EvalDataset, load_eval_datasets, sampling_params
from ..run.extra_metrics import eval_set_metrics
from ..run.metrics_log import scalar_reward
from ..plugins.manager import FurlongPluginManager
from .manager import RolloutManager
from ..plugins.selection import Selection

__all__ = ["Evaluator"]

log = logging.getLogger("furlong.eval")


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
        self.function = selection.paths.get("eval_function")
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

        A lone ``--eval-prompt-data PATH`` (Miles' rule names its set ``aime``) is logged once loaded, and
        an error loading it says that rule.

        :raises PluginError: a data source without ``__len__``, or the plugin's own error.
        """
        lone = self.config.eval_prompt_data_lone and not self.config.eval_config
        rule = f"read as the path of an eval set named '{LONE_PATH_NAME}' (Miles' rule)"
        while self._to_load:
            ds, spec, reader = self._to_load[0]
            try:
                source = await self.pm.call_chosen("data_source", *reader, config=self.config, dataset=spec)
            except PluginError as exc:
                if not lone:
                    raise
                raise PluginError(f"{exc} One --eval-prompt-data value is {rule}; give NAME PATH pairs.") from exc
            self._add(ds, reader, source)
            self._to_load.pop(0)
            if lone:
                log.info("--eval-prompt-data %s: one value, %s; give NAME PATH to name it.", spec.path, rule)

    def _add(self, ds: EvalDataset, reader: tuple[str, str], source) -> None:
        name, flag = reader
        if not hasattr(source, "__len__"):
            raise PluginError(f"{flag} '{name}': an eval data source must define __len__ (eval set '{ds.name}').")
        self.datasets.append((ds, source.next_rows(len(source))))

    def __bool__(self) -> bool:
        return bool(self.datasets or self._to_load)

    async def evaluate(self, manager: RolloutManager, rollout_id: int = 0, hf_dir: str | None = None,
                       start: bool = False) -> dict:
        """Generate and score every eval dataset concurrently on ``manager``'s engine; return ``eval/...`` metrics.

        With ``--eval-function-path`` that function runs the evaluation instead
        (:mod:`~.eval_function`; ``hf_dir``: the snapshot the eval fleet loaded, handed to it) and its
        metrics are logged beside. With ``--save-debug-rollout-data`` every set's samples are written as
        evaluation ``rollout_id`` (:func:`~.debug_data.save_rollout`). ``--custom-eval-rollout-log-function-path``
        sees every set's data first; when it returns True only ``perf/eval_time`` (and the eval function's
        metrics) are returned.

        :param start: the evaluation of the weights rollout ``rollout_id`` starts from (before it), not of
            those it trained (after it); only errors say which.
        :raises PluginError: the eval function failed or returned something else than eval data (named); a
            generate or reward plugin failed on an eval set: the message names the set and the evaluation,
            and every set's samples were first written to ``failed_eval_<rollout_id>.jsonl``
            (:func:`~.failed_rollout.dump_failed_rollout`).
        """
        await self.load()
        began = time.perf_counter()
        if self.function is not None:
            data, extra = await self._call_function(manager, rollout_id, hf_dir)
        else:
            per_set = [self._groups(ds, rows) for ds, rows in self.datasets]
            try:
                await asyncio.gather(*(self._one(manager, ds, groups) for (ds, _), groups in zip(self.datasets, per_set)))
            except _SetFailed as failed:
                path = dump_failed_rollout(self.config, rollout_id, [g for groups in per_set for g in groups], "eval")
                when = f"{'before' if start else 'after'} rollout {rollout_id}"
                raise PluginError(f"evaluation of eval set '{failed.name}' {when} failed: {failed.message}\n"
                                  f"  The evaluation's samples are in {path}.") from failed.__cause__
            data = self._data([sorted((s for g in groups for s in g), key=lambda s: s.index) for groups in per_set])
            extra = {}
        if self.config.save_debug_rollout_data:
            samples = [s for entry in data.values() for s in entry.get("samples") or () if isinstance(s, Sample)]
            save_rollout(self.config.save_debug_rollout_data, rollout_id, samples,
                         evaluation=True, metadata={"sets": list(data)})
        extra["perf/eval_time"] = time.perf_counter() - began
        if self.custom_log is not None and await self.pm.call_chosen(
                "eval_rollout_log", *self.custom_log, config=self.config, rollout_id=rollout_id, data=data,
                extra=dict(extra)):
            return extra
        sizes = {ds.name: ds.n_samples_per_eval_prompt for ds, _ in self.datasets}
        flag = self.function[1] if self.function is not None else "evaluation"
        metrics: dict = {}
        for name, entry in data.items():
            if self.function is None:
                metrics.update(eval_set_metrics(self.config, name, entry["samples"], sizes[name]))
            else:
                size = sizes.get(name, self.config.n_samples_per_eval_prompt)
                metrics.update(data_metrics(self.config, name, entry, size, flag))
        return {**metrics, **extra}

    def eval_sets(self) -> list[EvalSet]:
        """The loaded eval sets as :class:`~.eval_function.EvalSet` (what an eval function gets)."""
        return [EvalSet(ds.name, rows, sampling_params(ds, self.config), ds.n_samples_per_eval_prompt,
                        ds.metadata_overrides, ds.rm_type) for ds, rows in self.datasets]

    async def _call_function(self, manager: RolloutManager, rollout_id: int, hf_dir: str | None) -> tuple[dict, dict]:
        async def generate_group(group: list[Sample], sampling_params: dict | None = None) -> list[Sample]:
            return await manager.generate_group(group, evaluation=True, sampling_params=sampling_params)

        context = EvalContext(engine=manager.engine, generate_group=generate_group, eval_sets=self.eval_sets(),
                              rollout_id=rollout_id, hf_dir=hf_dir)
        path, flag = self.function
        result = await self.pm.call_chosen("eval_function", path, flag, config=self.config, rollout_id=rollout_id,
                                           context=context)
        return read_result(result, f"{flag} {path}")

    def _data(self, per_set: list[list[Sample]]) -> dict:
        """Miles' eval data of the built-in evaluation: per set ``{"rewards", "truncated", "samples"}``."""
        key, flag = reward_key_of(self.config, evaluation=True)
        return {ds.name: {"rewards": [scalar_reward(s, key, flag) for s in samples],
                          "truncated": [s.status == Status.TRUNCATED for s in samples], "samples": samples}
                for (ds, _), samples in zip(self.datasets, per_set)}

    def _groups(self, ds: EvalDataset, rows: list[dict]) -> list[list[Sample]]:
        return EvalSet(ds.name, rows, sampling_params(ds, self.config), ds.n_samples_per_eval_prompt,
                       ds.metadata_overrides, ds.rm_type).groups()

    async def _one(self, manager: RolloutManager, ds: EvalDataset, groups: list[list[Sample]]) -> None:
        """Generate and score eval set ``ds``'s groups in place.

        :raises _SetFailed: a plugin failed (the set's name and the error's message).
        """
        params = sampling_params(ds, self.config)
        try:
            await asyncio.gather(*(manager.generate_group(g, evaluation=True, sampling_params=params)
                                   for g in groups))
        except Exception as exc:
            message = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}"
            raise _SetFailed(ds.name, message) from exc


class _SetFailed(Exception):
    """An eval set's generation or scoring failed; :meth:`Evaluator.evaluate` says which evaluation."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.message = message
