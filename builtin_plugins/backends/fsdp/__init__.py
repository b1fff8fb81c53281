"""fsdp train backend: Hugging Face transformers models trained with torch (FSDP2 across ranks; CPU with gloo)."""

from __future__ import annotations

from furlong.hooks import hookimpl

from .backend import FSDPBackend

__all__ = ["FSDPBackend", "configure", "train_backend"]


@hookimpl
def configure(args, report):
    """No context parallelism; ``--dp-replicate-size`` (HSDP replicas) must divide the trainer world size."""
    if args.context_parallel_size > 1:
        report.error(f"--train-backend fsdp does not support --context-parallel-size {args.context_parallel_size}; "
                     f"use 1 or --train-backend megatron.")
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.dp_replicate_size >= 1 and world % args.dp_replicate_size:
        report.error(f"--dp-replicate-size ({args.dp_replicate_size}) must divide the trainer world size {world}.")


@hookimpl
def train_backend(args):
    """Create the fsdp backend; :meth:`FSDPBackend.init` loads the model.

    Flags read: ``--hf-checkpoint``, ``--ref-load``, ``--use-kl-loss``, ``--kl-coef``,
    ``--optimizer``, ``--lr``, ``--min-lr``, ``--lr-decay-style``, ``--lr-decay-iters``,
    ``--lr-warmup-iters``, ``--lr-warmup-fraction``, ``--lr-warmup-init``,
    ``--weight-decay``, ``--adam-beta1``, ``--adam-beta2``, ``--adam-eps``,
    ``--clip-grad``, ``--num-rollout`` and the batch knobs (total steps),
    ``--micro-batch-size``, ``--entropy-coef``, ``--reset-optimizer-states``,
    ``--no-check-for-nan-in-loss-and-grad``, ``--no-save-optim``, ``--no-load-optim``,
    ``--no-load-rng``, ``--gradient-checkpointing``, ``--attn-implementation``,
    ``--bf16``, ``--fsdp-cpu-offload``, ``--dp-replicate-size``.
    Megatron flags given with this backend are ignored with one warning.

    :returns: an :class:`FSDPBackend` (meets :class:`furlong.hooks.TrainBackend`).
    """
    return FSDPBackend(args)
