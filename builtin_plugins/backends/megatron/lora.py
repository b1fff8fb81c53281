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
targeted or excluded together.

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
           "save_adapter", "target_linears"]

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


def lora_problems(config: Any, tp: int, pp: int, is_moe: bool = False) -> list[str]:
    """What LoRA on megatron cannot do with this run (empty without ``--lora-rank``): unknown or split targets,
    TP or PP above 1, a mixture-of-experts model, a dropout outside ``[0, 1)``."""
    if not enabled(config):
        return []
    problems = []
    try:
        target_linears(config)
    except PluginError as exc:
        problems.append(str(exc))
    if tp > 1:
        problems.append(f"--lora-rank with --tensor-model-parallel-size {tp} is not supported yet by --train-backend "
                        "megatron (adapters on sharded linear layers); use TP 1 with data, pipeline or context "
                        "parallelism, or --train-backend fsdp.")
    if pp > 1:
        problems.append(f"--lora-rank with --pipeline-model-parallel-size {pp} is not supported yet by "
                        "--train-backend megatron; use data or context parallelism.")
    if is_moe:
        problems.append("--lora-rank on a mixture-of-experts model is not supported yet by --train-backend megatron.")
    if float(config.lora_dropout or 0.0) < 0 or float(config.lora_dropout or 0.0) >= 1:
        problems.append(f"--lora-dropout {config.lora_dropout}: must be in [0, 1).")
    return problems


def _scaling(config: Any) -> float:
    return float(config.lora_alpha) / float(config.lora_rank)


def apply_lora(model, config: Any, seed: int) -> list[str]:
    """Freeze ``model`` and add adapters to its targeted linears (:func:`target_linears`); return their names.

    :param seed: seeds ``A``'s initialisation (the same adapters on every data-parallel rank).
    """
    import torch

    targets = target_linears(config)
    rank, scaling, dropout = int(config.lora_rank), _scaling(config), float(config.lora_dropout or 0.0)
    model.requires_grad_(False)
    adapted = []
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for name, module in model.named_modules():
            if name.rpartition(".")[2] not in targets or ".experts." in name or not hasattr(module, "weight"):
                continue
            out_features, in_features = module.weight.shape
            weight = module.weight
            module.lora_A = torch.nn.Linear(in_features, rank, bias=False, device=weight.device, dtype=weight.dtype)
            module.lora_B = torch.nn.Linear(rank, out_features, bias=False, device=weight.device, dtype=weight.dtype)
            torch.nn.init.kaiming_uniform_(module.lora_A.weight, a=math.sqrt(5))
            torch.nn.init.zeros_(module.lora_B.weight)
            module.lora_scaling = scaling
            module.register_forward_hook(_adapter_hook(dropout))
            adapted.append(name)
    finally:
        torch.random.set_rng_state(state)
    return adapted


def _adapter_hook(dropout: float):
    """Forward hook of an adapted megatron linear: its ``(output, bias)`` with ``scaling B A dropout(x)`` added to
    the output (dropout only in passes with gradients: training, not log-prob passes)."""
    import torch
    import torch.nn.functional as F

    def hook(module, args, output):
        x = args[0]
        if dropout and torch.is_grad_enabled():
            x = F.dropout(x, p=dropout, training=True)
        delta = module.lora_B(module.lora_A(x)) * module.lora_scaling
        if isinstance(output, tuple):
            return (output[0] + delta, *output[1:])
        return output + delta

    return hook


def merged_weight(module):
    """``W + scaling B A`` of an adapted linear, computed in float32, in ``W``'s dtype (``[out, in]``); ``W``
    itself (detached) for a linear without adapters."""
    weight = module.weight.detach()
    if not hasattr(module, "lora_A"):
        return weight
    delta = (module.lora_B.weight.detach().float() @ module.lora_A.weight.detach().float()) * module.lora_scaling
    return (weight.float() + delta).to(weight.dtype)


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_sharded(sharded: dict) -> dict:
    """The adapter entries of a model's megatron-core sharded state dict (what LoRA checkpoints hold)."""
    return {k: v for k, v in sharded.items() if is_adapter_key(k)}


def save_adapter(model, shape: ModelShape, config: Any, path: str) -> None:
    """Write ``model``'s adapters in peft's format into ``path`` (``adapter_model.safetensors``,
    ``adapter_config.json``; base model ``--hf-checkpoint``) under the Hugging Face module names.

    A fused layer's adapter becomes one adapter per projection with the same ``A`` and that projection's rows of
    ``B`` (``B``'s rows are unpacked like the fused weight's: :func:`~.convert.unpack`), which gives each
    projection the same delta.
    """
    from safetensors.torch import save_file

    from .convert import Unit, unpack

    tensors, modules = {}, set()
    hf_of = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
             "linear_fc1": ("gate_up_proj",) if shape.family == "glm4" else ("gate_proj", "up_proj"),
             "linear_fc2": ("down_proj",)}
    kind = {"linear_qkv": "qkv", "linear_fc1": "copy" if shape.family == "glm4" else "fc1"}
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        parts = name.split(".")  # decoder.layers.<i>.<self_attention|mlp>.<linear>
        layer, block, linear = int(parts[2]), parts[3], parts[4]
        hf_block = "self_attn" if block == "self_attention" else "mlp"
        a = module.lora_A.weight.detach().cpu().contiguous()
        bs = unpack(Unit(name, hf_of[linear], kind.get(linear, "copy")), module.lora_B.weight.detach().cpu(), shape)
        for hf_name, b in zip(hf_of[linear], bs):
            prefix = f"base_model.model.model.layers.{layer}.{hf_block}.{hf_name}"
            tensors[f"{prefix}.lora_A.weight"] = a.clone()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous().clone()
            modules.add(hf_name)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(config.lora_rank),
                      "lora_alpha": int(config.lora_alpha), "lora_dropout": float(config.lora_dropout or 0.0),
                      "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False,
                      "base_model_name_or_path": str(config.hf_checkpoint)}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
