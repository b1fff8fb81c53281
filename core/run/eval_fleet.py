"""The dedicated eval fleet (``--eval-num-gpus``): evaluation on engines of its own while training goes on.

Miles' design (radixark/miles ``miles/ray/rollout/eval_dispatch.py``, ``eval_fleet.py``): at each eval
point the trainer writes its weights as a Hugging Face snapshot (``--eval-hf-dir``/``step_<rollout id>``,
or, without that flag, the ``--save-hf`` export of that rollout), the evaluation of the snapshot is
started without waiting for it, and training goes on. Evaluations run one at a time on the fleet: each
loads its snapshot into every eval engine (``update_weights_from_disk``), then generates and scores the
eval sets there, and logs its ``eval/...`` metrics at the rollout id it evaluated, with
``eval/lag_steps`` (rollouts trained meanwhile), ``eval/duration_seconds`` and
``eval/export_time_seconds``. At most ``--eval-max-in-flight`` evaluations are pending (queued or
running); a point due beyond that waits for the oldest (``--eval-overflow-policy backpressure``) or is
dropped, logged as ``eval/skipped_busy`` (``skip``; the run's last point is never dropped). A failed
evaluation is logged as ``eval/skipped_<reason>`` (``ckpt_missing``, ``crashed``) and training goes on.
Once an evaluation settled its snapshot is retired; snapshots this module wrote beyond the
``--eval-keep-snapshots`` most recent retired ones are deleted (``--save-hf`` exports never are).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections import deque
from typing import Any, Awaitable, Callable

from furlong.hooks import PluginError, RunConfig
from furlong.kit.hf import is_hf_dir

from .checkpoints import hf_export_dir

__all__ = ["EvalFleet", "fleet_config", "fleet_engine_count", "snapshot_dir"]

log = logging.getLogger("furlong")


def fleet_config(config: RunConfig) -> RunConfig:
    """The configuration the fleet's engines are built from (:attr:`furlong.hooks.RunConfig.eval_engine`)."""
    per = int(config.eval_num_gpus_per_engine)
    return config.replace(eval_engine=True, rollout_num_gpus_per_engine=per, sglang_tp_size=per,
                          sglang_passthrough={**config.sglang_passthrough, **config.eval_sglang_passthrough})


def fleet_engine_count(config: RunConfig) -> int:
    """Engines of the fleet: ``--eval-num-gpus // --eval-num-gpus-per-engine`` (at least one)."""
    return max(1, int(config.eval_num_gpus) // int(config.eval_num_gpus_per_engine))


def snapshot_dir(config: RunConfig, rollout_id: int) -> str:
    """Where rollout ``rollout_id``'s snapshot is: ``--eval-hf-dir``/``step_<id>``, else its ``--save-hf`` export."""
    if config.eval_hf_dir:
        return os.path.join(config.eval_hf_dir, f"step_{rollout_id}")
    return hf_export_dir(config, rollout_id)


class EvalFleet:
    """Dispatches evaluations to the fleet's engines without holding up the training loop.

    :param engines: the fleet's engines (``update_weights_from_disk`` and ``set_weight_version`` are called).
    :param evaluate: ``await evaluate(rollout_id, hf_dir, start=...)`` -> metrics: the rollout side's evaluation on
        the fleet (``start``: of the weights the rollout starts from, for its error messages).
    :param export: ``await export(path)`` writes the trainer's weights as a Hugging Face directory, or None
        (no trainer: only ``--save-hf`` exports and the start's ``--hf-checkpoint`` can be evaluated).
    :param log_point: ``await log_point(rollout_id, metrics)`` logs one eval row.
    :param latest: the rollout id training has reached (for ``eval/lag_steps``).
    :raises PluginError: an engine without ``update_weights_from_disk`` (names ``--rollout-backend``).
    """

    def __init__(self, config: RunConfig, engines: list, evaluate: Callable[..., Awaitable[dict]],
                 export: Callable[[str], Awaitable[Any]] | None,
                 log_point: Callable[[int, dict], Awaitable[None]], latest: Callable[[], int]) -> None:
        missing = [e for e in engines if not callable(getattr(e, "update_weights_from_disk", None))]
        if missing:
            raise PluginError(f"--eval-num-gpus: the engines of --rollout-backend {config.rollout_backend} "
                              f"({type(missing[0]).__name__}) cannot load a weight snapshot from disk "
                              "(update_weights_from_disk), which the eval fleet feeds them; use an engine that "
                              "can (embedded, sglang), or evaluate on the rollout engines (--eval-num-gpus 0).")
        self.config, self.engines, self.evaluate, self.export = config, list(engines), evaluate, export
        self.log_point, self.latest = log_point, latest
        self.pending: deque[tuple[int, asyncio.Task, str | None]] = deque()
        self.retired: list[str] = []  # snapshots this fleet wrote whose evaluation settled, oldest first
        self._one_at_a_time = asyncio.Lock()

    async def dispatch(self, rollout_id: int, force: bool = False, hf_dir: str | None = None,
                       start: bool = False) -> None:
        """Start the evaluation of rollout ``rollout_id``'s weights; return once it is queued (or dropped).

        :param force: never drop it under ``--eval-overflow-policy skip`` (the run's last point).
        :param hf_dir: a Hugging Face directory holding those weights already (the start's
            ``--hf-checkpoint``): nothing is exported and it is never deleted.
        :param start: the weights rollout ``rollout_id`` starts from (a failure says "before rollout N").
        :raises PluginError: the export failed (the trainer's error).
        """
        await self._reap()
        if len(self.pending) >= self.config.eval_max_in_flight:
            if self.config.eval_overflow_policy == "skip" and not force:
                log.warning("eval of rollout %d skipped: %d evaluations in flight (--eval-max-in-flight %d, "
                            "--eval-overflow-policy skip)", rollout_id, len(self.pending),
                            self.config.eval_max_in_flight)
                await self.log_point(rollout_id, {"eval/skipped_busy": 1})
                return
            await self._settle(*self.pending.popleft())
        written, export_time = None, None
        if hf_dir is None and self.config.eval_hf_dir and self.export is not None:
            hf_dir = written = snapshot_dir(self.config, rollout_id)
            began = time.perf_counter()
            if os.path.isdir(hf_dir):  # left by an earlier run
                shutil.rmtree(hf_dir)
            await self.export(hf_dir)
            export_time = time.perf_counter() - began
        elif hf_dir is None:
            hf_dir = snapshot_dir(self.config, rollout_id)
        task = asyncio.ensure_future(self._evaluate(rollout_id, hf_dir, export_time, start))
        self.pending.append((rollout_id, task, written))

    async def drain(self) -> None:
        """Wait for every pending evaluation (end of the run)."""
        while self.pending:
            await self._settle(*self.pending.popleft())

    async def cancel(self) -> None:
        """Stop every pending evaluation (the run failed or was interrupted)."""
        tasks = [task for _, task, _ in self.pending]
        self.pending.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _reap(self) -> None:
        """Settle the evaluations at the head of the queue that finished."""
        while self.pending and self.pending[0][1].done():
            await self._settle(*self.pending.popleft())

    async def _settle(self, rollout_id: int, task: asyncio.Task, written: str | None) -> None:
        try:
            await task
        finally:
            self._retire(written)

    def _retire(self, written: str | None) -> None:
        if written is None:
            return
        self.retired.append(written)
        while len(self.retired) > self.config.eval_keep_snapshots:
            shutil.rmtree(self.retired.pop(0), ignore_errors=True)

    async def _evaluate(self, rollout_id: int, hf_dir: str, export_time: float | None, start: bool) -> None:
        """Evaluate the snapshot ``hf_dir`` on the fleet and log it; a failure is logged, in its turn, as
        ``eval/skipped_crashed`` (so the rows of a run's evaluations end with its last rollout's)."""
        try:
            await self._evaluate_now(rollout_id, hf_dir, export_time, start)
        except Exception as exc:  # noqa: BLE001 - a failed evaluation is a skipped point, as in Miles
            reason = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}"
            log.error("eval of rollout %d failed, logged as eval/skipped_crashed: %s", rollout_id, reason)
            await self.log_point(rollout_id, {"eval/skipped_crashed": 1})

    async def _evaluate_now(self, rollout_id: int, hf_dir: str, export_time: float | None, start: bool) -> None:
        async with self._one_at_a_time:
            if not is_hf_dir(hf_dir):
                log.warning("eval of rollout %d skipped: no snapshot at %s", rollout_id, hf_dir)
                await self.log_point(rollout_id, {"eval/skipped_ckpt_missing": 1})
                return
            began = time.perf_counter()
            await asyncio.gather(*(e.update_weights_from_disk(hf_dir) for e in self.engines))
            await asyncio.gather(*(e.set_weight_version(rollout_id) for e in self.engines))
            metrics = await self.evaluate(rollout_id, hf_dir, start=start)
        metrics["eval/lag_steps"] = max(self.latest() - rollout_id, 0)
        metrics["eval/duration_seconds"] = time.perf_counter() - began
        if export_time is not None:
            metrics["eval/export_time_seconds"] = export_time
        await self.log_point(rollout_id, metrics)
