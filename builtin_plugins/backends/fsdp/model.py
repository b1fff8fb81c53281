"""Process group, model loading, FSDP2 sharding and the optimizer of the fsdp backend."""

from __future__ import annotations

import logging
import os
from typing import Any

from furlong.hooks import PluginError, RunConfig
from furlong.kit.hf import decoder_layers, is_hf_dir, load_causal_lm_weights

from .packing import use_packed_attention

__all__ = ["build_optimizer", "dist_info", "enable_activation_checkpointing", "load_causal_lm", "shard", "tied_names"]

log = logging.getLogger("furlong.backends.fsdp")


def dist_info(config: RunConfig) -> tuple[int, int]:
    """``(world_size, rank)`` of the default process group, ``(1, 0)`` without one.

    ``furlong train`` under ``torchrun`` initializes the group before the backend loads
    (:mod:`furlong.core.ranks`); code that drives the backend on its own under
    ``torchrun`` calls ``torch.distributed.init_process_group`` first.

    :raises PluginError: ``WORLD_SIZE > 1`` but no process group is initialized.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise PluginError("fsdp: WORLD_SIZE > 1 but torch.distributed is not initialized; call "
                          "torch.distributed.init_process_group before the backend's init (furlong train does).")
    return 1, 0


def load_causal_lm(path: str, config: RunConfig, device, flag: str):
    """Load a float32 causal LM from ``path`` into host memory (the caller moves or shards it).

    Attention: ``--attn-implementation`` when it loads, else ``sdpa`` (always ``sdpa`` on CPU,
    where flash attention does not exist). On CUDA under ``--bf16`` an ``sdpa`` model with full
    attention in every layer and no attention dropout is switched to packed attention
    (:mod:`.packing`): its micro-batches are concatenated into one row without padding.
    ``--gradient-checkpointing`` is switched on here.

    :param flag: the flag that named ``path``, for the error message.
    :raises PluginError: ``path`` is not a loadable Hugging Face model directory.
    """
    import torch

    if not is_hf_dir(path):
        raise PluginError(f"{flag} {path}: not a Hugging Face model directory (no config.json); the fsdp backend "
                          "loads Hugging Face checkpoints.")
    wanted = config.attn_implementation
    if device.type != "cuda" and wanted.startswith("flash"):
        wanted = "sdpa"
    order = (wanted,) if wanted == "sdpa" else (wanted, "sdpa")
    model = load_causal_lm_weights(path, flag, order, dtype=torch.float32)
    model.config.use_cache = False
    if device.type == "cuda":
        reason = ("float32 training (--bf16 off): the variable-length flash kernel runs in 16-bit only"
                  if not config.bf16 else use_packed_attention(model))
        if reason is not None:
            log.info("fsdp: %s: micro-batches are right-padded, not packed: %s", flag, reason)
    if config.gradient_checkpointing:
        enable_activation_checkpointing(model)
    return model


def enable_activation_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing of every decoder layer (``--gradient-checkpointing``), under
    the name this transformers has (``activation_checkpointing_enable`` from 5.2x; the old name goes in v6)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def tied_names(model) -> set[str]:
    """State-dict names that alias an earlier entry (tied embeddings); Hugging Face files omit them."""
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in model.state_dict().items():
        key = tensor.data_ptr()
        if key in seen:
            tied.add(name)
        else:
            seen[key] = name
    return tied


def shard(model, config: RunConfig, world: int, device, *, trainable: bool) -> None:
    """FSDP2: ``fully_shard`` each decoder layer, then the whole model (in place).

    Mesh: 1-D over all ranks, or 2-D ``(dp_replicate, dp_shard)`` (HSDP) with
    ``--dp-replicate-size``. Mixed precision on CUDA with ``--bf16``: bfloat16 compute,
    float32 gradient reduction and master weights. ``--fsdp-cpu-offload``: parameters,
    gradients and optimizer state live on the host.

    Gradient reduction is a SUM over ranks, not FSDP's default mean: the core's step
    objective already divides by the whole step's denominator (samples or tokens of
    every rank), so each rank's gradient is its share of the global gradient and the
    shares must be added. Implemented with ``set_gradient_divide_factor(1.0)`` plus
    ``set_force_sum_reduction_for_comms(True)`` on every FSDP module (plain SUM
    collectives, which gloo also supports).

    :raises PluginError: ``--dp-replicate-size`` does not divide the world size.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    replicate = int(config.dp_replicate_size or 1)
    if world % replicate:
        raise PluginError(f"--dp-replicate-size {replicate} must divide the trainer world size {world}.")
    if replicate > 1:
        mesh = init_device_mesh(device.type, (replicate, world // replicate), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    bf16 = device.type == "cuda" and config.bf16
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy() if config.fsdp_cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if trainable:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)


def build_optimizer(model, config: RunConfig):
    """AdamW (``--optimizer adam``) or SGD (``sgd``) over the trainable parameters.

    Decoupled weight decay ``--weight-decay`` applies to matrices only: biases and other
    1-D parameters (norm scales) get none, as Megatron's default ``no_weight_decay_cond``.
    Adam: ``--adam-beta1``, ``--adam-beta2``, ``--adam-eps``; the fused CUDA kernel when every
    parameter is an unsharded CUDA tensor (one process on one GPU). SGD: ``--sgd-momentum``
    (Megatron's default 0.9). The learning rate is set before each step by the schedule.

    :raises PluginError: another ``--optimizer``.
    """
    import torch

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or name.endswith(".bias") else decay).append(param)
    wd = float(config.weight_decay)
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    kind = config.optimizer or "adam"
    if kind == "adam":
        params = decay + no_decay
        fused = bool(params) and all(p.is_cuda and not hasattr(p, "full_tensor") for p in params)
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                                 fused=fused or None)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=float(config.megatron_args.get("sgd_momentum", 0.9)))
    raise PluginError(f"--optimizer {kind!r}: the fsdp backend supports adam (AdamW) and sgd.")
