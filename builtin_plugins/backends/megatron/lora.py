"""LoRA on the megatron backend's linear layers (``--lora-rank``, ``--lora-alpha``, ``--lora-dropout``,
``--target-modules``, ``--exclude-modules``, the fsdp backend's flags).

Each targeted megatron-core linear layer (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` of
every decoder layer) keeps its frozen weight ``W`` ``[out, in]`` and gets two children, ``lora_A``
``[r, in]`` and ``lora_B`` ``[out, r]``; a forward hook adds ``(alpha / r) B A dropout(x)`` to its output.
``B`` starts at zero (the model starts as the base), ``A`` as ``nn.Linear``'s default (Kaiming-uniform),
as peft initialises them. Only the adapters require gradients, so only they reach the optimizer.

Target names are Miles' (standard LoRA on megatron): the megatron names above, or the Hugging Face
projections they fuse (``q_proj``, ``k_proj``, ``v_proj`` -> ``linear_qkv``; ``o_proj`` -> ``linear_proj``;
``gate_proj``, ``up_proj`` (GLM-4: ``gate_up_proj``) -> ``linear_fc1``; ``down_proj`` -> ``linear_fc2``), or
``all-linear`` (the default: all four). One adapter covers a fused layer, so the projections it fuses are
targeted or excluded together. Under tensor parallelism each adapter is split like its linear
(:func:`apply_lora`); pipeline stages hold their layers' adapters.

The engines get merged weights ``W + (alpha / r) B A`` under the Hugging Face names (the fused merged
weight goes through the usual conversion, :func:`~.convert.export_hf`). Adapter checkpoints: the
``torch_dist`` checkpoint holds the adapters and their AdamW moments only (the base is ``--hf-checkpoint``),
and ``adapter/`` beside it holds them in peft's format under the Hugging Face names (a fused adapter is one
adapter per projection sharing ``A``, with ``B``'s rows of that projection: the same delta).

Reference: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (2021).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from furlong.hooks import PluginError

from .config import ModelShape

__all__ = ["LINEARS", "adapter_sharded", "apply_lora", "enabled", "is_adapter_key", "lora_problems", "merged_weight",
           "save_adapter", "sharded_adapter", "summed_adapter", "target_linears"]

LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
_HF = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
       "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "gate_up_proj": "linear_fc1", "down_proj": "linear_fc2"}
_FUSED = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}
_ALL = ("all", "all-linear", "all_linear")


def enabled(config: Any) -> bool:
    return int(config.lora_rank or 0) > 0


def _names(text: Any) -> list[str]:
    if isinstance(text, (list, tuple)):
        text = ",".join(text)
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def _linears(names: list[str], flag: str) -> set[str]:
    """The megatron linears ``names`` (``flag``'s value) name; a fused layer's projections must come together."""
    if any(n in _ALL for n in names):
        return set(LINEARS)
    out, unknown = set(), []
    for name in names:
        if name in LINEARS:
            out.add(name)
        elif name in _HF:
            out.add(_HF[name])
        else:
            unknown.append(name)
    if unknown:
        raise PluginError(f"{flag} {','.join(names)}: {', '.join(unknown)} is not a linear layer --train-backend "
                          f"megatron puts adapters on (known: all-linear, {', '.join(LINEARS)}, {', '.join(_HF)}).")
    for linear, parts in _FUSED.items():
        given = [p for p in parts if p in names]
        if given and len(given) < len(parts) and linear not in names and "gate_up_proj" not in names:
            raise PluginError(f"{flag} {','.join(names)}: --train-backend megatron fuses {', '.join(parts)} into "
                              f"{linear} and puts one adapter on it; name all of {', '.join(parts)} (or {linear}).")
    return out


def target_linears(config: Any) -> set[str]:
    """The megatron linear names ``--target-modules`` minus ``--exclude-modules`` leaves.

    :raises PluginError: an unknown name, part of a fused layer's projections, or nothing left.
    """
    targets = _linears(_names(config.target_modules) or ["all-linear"], "--target-modules")
    excluded = _linears(_names(config.exclude_modules), "--exclude-modules") if _names(config.exclude_modules) \
        else set()
    left = targets - excluded
    if not left:
        raise PluginError("--target-modules minus --exclude-modules leaves no linear layer for LoRA.")
    return left


def lora_problems(config: Any, tp: int, is_moe: bool = False) -> list[str]:
    """What LoRA on megatron cannot do with this run (empty without ``--lora-rank``): unknown or split targets,
    dropout with TP above 1, a mixture-of-experts model, a dropout outside ``[0, 1)``."""
    if not enabled(config):
        return []
    problems = []
    try:
        target_linears(config)
    except PluginError as exc:
        problems.append(str(exc))
    if tp > 1 and float(config.lora_dropout or 0.0) > 0:
        problems.append(f"--lora-dropout {config.lora_dropout} with --tensor-model-parallel-size {tp} is not supported "
                        "yet by --train-backend megatron (each TP rank would drop different inputs of the same "
                        "adapter); use --lora-dropout 0 or TP 1.")
    if is_moe:
        problems.append("--lora-rank on a mixture-of-experts model is not supported yet by --train-backend megatron.")
    if float(config.lora_dropout or 0.0) < 0 or float(config.lora_dropout or 0.0) >= 1:
        problems.append(f"--lora-dropout {config.lora_dropout}: must be in [0, 1).")
    return problems


def _scaling(config: Any) -> float:
    return float(config.lora_alpha) / float(config.lora_rank)


COLUMN_LINEARS = ("linear_qkv", "linear_fc1")  # column-parallel: their output features are split over TP


def _is_column(name: str) -> bool:
    return any(f".{linear}." in name or name.endswith(f".{linear}") for linear in COLUMN_LINEARS)


def sharded_adapter(name: str) -> bool:
    """Whether adapter parameter ``name`` is split over the TP ranks: ``B`` of a column-parallel linear (its
    rows, as the linear's weight), ``A`` of a row-parallel one (its columns)."""
    return (".lora_B." in name and _is_column(name)) or (".lora_A." in name and not _is_column(name))


def summed_adapter(name: str, sequence_parallel: bool) -> bool:
    """Whether adapter parameter ``name``'s gradient is a partial sum on each TP rank: the replicated factor
    (``A`` of a column-parallel linear, ``B`` of a row-parallel one) under sequence parallelism, where each
    rank's gradient covers its own chunk of the sequence."""
    return sequence_parallel and (".lora_A." in name or ".lora_B." in name) and not sharded_adapter(name)


def apply_lora(model, config: Any, seed: int, layer_offset: int = 0) -> list[str]:
    """Freeze ``model`` and add adapters to its targeted linears (:func:`target_linears`); return their names.

    On a column-parallel linear (``linear_qkv``, ``linear_fc1``) ``A`` is a replicated ``nn.Linear`` and ``B`` a
    megatron-core ``ColumnParallelLinear`` split like the linear's weight; on a row-parallel one
    (``linear_proj``, ``linear_fc2``) ``A`` is a ``RowParallelLinear`` split like the weight (its output reduced,
    or reduce-scattered under sequence parallelism, as the linear's) and ``B`` a replicated ``nn.Linear``. So the
    delta has the linear's own layout and megatron-core's layers carry the tensor-parallel communication.
    Every rank draws the whole ``A`` of each adapter from a generator seeded by ``seed``, the layer's global
    index and the linear, and keeps its piece: the adapters are those of one process at any TP or PP size.

    :param seed: seeds ``A``'s initialisation (the same adapters on every data-parallel rank).
    :param layer_offset: the global index of ``model``'s first decoder layer (its pipeline stage's).
    """
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    targets = target_linears(config)
    rank, scaling, dropout = int(config.lora_rank), _scaling(config), float(config.lora_dropout or 0.0)
    model.requires_grad_(False)
    adapted = []
    for name, module in list(model.named_modules()):
        if name.rpartition(".")[2] not in targets or ".experts." in name or not hasattr(module, "weight"):
            continue
        weight, linear_config = module.weight, module.config
        tp = linear_config.tensor_model_parallel_size
        column = _is_column(name)
        out_features = weight.shape[0] * (tp if column else 1)
        in_features = weight.shape[1] * (1 if column else tp)
        layer = int(name.split(".")[2]) + layer_offset  # decoder.layers.<i>.<block>.<linear>
        draw = torch.Generator().manual_seed(seed * 1_000_003 + layer * len(LINEARS) +
                                             LINEARS.index(name.rpartition(".")[2]))
        whole_a = torch.empty(rank, in_features, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(whole_a, a=math.sqrt(5), generator=draw)
        options = dict(config=linear_config, init_method=torch.nn.init.zeros_, bias=False, skip_bias_add=True)
        if column:
            module.lora_A = torch.nn.Linear(in_features, rank, bias=False, device=weight.device,
                                            dtype=weight.dtype)
            module.lora_B = ColumnParallelLinear(rank, out_features, gather_output=False,
                                                 stride=2 if name.endswith("linear_fc1") else 1, **options)
            piece = whole_a
        else:
            module.lora_A = RowParallelLinear(in_features, rank, input_is_parallel=True, **options)
            module.lora_B = torch.nn.Linear(rank, out_features, bias=False, device=weight.device,
                                            dtype=weight.dtype)
            piece = whole_a.chunk(tp, dim=1)[_tp_rank(module.lora_A)]
        module.lora_A.to(weight.device)
        module.lora_B.to(weight.device)
        with torch.no_grad():
            module.lora_A.weight.copy_(piece)
            module.lora_B.weight.zero_()
        module.lora_A.weight.requires_grad_(True)
        module.lora_B.weight.requires_grad_(True)
        module.lora_scaling = scaling
        module.register_forward_hook(_adapter_hook(dropout))
        _own_sharded_state(module, name.endswith("linear_fc1"))
        adapted.append(name)
    return adapted


def _tp_rank(layer) -> int:
    """This rank's index in ``layer``'s tensor-parallel group (a megatron-core parallel linear)."""
    group = getattr(layer, "tp_group", None)
    return group.rank() if group is not None else 0


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _adapter_hook(dropout: float):
    """Forward hook of an adapted megatron linear: its ``(output, bias)`` with ``scaling B A dropout(x)`` added to
    the output (dropout only in passes with gradients: training, not log-prob passes)."""
    import torch
    import torch.nn.functional as F

    def hook(module, args, output):
        x = args[0]
        if dropout and torch.is_grad_enabled():
            x = F.dropout(x, p=dropout, training=True)
        delta = _first(module.lora_B(_first(module.lora_A(x)))) * module.lora_scaling
        if isinstance(output, tuple):
            return (output[0] + delta, *output[1:])
        return output + delta

    return hook


def _own_sharded_state(module, stride_two: bool) -> None:
    """Make ``module``'s megatron-core sharded state dict describe its adapters' own TP split (the linear's
    ``sharded_state_dict`` treats every child tensor as replicated): each megatron-core adapter layer gives its
    entries, ``B`` of ``linear_fc1`` as the global ``[gate; up]`` like the linear's weight (so adapter checkpoints
    load at another TP size)."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    original = module.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        out = original(prefix, sharded_offsets, metadata)
        for child in ("lora_A", "lora_B"):
            layer = getattr(module, child)
            if hasattr(layer, "sharded_state_dict"):
                own = layer.sharded_state_dict(f"{prefix}{child}.", sharded_offsets, metadata)
                key = f"{prefix}{child}.weight"
                if stride_two and key in own:
                    own[key] = apply_swiglu_sharded_factory(own[key], sharded_offsets)
                out.update(own)
        return out

    module.sharded_state_dict = sharded_state_dict


def merged_weight(module):
    """``W + scaling B A`` of an adapted linear, computed in float32, in ``W``'s dtype (``[out, in]``); ``W``
    itself (detached) for a linear without adapters."""
    weight = module.weight.detach()
    if not hasattr(module, "lora_A"):
        return weight  # (a column-parallel linear's B and a row-parallel one's A are this rank's pieces, as W)
    delta = (module.lora_B.weight.detach().float() @ module.lora_A.weight.detach().float()) * module.lora_scaling
    return (weight.float() + delta).to(weight.dtype)


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_sharded(sharded: dict) -> dict:
    """The adapter entries of a model's megatron-core sharded state dict (what LoRA checkpoints hold)."""
    return {k: v for k, v in sharded.items() if is_adapter_key(k)}


def save_adapter(model, shape: ModelShape, config: Any, path: str, tp: int = 1, group=None,
                 write: bool = True, layer_offset: int = 0, pp_group=None) -> None:
    """Write ``model``'s adapters in peft's format into ``path`` (``adapter_model.safetensors``,
    ``adapter_config.json``; base model ``--hf-checkpoint``) under the Hugging Face module names.

    A fused layer's adapter becomes one adapter per projection with the same ``A`` and that projection's rows of
    ``B`` (``B``'s rows are unpacked like the fused weight's: :func:`~.convert.unpack`), which gives each
    projection the same delta. With TP > 1 every rank of the TP ``group`` calls it (the split factors are
    all-gathered); with pipeline stages every stage does (``layer_offset``: its first layer's global index), and
    the stages' adapters are gathered over ``pp_group``; only ``write`` ranks write.
    """
    import torch.distributed as dist

    from safetensors.torch import save_file

    from .convert import COLUMN, FC1, ROW, Unit, gather_full, unpack

    tensors, modules = {}, set()
    hf_of = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
             "linear_fc1": ("gate_up_proj",) if shape.family == "glm4" else ("gate_proj", "up_proj"),
             "linear_fc2": ("down_proj",)}
    kind = {"linear_qkv": "qkv", "linear_fc1": "copy" if shape.family == "glm4" else "fc1"}
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        parts = name.split(".")  # decoder.layers.<i>.<self_attention|mlp>.<linear>
        layer, block, linear = int(parts[2]) + layer_offset, parts[3], parts[4]
        hf_block = "self_attn" if block == "self_attention" else "mlp"
        column = linear in COLUMN_LINEARS
        a = gather_full(module.lora_A.weight, None if column else ROW, tp, group)
        b = gather_full(module.lora_B.weight, (FC1 if linear == "linear_fc1" else COLUMN) if column else None, tp,
                        group)
        bs = unpack(Unit(name, hf_of[linear], kind.get(linear, "copy")), b.cpu(), shape)
        for hf_name, piece in zip(hf_of[linear], bs):
            prefix = f"base_model.model.model.layers.{layer}.{hf_block}.{hf_name}"
            tensors[f"{prefix}.lora_A.weight"] = a.cpu().contiguous().clone()
            tensors[f"{prefix}.lora_B.weight"] = piece.contiguous().clone()
            modules.add(hf_name)
    if pp_group is not None:
        stages: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, (tensors, modules), group=pp_group)
        tensors = {k: v for part, _ in stages for k, v in part.items()}
        modules = set().union(*(names for _, names in stages))
    if not write:
        return
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(config.lora_rank),
                      "lora_alpha": int(config.lora_alpha), "lora_dropout": float(config.lora_dropout or 0.0),
                      "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False,
                      "base_model_name_or_path": str(config.hf_checkpoint)}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
