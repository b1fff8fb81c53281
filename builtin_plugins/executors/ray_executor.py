"""The ``ray`` executor: train ranks and rollout engines as Ray actors in one placement group.

Placement (docs/ray.md, "Cluster flags"): one bundle per device
slot, ``{"GPU": 1, "CPU": 1}`` on machines with GPUs and ``{"CPU": 1}`` on machines
without, so the same flags run on a laptop. The trainer takes
``--actor-num-nodes x --actor-num-gpus-per-node`` bundles; the engines take
``--rollout-num-gpus`` more (default ``--rollout-num-gpus-per-engine``, one engine), or,
under ``--colocate``, share the trainer's bundles. A train actor asks for 0.4 of its
bundle and an engine actor 0.2, so both fit one bundle when colocated. Rank 0 is
created first and names the rendezvous address; every rank then joins the trainer's
process group (NCCL on GPUs, gloo on CPUs).

Without ``RAY_ADDRESS`` the executor starts a private local Ray (``address="local"``)
and shuts it down at the end; under ``ray job submit`` (``RAY_ADDRESS`` set) it joins
that cluster and leaves it running. Every remote wait has a time-out
(``--ray-call-timeout``); a train actor that dies or raises ends the run with one
error naming its rank, node and process; an engine actor that dies is replaced (at most
``--ray-engine-restarts`` times), given the current weights, and its in-flight requests
are sent again.
"""

from __future__ import annotations

import asyncio
import logging
import os

from furlong.hooks import ExecutorFit, PluginError, hookimpl

from ._fit import in_process_reason, needs_actors
from .ray_actors import EngineActor, RolloutActor, TrainActor, actor_died
from .ray_actors import await_call as _await

__all__ = ["RayExecutor", "add_arguments", "executor", "executor_fit"]

log = logging.getLogger("furlong.ray")

NEEDS_RAY = '--executor ray needs Ray: pip install "furlong[ray]" (or pass --executor local).'
TRAIN_SHARE = 0.4  # of a bundle: a train actor and an engine actor (0.2) fit one bundle under --colocate
ENGINE_SHARE = 0.2
FAILURE_GRACE_S = 10.0  # after one rank fails, how long to wait for the others' errors
ENGINE_CONCURRENCY = 4096
ROLLOUT_CONCURRENCY = 64  # generate, data-state and progress calls, and the engine watcher, at once  # requests one engine actor takes at once (the engine batches them)


@hookimpl
def add_arguments(parser):
    """Add the ``ray`` group: ``--ray-call-timeout``, ``--ray-engine-restarts``."""
    group = parser.add_argument_group("ray")
    group.add_argument("--ray-call-timeout", type=float, default=3600.0,
                       help="Seconds any call to a Ray actor may take before the run stops with an error naming it.")
    group.add_argument("--ray-engine-restarts", type=int, default=3,
                       help="Times a dead rollout-engine actor is replaced in one run before the run stops.")


@hookimpl
def executor_fit(args):
    """Fits when the launch needs actors (``RAY_ADDRESS``, engines run as actors, several train
    ranks not started by ``torchrun``); each engine runs in an actor of its own."""
    reason = needs_actors(args)
    return ExecutorFit(reason is not None, reason or in_process_reason(), engines_in_driver=False)


@hookimpl
def configure(args, report):
    """Ray must be installed; on GPUs an engine must fit one node and a private Ray must fit this machine.

    Without ``RAY_ADDRESS`` the executor starts a Ray of this machine alone, so the bundles
    the flags ask for (:func:`bundles_needed`) must not exceed the GPUs torch sees.
    """
    import os

    if not _ray_installed():
        report.error(NEEDS_RAY)
    if args.ray_call_timeout <= 0:
        report.error(f"--ray-call-timeout must be a positive number of seconds, got {args.ray_call_timeout:g}.")
    if args.ray_engine_restarts < 0:
        report.error(f"--ray-engine-restarts must be at least 0, got {args.ray_engine_restarts}.")
    if not _has_gpus():
        return  # CPU slots: any number fits a private Ray
    per_engine, per_node = int(args.rollout_num_gpus_per_engine or 1), int(args.num_gpus_per_node or 1)
    if per_engine > per_node:
        report.error(f"--rollout-num-gpus-per-engine {per_engine} is more than --num-gpus-per-node {per_node}: an "
                     f"engine spanning nodes is not supported yet; use at most {per_node} GPUs per engine.")
    needed, have = bundles_needed(args), _gpu_count()
    if not os.environ.get("RAY_ADDRESS") and needed > have:
        report.error(f"--executor ray on this machine needs {needed} GPUs (trainer "
                     f"{args.actor_num_nodes * args.actor_num_gpus_per_node}, engines {_rollout_slots(args)}"
                     f"{' shared with the trainer (--colocate)' if args.colocate else ''}"
                     f"{f', eval fleet {args.eval_num_gpus}' if args.eval_num_gpus else ''}) but torch sees {have}; "
                     "lower --actor-num-gpus-per-node or --rollout-num-gpus, or run on a Ray cluster "
                     "(ray job submit, docs/ray.md).")


def _quiet_sigterm() -> None:
    """Drop the stack dump Ray's C++ failure handler prints on SIGTERM ("*** SIGTERM received ...").

    Ray sets its Python SIGTERM handler (``sys.exit``) and then its core worker installs
    the C++ handler on top of it, which prints the dump and then calls the Python one.
    Setting the Python handler again gives SIGTERM back to it alone; the C++ handler
    still reports crashes (SIGSEGV, SIGABRT...).
    """
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGTERM)
        if callable(handler):
            signal.signal(signal.SIGTERM, handler)


def bundles_needed(args) -> int:
    """Bundles of the placement group: trainer + engines, or the larger of the two under ``--colocate``, plus the
    dedicated eval fleet's ``--eval-num-gpus`` (never colocated)."""
    train, rollout = int(args.actor_num_nodes) * int(args.actor_num_gpus_per_node), _rollout_slots(args)
    shared = max(train, rollout) if getattr(args, "colocate", False) else train + rollout
    return shared + int(args.eval_num_gpus or 0)


def _rollout_slots(args) -> int:
    """``--rollout-num-gpus``, or one engine of ``--rollout-num-gpus-per-engine`` when unset."""
    return int(args.rollout_num_gpus or args.rollout_num_gpus_per_engine or 1)


@hookimpl
def executor(config):
    """Place train ranks and engines as Ray actors (needs ``pip install "furlong[ray]"``).

    Flags read: ``--actor-num-nodes``, ``--actor-num-gpus-per-node``, ``--rollout-num-gpus``,
    ``--rollout-num-gpus-per-engine``, ``--eval-num-gpus``, ``--eval-num-gpus-per-engine``, ``--colocate``, ``--distributed-backend``,
    ``--distributed-timeout-minutes``, ``--ray-call-timeout``, ``--ray-engine-restarts``.

    :raises PluginError: Ray is not installed.
    """
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        raise PluginError(NEEDS_RAY) from exc
    return RayExecutor(config)


class RayExecutor:
    """:class:`furlong.hooks.Executor` over Ray actors (see the module doc)."""

    is_driver = True
    weights_in_process = False
    concurrent_train_groups = True  # each start_train_workers call starts actors of its own

    def __init__(self, config) -> None:
        self.config = config
        self.timeout = float(config.plugin_config("ray").ray_call_timeout)
        self.gpu = _has_gpus()
        self.train_world = int(config.actor_num_nodes) * int(config.actor_num_gpus_per_node)
        per_engine = int(config.rollout_num_gpus_per_engine or 1)
        self.rollout_slots = _rollout_slots(config)
        self.num_engines = max(1, self.rollout_slots // per_engine)
        self.per_engine = per_engine
        self.colocate = bool(config.colocate)
        self.started_ray = False
        self.own_token = False  # the RAY_AUTH_TOKEN this executor set for its private Ray
        self.pg = None
        self.actors: list = []
        self.engines: list[RemoteEngine] = []
        self._connected: asyncio.Task | None = None

    async def _ready(self) -> None:
        """Join or start Ray, then reserve the placement group, once.

        ``ray.init`` runs in the main thread (Ray sets its SIGTERM handler there, so a
        terminated run still shuts its Ray down); the wait for the bundles runs off the
        event loop, so Ctrl-C stays prompt.
        """
        if self._connected is None:
            self._init_ray()
            self._connected = asyncio.ensure_future(asyncio.to_thread(self._reserve))
        await asyncio.shield(self._connected)

    # --- cluster and placement ---------------------------------------------------------

    def _init_ray(self) -> None:
        import ray

        slots = bundles_needed(self.config)
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            kwargs = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
            if address:
                try:
                    ray.init(address=address, **kwargs)
                except Exception as exc:  # noqa: BLE001 - ConnectionError, auth and version mismatches
                    reason = " ".join(str(exc).split())  # Ray's reason (auth, versions) may span lines
                    raise PluginError(f"--executor ray: could not join the Ray cluster at RAY_ADDRESS={address}: "
                                      f"{reason}") from exc
            else:
                gpus = _gpu_count() if self.gpu else 0
                self.own_token = _private_auth_token()
                try:
                    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, slots + 1), num_gpus=gpus, **kwargs)
                except Exception as exc:  # noqa: BLE001 - Ray reports a failed start with a bare Exception
                    reason = " ".join(str(exc).split())
                    raise PluginError(f"--executor ray: the local Ray did not start: {reason}") from exc
                self.started_ray = True
            _quiet_sigterm()

    def _reserve(self) -> None:
        """The placement group of :func:`bundles_needed` bundles, or one error saying what the cluster has."""
        import ray
        from ray.util.placement_group import placement_group

        slots = bundles_needed(self.config)

        bundle = {"GPU": 1, "CPU": 1} if self.gpu else {"CPU": 1}
        self.slots = slots
        self.pg = placement_group([dict(bundle) for _ in range(slots)], strategy="PACK")
        log.info("ray: waiting for a placement group of %d bundle(s) %s (at most %.0f s)", slots, bundle,
                 min(self.timeout, 300))
        try:
            ray.get(self.pg.ready(), timeout=min(self.timeout, 300))
        except Exception as exc:  # noqa: BLE001 - GetTimeoutError, or the cluster went away
            have = ray.cluster_resources()
            self._release()
            raise PluginError(
                f"--executor ray: no room for {slots} bundles of {bundle} (trainer {self.train_world} = "
                f"--actor-num-nodes x --actor-num-gpus-per-node, engines {self.rollout_slots} "
                f"{'shared with the trainer (--colocate)' if self.colocate else '(--rollout-num-gpus)'}); the cluster "
                f"has {have}.") from exc
        log.info("ray: placement group of %d bundle(s) %s ready", slots, bundle)

    def _options(self, bundle_index: int, share: float, concurrency: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=bundle_index,
                                                    placement_group_capture_child_tasks=True)
        resources = {"num_cpus": share, "num_gpus": share if self.gpu else 0}
        return {"scheduling_strategy": strategy, "max_restarts": 0, "max_concurrency": concurrency, **resources}

    # --- train workers -------------------------------------------------------------------

    async def start_train_workers(self, config, make_worker):
        import ray

        await self._ready()
        env = _forwarded_env()
        cls = ray.remote(TrainActor)
        handles = [cls.options(**self._options(r, TRAIN_SHARE, 4)).remote(r, self.train_world, env)
                   for r in range(self.train_world)]
        self.actors.extend(handles)
        group = RayWorkers(handles, self.timeout)
        await group.describe()
        master = await group.one(0, handles[0].master_address.remote(), "master_address")
        backend = "nccl" if self.gpu and config.distributed_backend == "nccl" else "gloo"
        minutes = int(config.distributed_timeout_minutes or 10)
        await group.all([h.setup.remote(make_worker, master, backend, minutes) for h in handles], "setup")
        log.info("ray: %d train actor(s) started (%s)", len(handles), backend)
        return group

    # --- engines -------------------------------------------------------------------------

    async def start_engines(self, config, make_engine):
        await self._ready()
        restarts = int(self.config.plugin_config("ray").ray_engine_restarts)
        budget = _RestartBudget(restarts)
        self.engines = [RemoteEngine(self, i, make_engine, budget) for i in range(self.num_engines)]
        await asyncio.gather(*(e.start() for e in self.engines))
        log.info("ray: %d engine actor(s) started", len(self.engines))
        return list(self.engines)

    async def start_eval_engines(self, config, make_engine):
        """The dedicated eval fleet: ``--eval-num-gpus // --eval-num-gpus-per-engine`` engine actors on bundles of
        their own, after the trainer's and the rollout engines'; a dead one is not replaced (its evaluation
        is logged as skipped)."""
        await self._ready()
        per = int(config.eval_num_gpus_per_engine)
        count = max(1, int(config.eval_num_gpus) // per)
        base = max(self.train_world, self.rollout_slots) if self.colocate else self.train_world + self.rollout_slots
        engines = [RemoteEngine(self, self.num_engines + i, make_engine, _RestartBudget(0), bundle=base + i * per)
                   for i in range(count)]
        await asyncio.gather(*(e.start() for e in engines))
        log.info("ray: %d eval engine actor(s) started", count)
        return engines

    # --- the rollout-manager actor --------------------------------------------------------

    async def start_rollout_side(self, config, make_rollout_side):
        """The rollout-manager actor (1 CPU, outside the placement group, as Miles places it)."""
        import ray

        await self._ready()

        handle = ray.remote(RolloutActor).options(num_cpus=1, num_gpus=0, max_restarts=0,
                                                  max_concurrency=ROLLOUT_CONCURRENCY).remote(_forwarded_env())
        self.actors.append(handle)
        side = RemoteRolloutSide(handle, self.timeout)
        await side.build(make_rollout_side)
        log.info("ray: rollout-manager actor started")
        return side

    def engine_bundle(self, index: int) -> int:
        base = 0 if self.colocate else self.train_world
        return base + index * self.per_engine

    def new_engine_actor(self, index: int, bundle: int | None = None):
        import ray

        cls = ray.remote(EngineActor)
        bundle = self.engine_bundle(index) if bundle is None else bundle
        handle = cls.options(**self._options(bundle, ENGINE_SHARE, ENGINE_CONCURRENCY)).remote(
            index, _forwarded_env())
        self.actors.append(handle)
        return handle

    # --- end -----------------------------------------------------------------------------

    async def serve(self) -> None:
        return None

    async def shutdown(self) -> None:
        """Kill every actor, remove the placement group, stop the private Ray (idempotent)."""
        await asyncio.to_thread(self._release)

    def _release(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for handle in self.actors:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.actors = []
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - the cluster may be gone already
                pass
            self.pg = None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
        if self.own_token:
            os.environ.pop(RAY_AUTH_TOKEN, None)
            self.own_token = False


class RayWorkers:
    """:class:`furlong.hooks.WorkerGroup` over train actors; errors name the actor, rank, node and process."""

    def __init__(self, handles: list, timeout: float) -> None:
        self.handles, self.timeout = handles, timeout
        self.size = len(handles)
        self.places: list[dict] = [{} for _ in handles]

    async def describe(self) -> None:
        self.places = await self.all([h.where.remote() for h in self.handles], "where")

    async def call(self, method: str, args_per_rank) -> list:
        refs = [None if a is None else h.call.remote(method, tuple(a)) for h, a in zip(self.handles, args_per_rank)]
        return await self.all(refs, method)

    async def one(self, rank: int, ref, method: str):
        return await _await(ref, self.timeout, self._who(rank), method)

    async def all(self, refs: list, method: str) -> list:
        """Results of every call; on failure, the error of a dead actor first (the others' follow from it)."""
        tasks = [asyncio.ensure_future(self.one(r, ref, method)) if ref is not None else None
                 for r, ref in enumerate(refs)]
        live = [t for t in tasks if t is not None]
        for t in live:  # errors of calls nobody waits for any more (a cancelled run) are not reported twice
            t.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            done, pending = await asyncio.wait(live, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:
            for t in live:
                t.cancel()
            raise
        if pending and any(t.exception() is not None for t in done):
            more, pending = await asyncio.wait(pending, timeout=FAILURE_GRACE_S)  # peers of a dead rank fail too
            done |= more
        for t in pending:
            t.cancel()
        errors = [t.exception() for t in live if t in done and t.exception() is not None]
        if errors:
            errors.sort(key=lambda e: not actor_died(e))
            raise errors[0]
        return [t.result() if t is not None else None for t in tasks]

    def _who(self, rank: int) -> str:
        place = self.places[rank] if rank < len(self.places) else {}
        where = f" on node {place['node']}, pid {place['pid']}" if place else ""
        return f"train actor rank {rank}{where}"


class RemoteRolloutSide:
    """The driver's handle on the rollout-manager actor: the rollout side's coroutines, run there.

    While the run goes on it also answers the actor's reports of dead engines: the driver
    replaces the engine (which gets the current weights) and hands the actor the new one.
    """

    def __init__(self, handle, timeout: float) -> None:
        self.handle, self.timeout = handle, timeout
        self.who = "rollout-manager actor"
        self._watcher: asyncio.Task | None = None

    async def build(self, make_rollout_side) -> None:
        place = await _await(self.handle.where.remote(), self.timeout, self.who, "where")
        self.who = f"rollout-manager actor on node {place['node']}, pid {place['pid']}"
        await _await(self.handle.build.remote(make_rollout_side), self.timeout, self.who, "build")

    async def _call(self, method: str, *args):
        return await _await(self.handle.call.remote(method, args), self.timeout, self.who, method)

    async def load_data(self) -> bool:
        return await self._call("load_data")

    async def dataset_size(self) -> int | None:
        return await self._call("dataset_size")

    async def start(self, engines: list, state) -> None:
        specs = [(e.index, e.handle, e.tokenizer) for e in engines]
        await _await(self.handle.start.remote(specs, state, self.timeout), self.timeout, self.who, "start")
        self._watcher = asyncio.ensure_future(self._watch(engines))

    async def _watch(self, engines: list) -> None:
        """Replace each engine the actor reports dead, then tell the actor (or why it cannot be)."""
        while True:
            index, dead = await asyncio.wrap_future(self.handle.next_dead_engine.remote().future())
            error = None
            try:
                await engines[index].replace_if(dead)
            except Exception as exc:  # noqa: BLE001 - whatever stops the replacement, the waiting requests say it
                error = str(exc) if isinstance(exc, PluginError) else f"{engines[index].who}: {type(exc).__name__}: {exc}"
            self.handle.replace_engine.remote(index, engines[index].handle, error)

    async def generate(self, rollout_id: int):
        return await self._call("generate", rollout_id)

    async def start_eval_fleet(self, engines: list) -> None:
        specs = [(e.index, e.handle, e.tokenizer) for e in engines]
        await _await(self.handle.start_eval_fleet.remote(specs, self.timeout), self.timeout, self.who,
                     "start_eval_fleet")

    async def evaluate(self, rollout_id: int = 0, hf_dir: str | None = None, start: bool = False) -> dict:
        return await self._call("evaluate", rollout_id, hf_dir, start)

    async def data_state(self, rollout_id: int | None = None):
        return await self._call("data_state", rollout_id)

    async def pop_metrics(self, rollout_id: int) -> dict:
        return await self._call("pop_metrics", rollout_id)

    async def set_weight_version(self, version: int) -> None:
        await self._call("set_weight_version", version)

    async def progress(self) -> dict:
        return await self._call("progress")

    async def dispose(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        await self._call("dispose")


class _RestartBudget:
    def __init__(self, total: int) -> None:
        self.left = total


class RemoteEngine:
    """A :class:`furlong.hooks.RolloutEngine` in the driver for one engine actor.

    When the actor dies, the first call that notices starts a replacement, which gets the
    current weights through ``on_restart`` (set by the core's weight sync) before any
    request is sent again; calls that failed meanwhile are retried once on it.
    """

    def __init__(self, executor: RayExecutor, index: int, make_engine, budget: _RestartBudget,
                 bundle: int | None = None) -> None:
        self.executor, self.index, self.make_engine, self.budget = executor, index, make_engine, budget
        self.bundle = bundle  # None: the rollout engine's bundle of its index
        self.handle = None
        self.tokenizer = None
        self.weight_update_ranks = 1
        self.on_restart = None
        self.restarts = 0
        self._owns_processes = False
        self._epoch = 0
        self._seq = 0
        self._restarting: asyncio.Future | None = None
        self._place: dict = {}

    @property
    def who(self) -> str:
        where = f" on node {self._place['node']}, pid {self._place['pid']}" if self._place else ""
        return f"engine actor {self.index}{where}"

    async def start(self) -> None:
        self.handle = self.executor.new_engine_actor(self.index, self.bundle)
        timeout = self.executor.timeout
        self._place = await _await(self.handle.where.remote(), timeout, f"engine actor {self.index}", "where")
        self.tokenizer, self.weight_update_ranks, self._owns_processes = await _await(
            self.handle.start.remote(self.make_engine), timeout, self.who, "start")
        self._epoch += 1
        self._seq = 0

    async def recover(self) -> None:
        """Replace this engine's actor unless it answers (the core calls it when a weight sync found it dead)."""
        if self._restarting is not None:
            await asyncio.shield(self._restarting)
        elif not await self.health():
            await self._recover(self._epoch, PluginError(f"{self.who}: the engine does not answer (the actor or "
                                                         "a process of the engine died)"))

    async def replace_if(self, dead) -> None:
        """Replace the actor if ``dead`` (an actor handle another process found dead) is still the current one.

        Returns once the engine serves again with the current weights, also when another
        call had already started the replacement.
        """
        if self._restarting is not None:
            await asyncio.shield(self._restarting)
        elif self.handle._actor_id == dead._actor_id:
            await self._recover(self._epoch, PluginError(f"{self.who}: the actor died"))

    async def _call(self, method: str, *args, retry: bool = True):
        epoch = self._epoch
        if method == "generate":
            ref = self.handle.generate.remote(self._seq, *args)
            self._seq += 1
        else:
            ref = self.handle.call.remote(method, args)
        try:
            return await _await(ref, self.executor.timeout, self.who, method)
        except PluginError as exc:
            if not retry or not actor_died(exc):
                raise
            await self._recover(epoch, exc)
            return await self._call(method, *args, retry=False)

    async def _recover(self, epoch: int, error: Exception) -> None:
        """Replace the dead actor once per death, however many calls noticed it."""
        if self._epoch != epoch:
            return  # another call already replaced it
        if self._restarting is not None:
            await asyncio.shield(self._restarting)
            return
        if self.budget.left <= 0:
            raise PluginError(f"{error}; no engine restarts left (--ray-engine-restarts).") from error
        self.budget.left -= 1
        self.restarts += 1
        log.warning("%s died; starting a replacement (%d restart(s) left)", self.who, self.budget.left)
        self._restarting = asyncio.get_running_loop().create_future()
        self._restarting.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen by the caller
        _kill(self.handle)  # an unreachable actor may still hold its share of the bundle
        try:
            await self.start()
            if self.on_restart is not None:
                await self.on_restart(self)
            self._restarting.set_result(None)
        except BaseException as exc:
            self._restarting.set_exception(exc)
            raise
        finally:
            self._restarting = None

    async def generate(self, input_ids, sampling_params):
        return await self._call("generate", list(input_ids), dict(sampling_params))

    async def abort(self) -> None:
        await self._call("abort", retry=False)

    async def pause_generation(self, mode: str) -> None:
        await self._call("pause_generation", mode, retry=False)

    async def continue_generation(self) -> None:
        await self._call("continue_generation", retry=False)

    async def flush_cache(self) -> None:
        await self._call("flush_cache", retry=False)

    async def load_weights(self, named_tensors) -> None:
        await self._call("load_weights", list(named_tensors), retry=False)

    async def begin_weight_update(self) -> None:
        await self._call("begin_weight_update", retry=False)

    async def end_weight_update(self) -> None:
        await self._call("end_weight_update", retry=False)

    async def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                        backend) -> None:
        await self._call("init_weights_update_group", master_address, master_port, rank_offset, world_size,
                         group_name, backend, retry=False)

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name) -> None:
        await self._call("update_weights_from_distributed", names, dtypes, shapes, group_name, retry=False)

    async def destroy_weights_update_group(self, group_name) -> None:
        await self._call("destroy_weights_update_group", group_name, retry=False)

    async def set_weight_version(self, version: int) -> None:
        await self._call("set_weight_version", int(version), retry=False)

    async def update_weights_from_disk(self, path: str) -> None:
        await self._call("update_weights_from_disk", str(path), retry=False)

    async def release_memory(self) -> None:
        await self._call("release_memory")

    async def resume_memory(self) -> None:
        await self._call("resume_memory")

    async def health(self) -> bool:
        try:
            return bool(await self._call("health", retry=False))
        except PluginError:
            return False

    async def shutdown(self) -> None:
        """Let the engine stop its own processes before the executor kills the actor (Ray does not reap them)."""
        if not self._owns_processes or self.handle is None:
            return
        try:
            await _await(self.handle.shutdown.remote(), min(self.executor.timeout, 60.0), self.who, "shutdown")
        except PluginError as exc:
            log.debug("%s: shutdown: %s", self.who, exc)


def _kill(handle) -> None:
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def _ray_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


def _has_gpus() -> bool:
    import torch

    return torch.cuda.is_available()


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


RAY_AUTH_TOKEN = "RAY_AUTH_TOKEN"
RAY_AUTH_SETTINGS = ("RAY_AUTH_MODE", RAY_AUTH_TOKEN, "RAY_AUTH_TOKEN_PATH")


def _private_auth_token() -> bool:
    """Give the private Ray of a run a token of its own in the environment; return whether one was set.

    Ray (2.5x and later) turns token authentication on for a local cluster and, without a token,
    writes a new one to ``~/.ray/auth_token``, a file left in the home folder after the run. A token
    in ``RAY_AUTH_TOKEN`` keeps authentication on and writes nothing; Ray's processes inherit it.
    Any Ray authentication setting of the user's (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH``) is left as it is.
    """
    import secrets

    if any(name in os.environ for name in RAY_AUTH_SETTINGS):
        return False
    os.environ[RAY_AUTH_TOKEN] = secrets.token_hex(32)
    return True


def _forwarded_env() -> dict:
    """Variables an actor needs as the driver has them (thread counts, furlong's own switches)."""
    keys = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "FURLONG_TRACE_HOOKS", "FURLONG_DISABLE_PLUGINS", "PYTHONPATH")
    return {k: os.environ[k] for k in keys if k in os.environ}
