"""The megatron backend's optimizer and learning-rate schedule.

AdamW over the trained parameters (the float32 master weights under ``--bf16``); with
``--use-distributed-optimizer`` and more than one rank in the data-parallel x context-parallel
group its state is sharded over those ranks with torch's ``ZeroRedundancyOptimizer``
(ZeRO stage 1, Rajbhandari et al. 2020): each rank keeps the AdamW moments of its share of
the parameters, updates that share and broadcasts it. The step is the same as unsharded
AdamW's; the moments take about ``1 / (DP x CP)`` of the memory. The LR schedule is megatron-core's
``OptimizerParamScheduler`` driven by Megatron's flags.
"""

from __future__ import annotations

from typing import Any

from furlong.hooks import PluginError, RunConfig

__all__ = ["build_optimizer", "build_scheduler", "total_steps"]


def build_optimizer(named_parameters, config: RunConfig, shard_over=None):
    """AdamW over ``named_parameters`` (``(name, tensor)`` pairs; those requiring grad are
    trained): ``--adam-beta1``, ``--adam-beta2``, ``--adam-eps``; the fused CUDA kernel on GPUs.

    Megatron's default decay rule: biases and 1-D parameters (norm scales) get
    ``wd_mult`` 0, which :class:`OptimizerParamScheduler` applies to ``--weight-decay``.

    :param shard_over: a process group (``--use-distributed-optimizer``: the DP x CP ranks)
        over which the AdamW state is sharded by a ``ZeroRedundancyOptimizer``; None keeps it whole.
    :raises PluginError: an ``--optimizer`` other than adam.
    """
    import torch

    kind = config.optimizer or "adam"
    if kind != "adam":
        raise PluginError(f"--optimizer {kind!r}: the megatron backend supports adam (AdamW) only.")
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    groups = [{"params": [p for n, p in named if p.ndim >= 2 and not n.endswith(".bias")], "wd_mult": 1.0},
              {"params": [p for n, p in named if p.ndim < 2 or n.endswith(".bias")], "wd_mult": 0.0}]
    groups = [g for g in groups if g["params"]]
    fused = bool(named) and all(p.is_cuda for _, p in named)  # one kernel for the whole step on CUDA
    settings = dict(lr=float(config.lr), betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                    fused=fused or None)
    if shard_over is None:
        return torch.optim.AdamW(groups, **settings)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=shard_over, **settings)


def total_steps(config: RunConfig) -> int:
    """Optimizer steps of the run: ``num_rollout x steps per rollout``."""
    per_rollout = config.num_steps_per_rollout or (
        config.rollout_batch_size * config.n_samples_per_prompt // config.global_batch_size)
    return int(config.num_rollout) * int(per_rollout)


def build_scheduler(optimizer, config: RunConfig):
    """megatron-core's ``OptimizerParamScheduler`` from Megatron's LR flags, counted in optimizer steps.

    ``--lr``, ``--min-lr``, ``--lr-decay-style``, ``--lr-decay-iters`` (default: total
    steps), ``--lr-warmup-iters`` or ``--lr-warmup-fraction`` (of the decay steps),
    ``--lr-warmup-init``, ``--lr-wsd-decay-iters``, ``--lr-wsd-decay-style``,
    ``--weight-decay`` (constant), ``--use-checkpoint-opt_param-scheduler`` /
    ``--override-opt_param-scheduler`` (which side wins on load). Megatron counts samples
    (steps x gbs); every length scales by gbs, so the values are the same.

    :raises PluginError: a warmup not shorter than the decay, or WSD without its anneal length.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    style = config.lr_decay_style or "constant"
    decay = config.lr_decay_iters if config.lr_decay_iters is not None else total_steps(config)
    decay = max(int(decay), 1)
    fraction = config.lr_warmup_fraction
    warmup = int(fraction * decay) if fraction is not None else int(config.lr_warmup_iters or 0)
    if warmup >= decay:
        raise PluginError(f"--lr-warmup-iters/--lr-warmup-fraction give {warmup} warmup steps, not fewer than the "
                          f"{decay} decay steps (--lr-decay-iters, default num_rollout x steps per rollout).")
    wsd = config.lr_wsd_decay_iters
    if style == "WSD" and not wsd:
        raise PluginError("--lr-decay-style WSD needs --lr-wsd-decay-iters (steps of the final anneal).")
    wd = float(config.weight_decay)
    override = bool(config.override_opt_param_scheduler)
    return OptimizerParamScheduler(
        optimizer, init_lr=float(config.lr_warmup_init or 0.0), max_lr=float(config.lr),
        min_lr=float(config.min_lr or 0.0), lr_warmup_steps=warmup, lr_decay_steps=decay,
        lr_decay_style=style, start_wd=wd, end_wd=wd, wd_incr_steps=decay, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=bool(config.use_checkpoint_opt_param_scheduler)
        and not override, override_opt_param_scheduler=override, wsd_decay_steps=wsd,
        lr_wsd_decay_style=config.lr_wsd_decay_style)
