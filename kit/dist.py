"""The weight-update process group between trainer rank 0 and the rollout engines.

Both sides build it the way SGLang's ``/init_weights_update_group`` does: a TCP store
rendezvous at ``master_address:master_port`` whose keys are prefixed by the group name,
and a process group over that store which is *not* the process's default group (an
engine's default group, if it has one, stays its own; the trainer keeps its train group).
Building it any other way on one side (for example ``init_process_group`` on the
trainer) makes both sides wait out the whole time-out. Trainer rank 0 is rank 0 of the
group; engine ``i`` joins as ``rank_offset + tp_rank``.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

from furlong.hooks.errors import PluginError

__all__ = ["broadcast_bucket", "free_port", "host_address", "launched_processes", "new_weight_update_group",
           "receive_bucket"]


def new_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                            backend: str = "gloo", timeout_s: float = 600.0) -> Any:
    """Join the group named ``group_name`` as ``rank`` of ``world_size``; return the process group.

    Collective: every member calls it with the same address, port, size and name.

    :param backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
    :raises PluginError: the rendezvous failed (the message names the address and group).
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    try:
        store, rank, world_size = next(c10d.rendezvous(url, rank=rank, world_size=world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = dist.PrefixStore(group_name, store)
        kwargs = {"group_name": group_name, "timeout": timeout}
        group, _ = c10d._new_process_group_helper(world_size, rank, [], backend, store, **kwargs)
    except Exception as exc:  # noqa: BLE001 - store and backend errors come in many types
        raise PluginError(f"weight-update group '{group_name}' at {url} (rank {rank} of {world_size}, {backend}): "
                          f"{type(exc).__name__}: {exc}") from exc
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_bucket(tensors: list, group: Any) -> None:
    """Send ``tensors`` from rank 0 of ``group`` to every member, one broadcast per tensor."""
    import torch.distributed as dist

    for tensor in tensors:
        dist.broadcast(tensor.contiguous(), src=0, group=group)


def receive_bucket(dtypes: list[str], shapes: list[list[int]], group: Any, device: Any = "cpu") -> list:
    """Receive the tensors :func:`broadcast_bucket` sends: empty tensors of the announced dtypes and shapes."""
    import torch
    import torch.distributed as dist

    out = []
    for dtype, shape in zip(dtypes, shapes):
        tensor = torch.empty(list(shape), dtype=getattr(torch, dtype), device=device)
        dist.broadcast(tensor, src=0, group=group)
        out.append(tensor)
    return out


def launched_processes() -> int:
    """The number of processes ``torchrun`` started for this run (its ``WORLD_SIZE``); 1 outside ``torchrun``."""
    import os

    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def host_address() -> str:
    """This host's address as other hosts reach it.

    ``FURLONG_HOST_IP`` when set (executors set it to the node's address: Ray's view of the
    node), else the address of the host's own name, which on many hosts is loopback, so
    only good for one machine.
    """
    import os

    if os.environ.get("FURLONG_HOST_IP"):
        return os.environ["FURLONG_HOST_IP"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
