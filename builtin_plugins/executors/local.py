"""The ``local`` executor: everything in this process, or one process per train rank under ``torchrun``.

One process: the train worker and the engines live in the driver's process and weight
buckets are handed over as tensors. Under ``torchrun --nproc-per-node D`` every process is
one train rank; rank 0 is the driver (data, engines, rollout, eval, logs, checkpoint
bookkeeping) and also train rank 0; ranks 1..D-1 only serve train calls
(:mod:`.torchrun`).
"""

from __future__ import annotations

from furlong.hooks import ExecutorFit, hookimpl
from furlong.kit.dist import launched_processes

from ._fit import in_process_reason, needs_actors
from ._in_process import InProcessWorkers, LocalExecutor

__all__ = ["InProcessWorkers", "LocalExecutor", "configure", "executor", "executor_fit"]


@hookimpl
def executor_fit(args):
    """Fits unless the launch needs actors (``RAY_ADDRESS``, engines run as actors, several train
    ranks not started by ``torchrun``); the engines run in the driver's process."""
    reason = needs_actors(args)
    return ExecutorFit(reason is None, reason or in_process_reason(), engines_in_driver=True)


@hookimpl
def configure(args, report):
    """The trainer size in the flags must be the number of processes: 1, or ``torchrun``'s.

    ``--actor-num-nodes x --actor-num-gpus-per-node`` sizes the data parallelism the batch
    flags were checked against.
    """
    world = launched_processes()
    flagged = int(args.actor_num_nodes) * int(args.actor_num_gpus_per_node)
    if world == 1 and flagged > 1:
        report.error(
            f"--executor local runs one train rank in this process, but --actor-num-nodes {args.actor_num_nodes} x "
            f"--actor-num-gpus-per-node {args.actor_num_gpus_per_node} = {flagged}; start one process per rank "
            f"(torchrun --nproc-per-node {flagged} -m furlong.core train ...), use --executor ray, or pass "
            "--actor-num-gpus-per-node 1.")
    elif world > 1 and flagged != world:
        report.error(
            f"torchrun started {world} trainer processes but --actor-num-nodes {args.actor_num_nodes} x "
            f"--actor-num-gpus-per-node {args.actor_num_gpus_per_node} = {flagged}; pass flags whose product is "
            f"{world} (e.g. --actor-num-gpus-per-node {world}) or change --nproc-per-node.")


@hookimpl
def executor(config):
    """One process, or the ranks ``torchrun`` started (``WORLD_SIZE > 1``).

    Flags read: ``--actor-num-nodes``, ``--actor-num-gpus-per-node`` (their product must
    equal the number of ``torchrun`` processes), ``--distributed-backend``,
    ``--distributed-timeout-minutes``.
    """
    if launched_processes() > 1:
        from .torchrun import TorchrunExecutor

        return TorchrunExecutor(config)
    return LocalExecutor()
