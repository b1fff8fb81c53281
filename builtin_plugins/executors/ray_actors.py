"""The Ray actors of the ``ray`` executor: one per train rank, one per rollout engine.

Both hold an object the core built from a picklable factory (a train worker, a rollout
engine) and run its coroutine methods by name; they know nothing of what the methods do.
"""

from __future__ import annotations

import os
from datetime import timedelta

__all__ = ["EngineActor", "TrainActor"]


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
        from furlong.hooks.dist import free_port

        return _where()["node"], free_port()

    def setup(self, make_worker, master: tuple[str, int], backend: str, timeout_minutes: int) -> None:
        import torch
        import torch.distributed as dist

        os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "RANK": str(self.rank),
                           "WORLD_SIZE": str(self.world), "LOCAL_RANK": "0"})
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
        _quiet_transformers()
        self.engine = None
        self._next = 0
        self._turn = None

    def where(self) -> dict:
        return _where()

    async def start(self, make_engine):
        """Build the engine; return its tokenizer (the driver tokenizes prompts) and weight-group ranks."""
        self.engine = await make_engine(self.index)
        return self.engine.tokenizer, int(getattr(self.engine, "weight_update_ranks", 1) or 1)

    async def call(self, method: str, args: tuple):
        return await getattr(self.engine, method)(*args)

    async def generate(self, seq: int, input_ids: list, sampling_params: dict):
        import asyncio

        if self._turn is None:
            self._turn = asyncio.Condition()
        async with self._turn:
            await self._turn.wait_for(lambda: self._next >= seq)
        request = asyncio.ensure_future(self.engine.generate(input_ids, sampling_params))
        await asyncio.sleep(0)  # the engine takes the request (and its seed) before the next one
        async with self._turn:
            self._next = seq + 1
            self._turn.notify_all()
        return await request


def _quiet_transformers() -> None:
    """No per-file progress bars from transformers in actor logs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
