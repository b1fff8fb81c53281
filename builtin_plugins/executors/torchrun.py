"""Train ranks started by ``torchrun``: rank 0 drives, ranks 1..D-1 serve its calls.

Every process joins the trainer's process group (``--distributed-backend``: nccl means
``cpu:gloo,cuda:nccl`` so host tensors reduce too; gloo without CUDA) and a gloo group
with a day-long time-out that carries the driver's calls: rank 0 scatters
``(method, args)`` to every rank, each runs it on its own worker (rank 0 in-process, so
collectives inside the method line up), and the results are gathered back to rank 0.
Ranks 1..D-1 wait in that group while rank 0 generates and evaluates. A run with a critic
starts two worker groups (the actor's, then the critic's) in every process: calls name their
group, and the groups take turns (``concurrent_train_groups`` is False: their collectives share
the processes and the default process group).
"""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import timedelta

import attrs

from furlong.hooks import PluginError

from ._in_process import LocalExecutor

__all__ = ["TorchrunExecutor"]

log = logging.getLogger("furlong")

OBJECT_TIMEOUT = timedelta(hours=24)
STOP = "__stop__"


@attrs.frozen
class _Failure:
    rank: int
    error: str


class TorchrunExecutor(LocalExecutor):
    """:class:`furlong.hooks.Executor` over the processes of one ``torchrun`` job.

    Rank 0 keeps the engine and the rollout side in its process, as :class:`LocalExecutor` does.

    The ``local`` plugin's ``configure`` checked that the trainer size in the flags is
    the number of processes.
    """

    weights_in_process = True

    def __init__(self, config) -> None:
        self.world = int(os.environ["WORLD_SIZE"])
        self.rank = int(os.environ.get("RANK", "0"))
        self.is_driver = self.rank == 0
        self.config = config
        self.group = None
        self.workers: list = []  # one per start_train_workers call: the actor's, then a critic's
        self._clean = True
        self._calls = asyncio.Lock()  # one call at a time on the call group, whichever worker group makes it

    async def start_train_workers(self, config, make_worker):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            nccl = torch.cuda.is_available() and config.distributed_backend == "nccl"
            minutes = config.distributed_timeout_minutes or 10
            dist.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo", timeout=timedelta(minutes=minutes))
        if self.group is None:
            self.group = dist.new_group(backend="gloo", timeout=OBJECT_TIMEOUT)
        self.workers.append(make_worker(self.rank, self.world))
        if self.is_driver and len(self.workers) == 1:
            log.info("torchrun: %d trainer ranks; rank 0 runs the rollout", self.world)
        return _RankWorkers(self, len(self.workers) - 1)

    @property
    def size(self) -> int:
        return self.world

    @property
    def worker(self):
        """This process's first worker (the actor's)."""
        return self.workers[0] if self.workers else None

    async def call(self, method: str, args_per_rank, index: int = 0) -> list:
        """Run ``method`` on every rank's worker ``index`` (WorkerGroup); rank 0's result never leaves this process."""
        async with self._calls:
            return await self._call(method, args_per_rank, index)

    async def _call(self, method: str, args_per_rank, index: int) -> list:
        import torch.distributed as dist

        self._clean = False
        box = [None]
        await self._collective(dist.scatter_object_list, box, [(index, method, a) for a in args_per_rank], src=0,
                               group=self.group)
        mine = await self._run(index, method, args_per_rank[0])
        gathered = [None] * self.world
        await self._collective(dist.gather_object, None, gathered, dst=0, group=self.group)
        gathered[0] = mine
        self._clean = True  # every rank is back waiting for the next call: STOP can reach them
        failed = [r for r in gathered if isinstance(r, _Failure)]
        if failed:
            raise PluginError("; ".join(f"trainer rank {f.rank}: {f.error}" for f in failed))
        return gathered

    async def _run(self, index: int, method: str, args):
        if args is None:
            return None
        try:
            return await getattr(self.workers[index], method)(*args)
        except Exception as exc:  # noqa: BLE001 - sent to rank 0, which raises it with the rank named
            if self.rank == 0:
                raise
            log.exception("trainer rank %d: %s failed", self.rank, method)
            return _Failure(self.rank, f"{method} failed: {type(exc).__name__}: {exc}")

    async def serve(self) -> None:
        """Ranks 1..D-1: run rank 0's calls until it stops the run."""
        import torch.distributed as dist

        while True:
            box = [None]
            await self._collective(dist.scatter_object_list, box, None, src=0, group=self.group)
            if box[0] == STOP:
                return
            index, method, args = box[0]
            result = await self._run(index, method, args)
            await self._collective(dist.gather_object, result, None, dst=0, group=self.group)

    async def shutdown(self) -> None:
        import torch.distributed as dist

        if self.group is None or not dist.is_initialized():
            return
        if self.is_driver and self._clean:
            await self._collective(dist.scatter_object_list, [None], [STOP] * self.world, src=0, group=self.group)
        dist.destroy_process_group()
        self.group = None

    async def _collective(self, fn, *args, **kwargs) -> None:
        """Run a call-group collective in a thread; a lost peer becomes one clear error.

        :raises PluginError: another rank left (it failed or was stopped); its own error
            says why, so this rank's message only points there.
        """
        try:
            await asyncio.to_thread(fn, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - gloo reports a lost peer with several types
            who = "rank 0" if not self.is_driver else "another trainer rank"
            raise PluginError(f"trainer rank {self.rank}: lost contact with {who} ({type(exc).__name__}); "
                              f"its own error above says what went wrong. Stopping this rank.") from exc


class _RankWorkers:
    """One worker group of a :class:`TorchrunExecutor` (:class:`furlong.hooks.WorkerGroup`): worker
    ``index`` of every rank."""

    def __init__(self, executor: TorchrunExecutor, index: int) -> None:
        self.executor, self.index = executor, index

    @property
    def size(self) -> int:
        return self.executor.world

    async def call(self, method: str, args_per_rank) -> list:
        return await self.executor.call(method, args_per_rank, self.index)
