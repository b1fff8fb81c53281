"""The training loop (sync and train-async: docs/modes.md), written with async/await.

Miles-shaped: ``await group.train(...)``, ``await rollout_manager.generate(rollout_id)``,
``await group.update_weights()``, ``await group.save_model(...)``. ``run(config, pm, selection)``
is what ``furlong train`` calls, once the flags are parsed, the chosen plugins configured and the
configuration frozen.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from argparse import Namespace

from furlong.hooks import PluginError, RunConfig
from furlong.kit.compute_thread import shared_compute_thread

from ..config.train_rules import steps_per_rollout
from .checkpoints import critic_checkpoint, periodic, post_save_hook, resolve_start, save_checkpoint, should_save
from .debug_modes import exits_after, starts_engines, starts_trainer, syncs_weights
from ..rollout.engine_health import EngineHealthMonitor, health_monitor_wanted
from ..rollout.engines import EngineFactory
from .epochs import derive_num_rollout
from .eval_fleet import EvalFleet, fleet_config
from .metrics_log import SUPERSEDED_NAME, MetricsLog, set_aside_rows_from, summary_line, zero_spread_warning
from ..plugins.manager import FurlongPluginManager
from .preflight import check_paths
from .rollout_log import RolloutLog
from ..rollout.progress import RolloutProgress
from ..rollout.side import RolloutSideFactory
from .lock import lock_output_folders
from .seeding import seed_everything
from ..plugins.selection import Selection
from ..train.group import TrainGroup
from ..train.worker import WorkerFactory
from .weight_check import check_engine_weights
from .weight_sync import WeightSync

__all__ = ["run"]

log = logging.getLogger("furlong")

WARMUP_FREEZES = 3
"""Rollouts of an invocation after which :func:`freeze_survivors` runs again (on one H100, compiled
layers and CUDA graphs were made in the first two rollouts; the third catches a late variant; each
freeze costs one full collection)."""


class Run:
    """Everything one run holds: executor, data, engines, train group, rollout manager, logs."""

    def __init__(self, config: RunConfig, pm: FurlongPluginManager, selection: Selection):
        self.config = config
        self.pm = pm
        self.selection = selection
        self.executor = None
        self.metrics_dir = config.save or config.log_dir
        self.metrics = MetricsLog(None)
        self.rollout_log: RolloutLog | None = None  # once --num-rollout is known
        self.rollout = None  # the rollout side (RolloutSide, or the executor's handle on it)
        self.has_eval = False
        self.engines: list = []
        self.group: TrainGroup | None = None  # None under --debug-rollout-only
        self.critic: TrainGroup | None = None  # the critic's train group when config.use_critic
        self.weights: WeightSync | None = None
        self.fleet: EvalFleet | None = None  # the dedicated eval fleet (--eval-num-gpus)
        self.eval_engines: list = []
        self.latest_rollout = 0  # the rollout the loop is at (eval/lag_steps of the fleet's evaluations)
        self.resumed = False  # the trainer started from a checkpoint (not --hf-checkpoint's weights)
        self.resumed_from: str | None = None  # that checkpoint's iter_* folder (--save-retain-interval keeps it)
        self.started = time.monotonic()  # --exit-duration-in-mins counts from here
        self.saved_rollout: int | None = None  # the rollout of the last checkpoint started
        self.health: EngineHealthMonitor | None = None
        self.locks: list = []  # the run's locks on its output folders (core/run/lock.py)
        self.warned_zero_spread = False
        # train-async: rollout id -> {generate,train}_{start,end}, seconds since the loop started
        self.timeline: dict[int, dict[str, float]] = {}
        self.pending_save: asyncio.Task | None = None  # --async-save: the checkpoint being written
        self.warmup_freezes_left = WARMUP_FREEZES

    @property
    def is_driver(self) -> bool:
        return self.executor is None or self.executor.is_driver

    async def setup(self) -> int:
        """Start the executor, check data (before any model loads), start engines and train workers, resume.

        Returns the start rollout id. In a process that only serves train workers
        (``torchrun`` ranks above 0) this serves until the driver ends the run.
        """
        config, pm, sel = self.config, self.pm, self.selection
        seed_everything(config.seed, config.deterministic_mode)
        self.executor = _checked_executor(await pm.call_chosen("executor", *sel.chosen["executor"], config=config),
                                          *sel.chosen["executor"])
        if self.executor.is_driver:  # one run per output folder; told before its other problems
            self.locks = lock_output_folders(config)
        check_paths(config)
        train_plugins = {h: sel.chosen[h] for h in ("train_backend", "loss")}
        roles = ("actor", "critic") if config.use_critic else ("actor",)
        if not self.executor.is_driver:
            for role in roles:
                await self.executor.start_train_workers(config, WorkerFactory(config, train_plugins, pm, role))
            await self.executor.serve()
            return config.num_rollout
        self.rollout = await self.executor.start_rollout_side(config, RolloutSideFactory(config, sel, pm))
        # train and eval data, before any model loads; no engine, no evaluation (--debug-train-only)
        self.has_eval = await self.rollout.load_data() and starts_engines(config)
        self.config = config = derive_num_rollout(config, await self.rollout.dataset_size(), sel.name("data_source"))
        self.rollout_log = RolloutLog(config, pm, sel)
        if self.metrics_dir:
            self.metrics = MetricsLog(os.path.join(self.metrics_dir, "metrics.jsonl"))
        level, where = output_note(config)
        log.log(level, "%s", where)
        resume = resolve_start(config)
        self.resumed = bool(resume.load_dir)
        self.resumed_from = resume.load_dir
        if resume.start_rollout_id >= config.num_rollout:
            log.warning("the run starts at rollout %d and --num-rollout is %d: there is nothing left to train (a "
                        "finished run resumed, or --num-rollout lowered); raise --num-rollout to train further.",
                        resume.start_rollout_id, config.num_rollout)
        if self.metrics.path is not None:  # this run logs its rollouts from here on: earlier rows of them go aside
            moved = set_aside_rows_from(self.metrics.path, resume.start_rollout_id, steps_per_rollout(config))
            if moved:
                log.info("%s: %d rows of rollout %d and later (logged after the checkpoint this run starts from) moved "
                         "to %s", self.metrics.path, moved, resume.start_rollout_id, SUPERSEDED_NAME)
        engines = await self.executor.start_engines(config, EngineFactory(
            config, sel.chosen["rollout_engine"], pm)) if starts_engines(config) else []
        self.engines = engines
        if config.offload_rollout:  # the trainer loads first; the engines take their memory back at the first sync
            await self.all_engines("release_memory")
        if starts_trainer(config):
            await self.start_trainer(train_plugins, resume)
        await self.rollout.start(engines, resume.state)
        if self.has_eval and config.eval_num_gpus:
            await self.start_eval_fleet()
        self.weights = WeightSync(config, self.group, engines, self.executor.weights_in_process)
        for engine in engines:
            if hasattr(engine, "on_restart"):  # a remote engine that was replaced gets the current weights
                engine.on_restart = self.weights.resync
        if engines and health_monitor_wanted(config):
            self.health = EngineHealthMonitor.from_config(config, engines)
            self.weights.monitor = self.health
            self.health.start()
        return resume.start_rollout_id

    async def start_eval_fleet(self) -> None:
        """Start the dedicated eval engines beside the rollout engines (``--eval-num-gpus``) and the fleet
        that feeds them snapshots (:mod:`.eval_fleet`).

        :raises PluginError: the executor cannot start them (named), or see :class:`.eval_fleet.EvalFleet`.
        """
        config, sel = self.config, self.selection
        name, flag = sel.chosen["executor"]
        start = getattr(self.executor, "start_eval_engines", None)
        if start is None:
            raise PluginError(f"--eval-num-gpus {config.eval_num_gpus}: {flag} '{name}' cannot start eval engines "
                              "(it has no start_eval_engines); use --executor local or ray, or evaluate on the "
                              "rollout engines (--eval-num-gpus 0).")
        eval_config = fleet_config(config)
        self.eval_engines = await start(eval_config, EngineFactory(eval_config, sel.chosen["rollout_engine"], self.pm))
        await self.rollout.start_eval_fleet(self.eval_engines)
        export = self.group.save_hf if self.group is not None else None
        self.fleet = EvalFleet(config, self.eval_engines, self.rollout.evaluate, export, self.log_eval,
                               lambda: self.latest_rollout)
        log.info("eval fleet: %d engine(s) evaluate beside training (--eval-num-gpus %d)", len(self.eval_engines),
                 config.eval_num_gpus)

    @property
    def train_groups(self) -> list[TrainGroup]:
        """The actor's train group and the critic's when the run trains one; none under --debug-rollout-only."""
        return [group for group in (self.group, self.critic) if group is not None]

    async def start_trainer(self, train_plugins: dict, resume) -> None:
        """Start the actor's (and the critic's) train workers, load the checkpoint being resumed."""
        config, pm, sel = self.config, self.pm, self.selection
        self.group = TrainGroup(config, pm, sel, await self.executor.start_train_workers(
            config, WorkerFactory(config, train_plugins, pm)))
        if config.use_critic:
            self.critic = TrainGroup(config, pm, sel, await self.executor.start_train_workers(
                config, WorkerFactory(config, train_plugins, pm, "critic")), role="critic")
        for group in self.train_groups:
            await group.init()
        if resume.load_dir:
            await self.group.load_model(resume.load_dir)
        critic_dir = critic_checkpoint(config, resume) if self.critic is not None else None
        if critic_dir:
            await self.critic.load_model(critic_dir)
        if config.offload_train:
            for group in self.train_groups:
                await group.offload()

    def eval_due(self, rollout_id: int) -> bool:
        """Evaluate after ``rollout_id``: every ``--eval-interval``, after the last rollout and at each epoch's end."""
        config = self.config
        return bool(config.eval_interval and self.has_eval and periodic(
            rollout_id, config.eval_interval, config.num_rollout, config.num_rollout_per_epoch))

    async def all_engines(self, method: str) -> None:
        await asyncio.gather(*(getattr(engine, method)() for engine in self.engines))

    async def update_weights(self) -> float:
        """Sync weights to the engines (``--offload-rollout``: they take their memory back first); with
        ``--check-weight-update-equal`` compare them with the trainer's after. Nothing under the debug modes."""
        if not syncs_weights(self.config):
            return 0.0
        start = time.perf_counter()
        if self.config.offload_rollout:
            await self.all_engines("resume_memory")
            if self.health is not None:
                self.health.resume()
        version = await self.weights.push()
        if self.config.keep_old_actor:
            await self.group.keep_synced_weights(version)
        await self.rollout.set_weight_version(version)
        log.debug("weights synced, version %d", version)
        if self.config.check_weight_update_equal:
            compared = await check_engine_weights(self.config, self.group, self.engines, version)
            log.info("--check-weight-update-equal: after weight sync %d the %d engine(s) hold the trainer's %d "
                     "tensors exactly.", version, len(self.engines), compared)
        return time.perf_counter() - start

    async def evaluate(self, rollout_id: int, start: bool = False) -> None:
        """Evaluate the weights after ``rollout_id`` (``start``: the weights the run starts with) and log the
        ``eval/...`` metrics at it; with the eval fleet, start that evaluation and return (it is logged when it
        ends; the run's last one is never dropped, ``--eval-overflow-policy``)."""
        if self.fleet is None:
            await self.log_eval(rollout_id, await self.rollout.evaluate(rollout_id, start=start))
            return
        fresh = start and rollout_id == 0 and not self.resumed
        await self.fleet.dispatch(rollout_id, force=rollout_id == self.config.num_rollout - 1,
                                  hf_dir=self.config.hf_checkpoint if fresh else None, start=start)

    async def log_eval(self, rollout_id: int, metrics: dict) -> None:
        """Log one evaluation's metrics at ``eval/step`` ``rollout_id``; tell the plugins (``on_eval_end``)."""
        self.metrics.log(metrics, "eval/step", rollout_id)
        log.info("eval at rollout %d: %s", rollout_id,
                 ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.count("/") == 1 and "-" not in k))
        await self.pm.notify("on_eval_end", config=self.config, rollout_id=rollout_id, metrics=metrics)

    async def train_on(self, rollout_id: int, groups) -> dict:
        """Train on one rollout's groups; log per-step metrics; return the rollout's metrics (none under
        ``--debug-rollout-only``)."""
        config = self.config
        if self.group is None:
            return {}
        start = time.perf_counter()
        if config.offload_rollout:  # the engines give the device to the trainer
            if self.health is not None:
                self.health.pause()
            await self.all_engines("release_memory")
        if config.offload_train:
            for group in self.train_groups:
                await group.onload()
        concurrent = bool(getattr(self.executor, "concurrent_train_groups", False))
        [metrics] = await self.group.train(rollout_id, groups, self.critic, concurrent)
        steps = metrics.pop("train/steps")
        critic_steps = metrics.pop("critic/steps", [])
        for s in range(max(len(steps), len(critic_steps))):
            step_id = rollout_id * steps_per_rollout(config) + s
            step_metrics = {f"train/{k}": float(v) for k, v in (steps[s] if s < len(steps) else {}).items()}
            if s < len(critic_steps):
                step_metrics.update({f"critic/{k}": float(v) for k, v in critic_steps[s].items()})
            self.metrics.log(step_metrics, "train/step", step_id)
            await self.pm.notify("on_train_step_end", config=config, rollout_id=rollout_id, step=step_id,
                                 metrics=step_metrics)
            metrics.update(step_metrics)
        metrics["perf/train_time"] = time.perf_counter() - start
        return metrics

    async def save(self, rollout_id: int, data_state: dict | None = None) -> None:
        """Checkpoint ``rollout_id`` with ``data_state`` (default: the data side's state now).

        ``--async-save``: the checkpoint is written by a task of its own while the loop goes on (weight
        sync, the next rollout's generation); the trainer's next operation waits for the train ranks'
        part (every operation on them holds the group's lock), and the run waits for the whole
        checkpoint before the next save and at its end (:meth:`wait_for_save`).
        """
        await self.wait_for_save()
        self.saved_rollout = rollout_id
        if data_state is None:
            data_state = await self.rollout.data_state()
        if self.config.async_save:
            self.pending_save = asyncio.ensure_future(self._save(rollout_id, data_state))
            await asyncio.sleep(0)  # the task takes the trainer's lock before the loop's next operation
        else:
            await self._save(rollout_id, data_state)

    async def _save(self, rollout_id: int, data_state: dict) -> None:
        path = await save_checkpoint(self.config, rollout_id, self.group.save_model, data_state, self.group.save_hf,
                                     post_save_hook(self.config, self.pm, self.selection, rollout_id),
                                     save_critic=self.critic.save_model if self.critic is not None else None,
                                     keep=self.resumed_from)
        await self.pm.notify("on_checkpoint_saved", config=self.config, rollout_id=rollout_id, path=path)

    async def wait_for_save(self) -> None:
        """Wait for the checkpoint ``--async-save`` is writing, if any (its error, if it failed, is raised here)."""
        task, self.pending_save = self.pending_save, None
        if task is not None:
            await task

    def save_due(self, rollout_id: int) -> bool:
        """Whether a checkpoint follows ``rollout_id`` (never without a trainer)."""
        return self.group is not None and should_save(self.config, rollout_id)

    async def release_trainer(self) -> None:
        """After training: the trainer's memory goes to the host (``--offload-train``), or its cached blocks go
        back to the device where engines in other processes share its GPUs (``--colocate`` without
        ``--offload-train``). Otherwise the cache is kept: the next train call reuses it, and an engine in the
        trainer's process allocates from the same cache; emptying it cost a full garbage collection, 0.2 s
        of every step in a process holding transformers."""
        for group in self.train_groups:
            if self.config.offload_train:
                await group.offload()
            elif self.config.colocate:
                await group.clear_memory()

    async def finish_rollout(self, rollout_id: int, groups, metrics: dict) -> None:
        extra = await self.rollout.pop_metrics(rollout_id)
        metrics.update(await self.rollout_log.metrics(rollout_id, groups, extra))
        metrics.update(extra)
        self.metrics.log(metrics, "rollout/step", rollout_id)
        if self.rollout_log.prints(rollout_id):
            print(summary_line(rollout_id, metrics), flush=True)
        warning = None if self.warned_zero_spread else zero_spread_warning(rollout_id, metrics, len(groups))
        if warning:
            log.warning("%s", warning)
            self.warned_zero_spread = True
        await self.pm.notify("on_rollout_end", config=self.config, rollout_id=rollout_id, metrics=metrics)
        if self.warmup_freezes_left:
            self.warmup_freezes_left -= 1
            freeze_survivors()


async def run(config: RunConfig, pm: FurlongPluginManager, selection: Selection) -> None:
    """Run ``furlong train`` (sync) or ``furlong train-async`` (``config.train_mode == "async"``).

    A sync run does its torch work in one thread (:mod:`furlong.kit.compute_thread`): its generation,
    training and weight sync never overlap.
    """
    with shared_compute_thread(enabled=shares_compute_thread(config)):
        await _run(config, pm, selection)


def shares_compute_thread(config: RunConfig) -> bool:
    """Whether the run does its torch work in one thread: sync runs only (an async run's engine
    decodes while the trainer trains, and may be paused mid-generation for a weight update)."""
    return config.train_mode != "async"


async def _run(config: RunConfig, pm: FurlongPluginManager, selection: Selection) -> None:
    _quiet_transformers()
    state = Run(config, pm, selection)
    frozen_by_caller = gc.get_freeze_count() > 0
    try:
        start_id = await state.setup()
        if not state.is_driver:
            return
        sync_time = await state.update_weights()
        freeze_survivors()
        if config.num_rollout == 0 and config.eval_interval and state.has_eval:
            await state.evaluate(0, start=True)
        elif config.train_mode == "async":
            await _async_loop(state, start_id, sync_time)
        else:
            await _sync_loop(state, start_id, sync_time)
        if state.fleet is not None:  # the evaluations still running end before the run does
            await state.fleet.drain()
        await state.wait_for_save()
    except BaseException as exc:
        if state.pending_save is not None:  # a checkpoint still being written: it finishes or fails first
            await asyncio.gather(state.pending_save, return_exceptions=True)
        try:
            # interrupted (Ctrl-C, SIGTERM): engine processes go with their parents; no more calls to them
            await _close(state, stop_engines=isinstance(exc, Exception))
        except Exception:  # noqa: BLE001 - the run's own error is the one to report
            log.warning("clean-up after the error failed too", exc_info=True)
        raise
    else:
        await _close(state)
    finally:
        for lock in state.locks:
            lock.release()
        if not frozen_by_caller:  # a caller that froze objects of its own keeps them frozen
            gc.unfreeze()  # a caller that runs again (tests) gets its objects collected as usual


async def _close(state: Run, stop_engines: bool = True) -> None:
    """Stop what the run started, in reverse order (engines that own processes, e.g. servers, stop them)."""
    try:
        if state.fleet is not None:
            await state.fleet.cancel()
        if state.health is not None:
            await state.health.stop()
        if state.rollout is not None:
            await state.rollout.dispose()  # stops work a rollout plugin keeps across rollouts
        if state.weights is not None:
            await state.weights.close()
    finally:
        try:
            if stop_engines:
                await asyncio.gather(*(e.shutdown() for e in [*state.engines, *state.eval_engines]
                                       if hasattr(e, "shutdown")))
        except Exception:  # noqa: BLE001 - the executor still stops its processes
            log.warning("an engine did not stop cleanly", exc_info=True)
        if state.executor is not None:
            await state.executor.shutdown()


def _eval_first(config: RunConfig, state: Run, rollout_id: int) -> bool:
    """Evaluate before rollout 0 trains; a resumed run does not evaluate before training (the checkpoint it
    resumes from was evaluated, if due, when it was written)."""
    return bool(config.eval_interval and state.has_eval and rollout_id == 0 and not config.skip_eval_before_train)


async def _sync_loop(state: Run, start_id: int, sync_time: float) -> None:
    """Generate, train, sync, one rollout after the other. ``perf/step_time``: seconds from a rollout's
    start to its weight sync's end (the whole step, evaluation and checkpoints excluded)."""
    config = state.config
    for rollout_id in range(start_id, config.num_rollout):
        state.latest_rollout = rollout_id
        if _eval_first(config, state, rollout_id):
            await state.evaluate(rollout_id, start=True)
        step_start = time.perf_counter()
        with RolloutProgress(state.rollout.progress, rollout_id):
            groups = await state.rollout.generate(rollout_id)
        metrics = await state.train_on(rollout_id, groups)
        # --async-save without --offload-train: the checkpoint is written after the weight sync, while the next
        # rollout generates (the weights stay those of this rollout until the next training step)
        save_due = state.save_due(rollout_id)
        save_later = save_due and config.async_save and not config.offload_train
        data_state = await state.rollout.data_state() if save_later else None
        if save_due and not save_later:
            start = time.perf_counter()
            await state.save(rollout_id)
            metrics["perf/save_model_time"] = time.perf_counter() - start
        await state.release_trainer()
        metrics["perf/update_weights_time"] = await state.update_weights()
        if save_later:
            start = time.perf_counter()
            await state.save(rollout_id, data_state)
            metrics["perf/save_model_time"] = time.perf_counter() - start
        metrics["perf/step_time"] = time.perf_counter() - step_start - metrics.get("perf/save_model_time", 0.0)
        await state.finish_rollout(rollout_id, groups, metrics)
        if state.eval_due(rollout_id):
            await state.evaluate(rollout_id)
        if exits_after(config, rollout_id, start_id):
            _log_exit(config, rollout_id)
            break
        if await _exit_early(state, rollout_id):
            break


async def _async_loop(state: Run, start_id: int, sync_time: float) -> None:
    """Rollout ``r + 1`` is generated while ``r`` trains (one step off-policy).

    Weights sync every ``--update-weights-interval`` rollouts, and only after the rollout
    in flight finished (never mid-generation); a rollout finished that way is trained on
    in the next iteration. A checkpoint of rollout ``r`` saves the data state taken when
    rollout ``r``'s generate finished, so prompts already drawn by rollout ``r + 1`` are
    drawn again on resume. Per rollout: ``perf/train_wait_time`` (seconds the trainer
    waited for generation), ``perf/step_time``, ``perf/wait_time_ratio`` (wait / step) and
    ``timeline/{generate,train}_{start,end}`` (seconds since the loop started, also in
    ``state.timeline``).
    """
    config = state.config
    if config.eval_interval and state.has_eval and start_id == 0 and not config.skip_eval_before_train:
        await state.evaluate(0, start=True)
    clock = time.perf_counter
    origin = clock()

    async def generate(rollout_id: int):
        state.timeline[rollout_id] = {"generate_start": clock() - origin}
        groups = await state.rollout.generate(rollout_id)
        state.timeline[rollout_id]["generate_end"] = clock() - origin
        return groups

    future = asyncio.ensure_future(generate(start_id)) if start_id < config.num_rollout else None
    data = None
    step_start = clock()
    try:
        for rollout_id in range(start_id, config.num_rollout):
            state.latest_rollout = rollout_id
            wait = clock()
            if future is not None:
                data, future = await future, None
            wait = clock() - wait
            groups = data
            if rollout_id + 1 < config.num_rollout:
                future = asyncio.ensure_future(generate(rollout_id + 1))  # overlaps training of rollout_id
            times = state.timeline[rollout_id]
            times["train_start"] = clock() - origin
            metrics = await state.train_on(rollout_id, groups)
            times["train_end"] = clock() - origin
            if state.save_due(rollout_id):
                start = time.perf_counter()
                await state.save(rollout_id, await state.rollout.data_state(rollout_id))
                metrics["perf/save_model_time"] = time.perf_counter() - start
            if _syncs_weights_after(config, rollout_id):
                if future is not None:  # never update mid-generation
                    waited = clock()
                    data, future = await future, None
                    wait += clock() - waited
                metrics["perf/update_weights_time"] = await state.update_weights()
            step = clock() - step_start
            step_start = clock()
            metrics.update({"perf/train_wait_time": wait, "perf/step_time": step,
                            "perf/wait_time_ratio": wait / step if step > 0 else 0.0})
            metrics.update({f"timeline/{k}": v for k, v in times.items()})
            await state.finish_rollout(rollout_id, groups, metrics)
            if state.eval_due(rollout_id):
                if future is not None and state.fleet is None:  # evaluation on the rollout engines: the rollout in flight ends first
                    data, future = await future, None
                await state.evaluate(rollout_id)
            if exits_after(config, rollout_id, start_id):
                _log_exit(config, rollout_id)
                break
            if await _exit_early(state, rollout_id, lambda r=rollout_id: state.rollout.data_state(r)):
                break
    finally:
        if future is not None and not future.done():
            future.cancel()
            await asyncio.gather(future, return_exceptions=True)


async def _exit_early(state: Run, rollout_id: int, data_state=None) -> bool:
    """Megatron-LM's ``--exit-interval`` and ``--exit-duration-in-mins`` after ``rollout_id`` (its save and
    evaluation done): whether the loop stops here; before it does, a checkpoint of ``rollout_id`` is written
    under ``--save`` unless one was (Megatron-LM ``megatron/training/training.py``,
    ``checkpoint_and_decide_exit``).

    :param data_state: coroutine function giving the data state to save (train-async: the state taken when
        this rollout's generation finished); None: the data side's state now.
    """
    reason = exit_reason(state.config, rollout_id, time.monotonic() - state.started)
    if reason is None:
        return False
    if state.group is not None and state.config.save and state.saved_rollout != rollout_id:
        await state.save(rollout_id, await data_state() if data_state is not None else None)
    log.info("%s: stopping after rollout %d%s.", reason, rollout_id,
             f", checkpoint {rollout_id} saved" if state.saved_rollout == rollout_id else "")
    return True


def exit_reason(config: RunConfig, rollout_id: int, elapsed_s: float) -> str | None:
    """Why the run stops early after ``rollout_id``, ``elapsed_s`` seconds after it started, or None.

    ``--exit-interval N``: when ``rollout_id + 1`` (rollouts done, counted as ``--save-interval`` counts
    them) is a multiple of N. ``--exit-duration-in-mins M``: when more than M minutes have passed. Never
    after the run's last rollout (it ends there anyway).
    """
    if config.num_rollout is None or rollout_id + 1 >= config.num_rollout:
        return None
    every = config.exit_interval
    if every and (rollout_id + 1) % every == 0:
        return f"--exit-interval {every}"
    limit = config.exit_duration_in_mins
    if limit and elapsed_s > limit * 60:
        return f"--exit-duration-in-mins {limit:g} ({elapsed_s / 60:.2f} minutes since the run started)"
    return None


def _log_exit(config: RunConfig, rollout_id: int) -> None:
    log.info("--debug-exit-after-rollout %d: stopping after rollout %d.", config.debug_exit_after_rollout, rollout_id)


def _syncs_weights_after(config: RunConfig, rollout_id: int) -> bool:
    """Whether the trainer pushes weights after training on ``rollout_id`` (every rollout in sync mode)."""
    return config.train_mode != "async" or (rollout_id + 1) % config.update_weights_interval == 0


def output_note(config: RunConfig) -> tuple[int, str]:
    """``(logging level, sentence)`` saying where the run's outputs go: a warning when it keeps none
    (neither ``--save`` nor ``--log-dir``: only the console lines) or when ``--log-dir`` is not used
    (``--save`` takes the metrics), else a note naming the folder."""
    if config.save:
        every = f"every {config.save_interval} rollouts and " if config.save_interval else ""
        saved = (f"checkpoints after {every}the last rollout" if starts_trainer(config)
                 else "no checkpoint (--debug-rollout-only trains nothing)")
        where = f"outputs go to {config.save}: metrics.jsonl, and {saved}."
        if config.log_dir and os.path.realpath(config.log_dir) != os.path.realpath(config.save):
            return logging.WARNING, f"{where} --log-dir {config.log_dir} is not used: with --save the metrics go there."
        return logging.INFO, where
    if config.log_dir:
        metrics = os.path.join(config.log_dir, "metrics.jsonl")
        return logging.INFO, f"metrics go to {metrics}; no checkpoints (no --save)."
    return logging.WARNING, ("neither --save nor --log-dir: this run keeps no metrics.jsonl and no checkpoint, only the "
                             "console lines; pass --log-dir DIR to keep its metrics, --save DIR for checkpoints too.")


def _checked_executor(executor, name: str, flag: str):
    """The executor plugin's object, if it has what the loop calls.

    :raises PluginError: it lacks an attribute of :class:`furlong.hooks.Executor` (named).
    """
    missing = [a for a in ("is_driver", "weights_in_process", "start_train_workers", "start_engines",
                           "start_rollout_side", "serve", "shutdown") if not hasattr(executor, a)]
    if missing:
        raise PluginError(f"{flag} '{name}': `executor` returned {type(executor).__name__}, which lacks "
                          f"{', '.join(missing)}; return an object meeting furlong.hooks.Executor.")
    return executor


def freeze_survivors() -> None:
    """Collect garbage, then keep every surviving object out of later collections (``gc.freeze``).

    A full collection scans every tracked object: up to 0.2 s in a GPU run's process with nothing
    frozen, about 80 ms with only the start frozen, and Python runs one as often as once a rollout on
    its own. The run freezes what the start made (modules of torch and transformers, models,
    tokenizers) and again after each of its first :data:`WARMUP_FREEZES` rollouts, which compile
    (``torch.compile``'s graphs and guards, the engine's CUDA graphs). :func:`run` unfreezes everything
    when it returns, unless its caller had frozen objects before it started (then all stay frozen).
    Objects still alive at a freeze are freed as usual by their reference counts; only a reference
    cycle formed among them would stay.
    """
    gc.collect()
    gc.freeze()


def _quiet_transformers() -> None:
    """No per-file progress bars from transformers: furlong prints one line per rollout."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
