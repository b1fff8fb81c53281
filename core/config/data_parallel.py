"""The trainer's data-parallel size, from the rule the train backend reported in ``configure``
(:meth:`furlong.hooks.ConfigReport.data_parallel_rule`), and the batch flags checked against it."""

from __future__ import annotations

from argparse import Namespace

from furlong.hooks import DataParallelRule

from .knobs import dp_problems

__all__ = ["apply_data_parallel", "rule_in_words", "world_of"]


def world_of(args: Namespace) -> int:
    """Trainer ranks: ``--actor-num-nodes x --actor-num-gpus-per-node``."""
    return args.actor_num_nodes * args.actor_num_gpus_per_node


def apply_data_parallel(args: Namespace, rule: DataParallelRule | None, check_batches: bool) -> list[str]:
    """Set ``args.data_parallel_size = world / rule.model_size``; return the problems, one line each.

    :param rule: the train backend's report (None: :class:`DataParallelRule`'s default, every
        rank a data-parallel rank).
    :param check_batches: also check that ``--global-batch-size`` splits evenly over the
        data-parallel ranks (and their micro-batches); off when the executor refused the
        trainer's size itself, so the batch flags are not blamed for it.
    :returns: a world the model replicas do not divide, or the batch flags' problems
        (:func:`~furlong.core.config.knobs.dp_problems`); ``args.data_parallel_size`` keeps
        the world size when the world does not divide.
    """
    rule = rule or DataParallelRule()
    world, model = world_of(args), rule.model_size
    if min(world, model, args.micro_batch_size) < 1:
        return []  # the flags' own minimums are reported already
    base = f"actor_num_nodes {args.actor_num_nodes} x actor_num_gpus_per_node {args.actor_num_gpus_per_node}"
    sizes = " x ".join(f"{name} {value}" for name, value in rule.model_parallel)
    if world % model:
        machine = ("" if "actor_num_gpus_per_node" in args.explicit_args else
                   f" (--actor-num-gpus-per-node was not given: {args.actor_num_gpus_per_node} is this machine's GPU "
                   "count, 1 without CUDA; give the GPUs per node the trainer will run on)")
        return [f"trainer world size {world} ({base}) is not divisible by {sizes} = {model}{machine}."]
    args.data_parallel_size = world // model
    if not check_batches or args.global_batch_size is None:  # no batch size: the knobs' problem is reported
        return []
    how = f"{base} / ({sizes})" if rule.model_parallel else f"{base}, --train-backend {args.train_backend}"
    return dp_problems(args.global_batch_size, args.micro_batch_size, args.use_dynamic_batch_size,
                       args.data_parallel_size, how)


def rule_in_words(rule: DataParallelRule | None, world: int) -> str:
    """``"world / (TP x PP x CP)"``, or ``"the world size (W = actor_num_nodes x actor_num_gpus_per_node)"``."""
    if rule is not None and rule.model_parallel:
        return "world / (" + " x ".join(name for name, _ in rule.model_parallel) + ")"
    return f"the world size ({world} = actor_num_nodes x actor_num_gpus_per_node)"
