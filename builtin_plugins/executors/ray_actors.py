"""The Ray actors of the ``ray`` executor: one per train rank, one per rollout engine.

Both hold an object the core built from a picklable factory (a train worker, a rollout
engine) and run its coroutine methods by name; they know nothing of what the methods do.
"""

from __future__ import annotations

import os
from datetime import timedelta

__all__ = ["EngineActor", "RolloutActor", "TrainActor", "actor_died", "await_call"]


async def await_call(ref, timeout: float, who: str, method: str):
    """Await one actor call with a time-out; turn Ray's errors into one PluginError naming the actor.

    The error of a dead actor keeps Ray's error as its cause (:func:`actor_died` tells).
    """
    import asyncio

    from ray.exceptions import RayActorError, RayTaskError

    from furlong.hooks import PluginError

    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)
    except asyncio.TimeoutError as exc:
        raise PluginError(f"{who}: {method} did not answer within --ray-call-timeout {timeout:g} s.") from exc
    except RayActorError as exc:
        raise PluginError(f"{who}: the actor died during {method} ({_first_line(exc)}).") from exc
    except RayTaskError as exc:
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        if isinstance(cause, PluginError):
            raise PluginError(f"{who}: {cause}") from exc
        raise PluginError(f"{who}: {method} raised {type(cause).__name__}: {_first_line(cause)}") from exc


def actor_died(error: BaseException) -> bool:
    """Whether an :func:`await_call` error means the actor is gone."""
    from ray.exceptions import RayActorError

    return isinstance(error.__cause__, RayActorError)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _where() -> dict:
    import ray

    return {"node": ray.util.get_node_ip_address(), "pid": os.getpid()}


class TrainActor:
    """Train rank ``rank`` of ``world``: joins the trainer's process group, then holds one worker."""

    def __init__(self, rank: int, world: int, env: dict) -> None:
        self.rank, self.world = rank, world
        os.environ.update({k: str(v) for k, v in env.items()})
        _quiet_transformers()
        self.worker = None

    def where(self) -> dict:
        return _where()

    def master_address(self) -> tuple[str, int]:
        """Rank 0's node address and a free port on it, for the trainer's rendezvous."""
        from furlong.kit.dist import free_port

        return _where()["node"], free_port()

    def setup(self, make_worker, master: tuple[str, int], backend: str, timeout_minutes: int) -> None:
        import torch
        import torch.distributed as dist

        os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "RANK": str(self.rank),
                           "WORLD_SIZE": str(self.world), "LOCAL_RANK": "0",
                           "FURLONG_HOST_IP": _where()["node"]})  # the weight-update group's address
        if self.world > 1 and not dist.is_initialized():
            nccl = torch.cuda.is_available() and backend == "nccl"
            dist.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo", rank=self.rank, world_size=self.world,
                                    timeout=timedelta(minutes=timeout_minutes))
        self.worker = make_worker(self.rank, self.world)

    async def call(self, method: str, args: tuple):
        return await getattr(self.worker, method)(*args)


class EngineActor:
    """Rollout engine ``index``, built in this actor by the core's engine factory.

    Ray may start an async actor's calls in any order; ``generate`` calls carry the
    driver's sequence number and reach the engine in that order, so an engine that draws
    per-request sampling seeds in arrival order samples as it would in the driver's process.
    """

    def __init__(self, index: int, env: dict) -> None:
        self.index = index
        os.environ.update({k: str(v) for k, v in env.items()})
        os.environ.setdefault("FURLONG_HOST_IP", _where()["node"])  # where a server this engine starts is reached
        _quiet_transformers()
        self.engine = None
        self._next = 0
        self._done: set[int] = set()
        self._turn = None

    def where(self) -> dict:
        return _where()

    async def start(self, make_engine):
        """Build the engine; return its tokenizer (the driver tokenizes prompts), weight-group ranks,
        and whether it has a ``shutdown`` step (processes of its own to stop)."""
        self.engine = await make_engine(self.index)
        return (self.engine.tokenizer, int(getattr(self.engine, "weight_update_ranks", 1) or 1),
                callable(getattr(self.engine, "shutdown", None)))

    async def call(self, method: str, args: tuple):
        if method in ("begin_weight_update", "end_weight_update") and not hasattr(self.engine, method):
            return None  # optional phases: an engine without weight-update sessions
        return await getattr(self.engine, method)(*args)

    async def shutdown(self) -> None:
        """Stop what the engine started (its server process), if it has such a step."""
        if self.engine is not None and hasattr(self.engine, "shutdown"):
            await self.engine.shutdown()

    async def generate(self, seq: int, input_ids: list, sampling_params: dict):
        """``engine.generate`` once every lower sequence number reached the engine (or gave up its turn)."""
        import asyncio

        if self._turn is None:
            self._turn = asyncio.Condition()
        try:
            async with self._turn:
                await self._turn.wait_for(lambda: self._next >= seq)
            request = asyncio.ensure_future(self.engine.generate(input_ids, sampling_params))
            await asyncio.sleep(0)  # the engine takes the request (and its seed) before the next one
        finally:  # a call that failed or was cancelled before the engine took it still passes its turn on
            self._done.add(seq)
            async with self._turn:
                while self._next in self._done:
                    self._done.discard(self._next)
                    self._next += 1
                self._turn.notify_all()
        return await request


class RolloutActor:
    """The rollout-manager actor: the core's rollout side (data, rollout manager, rewards, eval).

    It generates through :class:`EngineClient` objects that call the engine actors
    directly. A client that finds its engine dead reports it (:meth:`next_dead_engine`,
    which the driver watches), waits for the driver's replacement (:meth:`replace_engine`:
    a new actor that already has the current weights) and sends its request again.
    """

    def __init__(self, env: dict) -> None:
        import asyncio

        os.environ.update({k: str(v) for k, v in env.items()})
        _quiet_transformers()
        self.side = None
        self.clients: list[EngineClient] = []
        self.dead: asyncio.Queue = asyncio.Queue()

    def where(self) -> dict:
        return _where()

    def build(self, make_rollout_side) -> None:
        self.side = make_rollout_side()

    async def start(self, engines: list, state, timeout: float) -> None:
        """``engines``: ``(index, actor handle, tokenizer)`` of each engine actor."""
        self.clients = [EngineClient(self, index, handle, tokenizer, timeout) for index, handle, tokenizer in engines]
        await self.side.start(self.clients, state)

    async def start_eval_fleet(self, engines: list, timeout: float) -> None:
        """``engines``: ``(index, actor handle, tokenizer)`` of each dedicated eval engine actor (``--eval-num-gpus``)."""
        clients = [EvalEngineClient(self, index, handle, tokenizer, timeout) for index, handle, tokenizer in engines]
        await self.side.start_eval_fleet(clients)

    async def call(self, method: str, args: tuple):
        return await getattr(self.side, method)(*args)

    async def next_dead_engine(self) -> tuple:
        """``(index, dead actor handle)`` of the next engine a client found dead (waits for one)."""
        return await self.dead.get()

    def replace_engine(self, index: int, handle, error: str | None = None) -> None:
        """The driver's answer to a death report: the replacement's handle, or why there is none."""
        self.clients[index].replaced(handle, error)


class EngineClient:
    """The rollout manager's :class:`furlong.hooks.RolloutEngine` for one engine actor (generate, abort)."""

    def __init__(self, owner: RolloutActor, index: int, handle, tokenizer, timeout: float) -> None:
        self.owner, self.index, self.handle, self.tokenizer, self.timeout = owner, index, handle, tokenizer, timeout
        self._seq = 0
        self._waiting = None
        self._error: str | None = None

    async def generate(self, input_ids: list, sampling_params: dict):
        from furlong.hooks import PluginError

        handle = self.handle
        ref = handle.generate.remote(self._seq, list(input_ids), dict(sampling_params))
        self._seq += 1
        try:
            return await self._wait(ref, "generate")
        except PluginError as exc:
            if not actor_died(exc):
                raise
            await self._replacement(handle)
        ref = self.handle.generate.remote(self._seq, list(input_ids), dict(sampling_params))
        self._seq += 1
        return await self._wait(ref, "generate")

    async def abort(self) -> None:
        from furlong.hooks import PluginError

        try:
            await self._wait(self.handle.call.remote("abort", ()), "abort")
        except PluginError as exc:
            if not actor_died(exc):  # a dead engine has nothing in flight
                raise

    async def health(self) -> bool:
        try:
            return bool(await self._wait(self.handle.call.remote("health", ()), "health"))
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return False

    async def _wait(self, ref, method: str):
        return await await_call(ref, self.timeout, f"engine actor {self.index} (from the rollout-manager actor)",
                                method)

    async def _replacement(self, dead) -> None:
        """Report ``dead`` once and wait until the driver replaced it (or gave up)."""
        import asyncio

        from furlong.hooks import PluginError

        if self.handle is dead:
            if self._waiting is None:
                self._waiting = asyncio.get_running_loop().create_future()
                self.owner.dead.put_nowait((self.index, dead))
            try:
                await asyncio.wait_for(asyncio.shield(self._waiting), self.timeout)
            except asyncio.TimeoutError as exc:
                raise PluginError(f"engine actor {self.index} died and the driver did not replace it within "
                                  f"--ray-call-timeout {self.timeout:g} s.") from exc
        if self._error:
            raise PluginError(self._error)

    def replaced(self, handle, error: str | None) -> None:
        if handle is not None:
            self.handle, self._seq = handle, 0
        self._error = error
        if self._waiting is not None and not self._waiting.done():
            self._waiting.set_result(None)
        self._waiting = None


class EvalEngineClient(EngineClient):
    """An :class:`EngineClient` of a dedicated eval engine: it is not replaced when it dies (the evaluation on it
    fails, and the driver logs the point as skipped)."""

    async def _replacement(self, dead) -> None:
        from furlong.hooks import PluginError

        raise PluginError(f"eval engine actor {self.index} died; this evaluation is skipped.")


def _quiet_transformers() -> None:
    """No per-file progress bars from transformers in actor logs; furlong's own INFO lines as in the driver."""
    import logging

    from transformers.utils import logging as hf_logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
