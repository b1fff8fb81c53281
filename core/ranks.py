"""Trainer ranks of one run started by ``torchrun`` (``--executor local`` with several processes).

``torchrun --nproc-per-node D -m furlong.core train ...`` starts ``D`` copies of the run.
Rank 0 is the main rank: it owns the data, the rollout engine, the rollout manager,
evaluation, logs and the checkpoint's state JSON and marker. Every rank loads the train
backend and trains on its share of each step's samples (the core's planner splits them).
This module holds what the ranks exchange: rank 0's rollout groups, the per-rank
log-probs, and barriers around checkpoint writes. Objects travel over a gloo group on the
host, also when the trainer's own collectives use NCCL.

Started without ``WORLD_SIZE`` (or with 1) everything here is a no-op on one rank.
"""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import timedelta
from typing import Any

import attrs

from furlong.hooks import PluginError

from .config.errors import ConfigError

__all__ = ["Ranks", "start_ranks"]

log = logging.getLogger("furlong")

OBJECT_TIMEOUT = timedelta(hours=24)


@attrs.frozen
class Ranks:
    """This process's place among the trainer ranks.

    ``world``: number of trainer processes ``D``; ``rank``: this one, ``0 <= rank < D``;
    ``group``: the gloo process group for object exchange (None on one rank).
    """

    world: int = 1
    rank: int = 0
    group: Any = None

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank with data, engine, logs and checkpoint markers."""
        return self.rank == 0

    async def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled); other ranks pass anything (e.g. None)."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        await self._collective(dist.broadcast_object_list, box, 0, group=self.group)
        return box[0]

    async def merge(self, rows: list) -> list:
        """Fill each rank's None entries with the entry another rank computed.

        :param rows: N entries (e.g. float32 tensors [T_i]); this rank's samples set,
            the others None, as a train backend's ``log_probs`` returns them.
        :returns: N entries, all set where any rank set them.
        """
        if self.world == 1:
            return rows
        import torch.distributed as dist

        mine = {i: row for i, row in enumerate(rows) if row is not None}
        gathered: list = [None] * self.world
        await self._collective(dist.all_gather_object, gathered, mine, group=self.group)
        merged = list(rows)
        for part in gathered:
            for i, row in part.items():
                merged[i] = row
        return merged

    async def barrier(self) -> None:
        """Wait until every rank reaches this point."""
        if self.world > 1:
            import torch.distributed as dist

            await self._collective(dist.barrier, group=self.group)

    async def _collective(self, fn, *args, **kwargs) -> None:
        """Run an object-group collective in a thread; a lost peer becomes one clear error.

        :raises PluginError: another rank left (it failed or was stopped); its own error
            says why, so this rank's message only points there.
        """
        try:
            await asyncio.to_thread(fn, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - gloo reports a lost peer with several types
            who = "rank 0" if not self.is_main else "another trainer rank"
            raise PluginError(f"trainer rank {self.rank}: lost contact with {who} ({type(exc).__name__}); "
                              f"its own error above says what went wrong. Stopping this rank.") from exc

    def close(self) -> None:
        """Tear the process group down (on every rank, at the end of the run)."""
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def start_ranks(args: Any) -> Ranks:
    """Join the other trainer ranks when started with ``WORLD_SIZE > 1`` (``torchrun``).

    Initializes the default process group (``--distributed-backend``: nccl means
    ``cpu:gloo,cuda:nccl`` so host tensors reduce too; gloo without CUDA) with
    ``--distributed-timeout-minutes``, and a gloo group for object exchange whose
    time-out is a day: ranks 1..D-1 wait in it while rank 0 generates and evaluates.

    :raises ConfigError: the number of processes differs from the trainer size in the
        flags (``--actor-num-nodes x --actor-num-gpus-per-node``), which sizes the data
        parallelism the batch flags were checked against.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    import torch
    import torch.distributed as dist

    flagged = int(args.actor_num_nodes) * int(args.actor_num_gpus_per_node)
    if flagged != world:
        raise ConfigError(
            f"torchrun started {world} trainer processes but --actor-num-nodes {args.actor_num_nodes} x "
            f"--actor-num-gpus-per-node {args.actor_num_gpus_per_node} = {flagged}; pass flags whose product is "
            f"{world} (e.g. --actor-num-gpus-per-node {world}) or change --nproc-per-node."
        )
    if not dist.is_initialized():
        nccl = torch.cuda.is_available() and getattr(args, "distributed_backend", "nccl") == "nccl"
        minutes = getattr(args, "distributed_timeout_minutes", 10) or 10
        dist.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo", timeout=timedelta(minutes=minutes))
    group = dist.new_group(backend="gloo", timeout=OBJECT_TIMEOUT)
    ranks = Ranks(world=dist.get_world_size(), rank=dist.get_rank(), group=group)
    if ranks.is_main:
        log.info("torchrun: %d trainer ranks; rank 0 runs the rollout", ranks.world)
    return ranks
