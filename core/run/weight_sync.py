"""Weight sync from the trainer to the rollout engines, in the phases of SGLang's API.

One sync: every engine pauses (``--pause-generation-mode``) and, unless paused in place,
flushes its prefix cache; every engine opens its weight-update session
(``begin_weight_update``, which SGLang 0.5.21+ requires; engines without sessions need
not have the method); the train workers walk their weights in Hugging Face names and
rank 0 cuts them into buckets of at most ``--update-weight-buffer-size`` bytes; each
bucket reaches every engine; the sessions close (``end_weight_update``, also when a
bucket failed, so no session stays open); the engines take the new weight version and
continue (also after a failure, so no engine stays paused). Two transports:

- in-process (``Executor.weights_in_process``): the bucket's tensors are handed to each
  engine's ``load_weights``;
- broadcast: trainer rank 0 and every engine rank form a weight-update process group
  (built once, the way SGLang builds it: :mod:`furlong.kit.dist`), each engine is told
  the bucket's names, dtypes and shapes (``update_weights_from_distributed``) while rank 0
  broadcasts the tensors.

Syncs are serialized by one lock, shared with engine recovery (a restarted engine gets
the current weights before it serves again). The engine health monitor, when one runs,
is paused for the whole sync: a paused SGLang server's ``/health`` waits for generation
and would report a healthy server dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from furlong.hooks import PluginError, RunConfig

from ..train.group import TrainGroup

__all__ = ["GROUP_NAME", "WeightSync"]

log = logging.getLogger("furlong")

GROUP_NAME = "furlong_weight_sync"


class WeightSync:
    """Pushes the train group's weights to ``engines``; holds the weight version (first sync = 1).

    :param in_process: the executor's ``weights_in_process``.
    """

    def __init__(self, config: RunConfig, group: TrainGroup, engines: list, in_process: bool) -> None:
        self.config, self.group, self.engines, self.in_process = config, group, list(engines), in_process
        self.version = 0
        self.lock = asyncio.Lock()
        self.buckets = 0  # buckets sent by the last sync
        self._connected: list | None = None
        self._generation = 0
        self.monitor: Any = None  # the EngineHealthMonitor, paused during a sync

    @contextlib.asynccontextmanager
    async def _monitor_paused(self):
        """The health monitor (if any) paused inside the block; resumed after unless it was paused before
        (while the engines are offloaded)."""
        was_running = self.monitor is not None and self.monitor.running
        if was_running:
            self.monitor.pause()
        try:
            yield
        finally:
            if was_running:
                self.monitor.resume()

    @property
    def max_bytes(self) -> int:
        return self.config.update_weight_buffer_size

    async def push(self) -> int:
        """Sync every engine to the trainer's weights under the next version; return it.

        An engine found dead during the sync that can be replaced (``engine.recover()``, as
        the Ray executor's engines can) is replaced, and the replacement's sync delivers
        this version to every engine.

        :raises PluginError: a worker failed, or an engine failed and cannot be replaced
            (the engines are still told to continue).
        """
        async with self.lock:
            self.version += 1
            try:
                await self._push(self.engines, self.version)
                return self.version
            except PluginError:
                dead = [e for e in (await self._split_by_health())[1] if hasattr(e, "recover")]
                if not dead:
                    raise
        for engine in dead:  # outside the lock: the replacement's resync sends this version to every engine
            log.warning("weight sync: %s is gone; replacing it", getattr(engine, "who", type(engine).__name__))
            await engine.recover()
        return self.version

    async def resync(self, engine: Any) -> None:
        """After ``engine`` was replaced: rebuild the weight-update group and sync every engine to the current version.

        The new process must join the group, which means building it again with all
        engines; the others receive the weights they already hold.
        """
        async with self.lock:
            await self.close()  # a new process joins: the weight-update group is built again
            if self.version:
                # engines still dead (several died at once) join when their own replacement syncs
                await self._push((await self._split_by_health())[0], self.version)

    async def _split_by_health(self) -> tuple[list, list]:
        """``(healthy, dead)`` engines, asking each one."""
        health = await asyncio.gather(*(e.health() for e in self.engines))
        return ([e for e, ok in zip(self.engines, health) if ok], [e for e, ok in zip(self.engines, health) if not ok])

    async def close(self) -> None:
        """Leave the weight-update group (end of run)."""
        if self._connected is not None and not self.in_process:
            await _quiet(self.group.call_rank0("leave_weight_group", self._group_name))
            await asyncio.gather(*(_quiet(e.destroy_weights_update_group(self._group_name)) for e in self._connected))
        self._connected = None

    async def _push(self, engines: list, version: int) -> None:
        mode = self.config.pause_generation_mode
        async with self._monitor_paused(), self.group.busy:  # engines pause once the trainer is free (train-async)
            await asyncio.gather(*(e.pause_generation(mode) for e in engines))
            try:
                if mode != "in_place":
                    await asyncio.gather(*(e.flush_cache() for e in engines))
                if not self.in_process and self._connected != engines:
                    await self._connect(engines)
                await self._in_session(engines, lambda: self._stream(engines))
                await asyncio.gather(*(e.set_weight_version(version) for e in engines))
            finally:
                await asyncio.gather(*(_quiet(e.continue_generation()) for e in engines))
        log.debug("weights version %d sent in %d bucket(s)", version, self.buckets)

    async def _in_session(self, engines: list, stream) -> None:
        """Run ``stream()`` (a coroutine function) inside every engine's weight-update session.

        Sessions are closed whatever happens; after a failure quietly (an engine that never
        opened one refuses the close), so the first error is the one raised.
        """
        try:
            await asyncio.gather(*(_phase(e, "begin_weight_update") for e in engines))
            await stream()
        except BaseException:
            await asyncio.gather(*(_quiet(_phase(e, "end_weight_update")) for e in engines))
            raise
        await asyncio.gather(*(_phase(e, "end_weight_update") for e in engines))

    async def _stream(self, engines: list) -> None:
        """Every bucket of the trainer's weights to every engine."""
        await self.group.begin_weights()
        self.buckets = 0
        while (bucket := await self.group.next_weight_bucket(self.max_bytes, self.in_process)) is not None:
            if self.in_process:
                named = list(zip(bucket.names, bucket.tensors))
                await asyncio.gather(*(e.load_weights(named) for e in engines))
            else:
                await asyncio.gather(
                    self.group.call_rank0("broadcast_weight_bucket", self._group_name),
                    *(e.update_weights_from_distributed(bucket.names, bucket.dtypes, bucket.shapes, self._group_name)
                      for e in engines))
            self.buckets += 1

    async def _connect(self, engines: list) -> None:
        """Build the weight-update group: trainer rank 0 is rank 0, engine ranks follow in order."""
        if self._connected is not None:
            await self.close()
        self._generation += 1
        self._group_name = f"{GROUP_NAME}_{self._generation}"
        address, port = await self.group.call_rank0("weight_group_address")
        ranks = [int(e.weight_update_ranks) for e in engines]
        world = 1 + sum(ranks)
        # NCCL cannot put two ranks of one group on one GPU: colocated engines share the trainer's
        nccl = self.config.distributed_backend == "nccl" and _cuda() and not self.config.colocate
        backend = "nccl" if nccl else "gloo"
        timeout = 60.0 * self.config.distributed_timeout_minutes
        offsets = [1 + sum(ranks[:i]) for i in range(len(engines))]
        try:
            await asyncio.gather(
                self.group.call_rank0("join_weight_group", address, port, world, self._group_name, backend, timeout),
                *(e.init_weights_update_group(address, port, offset, world, self._group_name, backend)
                  for e, offset in zip(engines, offsets)))
        except Exception as exc:
            raise PluginError(f"weight sync: could not build the weight-update group at {address}:{port} "
                              f"(trainer rank 0 + {len(engines)} engine(s), {backend}): {exc}") from exc
        self._connected = list(engines)


async def _phase(engine: Any, name: str) -> None:
    """The optional phase ``name`` of ``engine`` (``begin_weight_update``/``end_weight_update``):
    an engine without weight-update sessions need not define it."""
    method = getattr(engine, name, None)
    if method is not None:
        await method()


async def _quiet(coro) -> None:
    try:
        await coro
    except Exception as exc:  # noqa: BLE001 - best effort on the way out; the first error is already raised
        log.debug("weight sync clean-up: %s", exc)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
