"""Flags of the ``cluster`` group, with Megatron's run flags."""

from __future__ import annotations

import argparse

__all__ = ["add"]


def add(g, dev) -> None:
    """Add the flags to argument group ``g``; ``dev`` holds the machine-dependent defaults."""
    g.add_argument("--actor-num-nodes", type=int, default=1, help="Nodes for the trainer.")
    g.add_argument("--actor-num-gpus-per-node", type=int, default=dev.gpus_per_node,
                   help="Devices per node for the trainer; trainer world size = nodes x this (1 without CUDA).")
    g.add_argument("--rollout-num-gpus", type=int, default=None,
                   help="GPUs for the SGLang engines; required with --rollout-backend sglang unless --colocate; "
                        "under --colocate it is set to the trainer world size.")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1,
                   help="GPUs per SGLang engine (its tp_size); must divide --rollout-num-gpus.")
    g.add_argument("--num-gpus-per-node", type=int, default=dev.gpus_per_node,
                   help="GPUs per node assumed when placing engines (1 without CUDA).")
    g.add_argument("--colocate", action="store_true",
                   help="Trainer and engines share the same GPUs and take turns; turns on --offload-train and "
                        "--offload-rollout unless they are given, and ignores --rollout-num-gpus.")
    g.add_argument("--offload", action="store_true", help="Same as --offload-train --offload-rollout.")
    g.add_argument("--offload-train", action=argparse.BooleanOptionalAction, default=None,
                   help="Trainer frees GPU memory while the engines generate (default: on under --colocate).")
    g.add_argument("--offload-rollout", action=argparse.BooleanOptionalAction, default=None,
                   help="Engines free GPU memory while the trainer trains (default: on under --colocate).")
    g.add_argument("--offload-rollout-level", nargs="+", choices=["kv_cache", "weight"],
                   default=["kv_cache", "weight"],
                   help="Engine memory released after generation (CUDA graphs are always released).")
    g.add_argument("--executor", default=None,
                   help="executor plugin: local (one process, or the processes of a torchrun job) or ray (Ray actors "
                        "in a placement group). "
                        "Default: ray with --rollout-backend sglang or a trainer of several GPUs not started by "
                        "torchrun, else local.")
    g.add_argument("--seed", type=int, default=1234, help="Trainer random seed (engine i uses seed + i).")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=dev.distributed_backend,
                   help="torch.distributed backend of the trainer (gloo without CUDA).")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="Timeout of trainer collectives, in minutes.")
