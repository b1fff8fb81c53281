"""Why a run needs Ray actors, shared by the ``local`` and ``ray`` executors' ``executor_fit``."""

from __future__ import annotations

import os

from furlong.kit.dist import launched_processes

__all__ = ["needs_actors", "in_process_reason"]


def needs_actors(args) -> str | None:
    """Why this launch needs actors (one phrase), or None when one process, or ``torchrun``'s ranks, can run it."""
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    if os.environ.get("RAY_ADDRESS"):
        return "RAY_ADDRESS is set (ray job submit)"
    if args.rollout_backend == "sglang":
        return "--rollout-backend sglang runs its engines as actors"
    if world > 1 and launched_processes() <= 1:
        return f"a trainer of {world} ranks, not started by torchrun"
    return None


def in_process_reason() -> str:
    """Why the run fits this process: ``torchrun`` started it, or the trainer is one rank."""
    return "torchrun started this process" if launched_processes() > 1 else "one train rank"
