"""LoRA for the fsdp backend through peft (``--lora-rank``, ``--lora-alpha``, ``--lora-dropout``,
``--target-modules``, ``--exclude-modules``).

The actor is wrapped with :func:`peft.get_peft_model`: the base weights are frozen, the
optimizer sees only the adapters. The engines get merged weights under the Hugging Face
names (``W + (alpha / r) B A``, peft's ``get_delta_weight``), so an engine that serves the
base model needs nothing LoRA-specific. Checkpoints hold the adapters only (peft's
``adapter_model.safetensors`` and ``adapter_config.json`` in ``model/``); the base is
``--hf-checkpoint``. Reference: Hu et al., "LoRA: Low-Rank Adaptation of Large Language
Models" (2021); peft's ``LoraConfig``.
"""

from __future__ import annotations

import os
from typing import Any, AsyncIterator

from furlong.hooks import PluginError, RunConfig

__all__ = ["ADAPTER", "adapter_keys", "apply_lora", "base_model", "enabled", "is_adapter_dir", "merged_weights",
           "set_dropout"]

ADAPTER = "default"  # peft's adapter name
PREFIX = "base_model.model."


def base_model(model):
    """The model a peft wrapper wraps (the adapters live inside its layers), else ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def enabled(config: RunConfig) -> bool:
    return int(config.lora_rank or 0) > 0


def apply_lora(model, config: RunConfig):
    """Wrap ``model`` with LoRA adapters when ``--lora-rank`` > 0, else return it unchanged.

    ``--target-modules``: ``all-linear`` (default; every linear layer but the output head)
    or comma-separated module names; ``--exclude-modules``: comma-separated names.

    :raises PluginError: peft is not installed, or peft rejects the targets.
    """
    if not enabled(config):
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise PluginError("--lora-rank needs peft: pip install 'furlong[lora]' (or pip install peft).") from exc
    targets = _names(config.target_modules) or ["all-linear"]
    lora_config = LoraConfig(
        r=int(config.lora_rank), lora_alpha=int(config.lora_alpha), lora_dropout=float(config.lora_dropout),
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        exclude_modules=_names(config.exclude_modules) or None, task_type="CAUSAL_LM",
    )
    try:
        wrapped = get_peft_model(model, lora_config)
    except ValueError as exc:
        raise PluginError(f"--target-modules {','.join(targets)}: {exc}") from exc
    if config.gradient_checkpointing:
        wrapped.enable_input_require_grads()  # the frozen embeddings would cut the checkpointed graph
    return wrapped


def _names(text: str | None) -> list[str]:
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def set_dropout(model, active: bool) -> None:
    """LoRA dropout on for training passes, off for log-prob passes (the model itself stays in eval mode)."""
    for name, module in model.named_modules():
        if name.endswith(f"lora_dropout.{ADAPTER}"):
            module.train(active)


def _scalings(model) -> dict[str, float]:
    """``{hf module name: alpha / r}`` of every LoRA layer."""
    out = {}
    for name, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and ADAPTER in scaling and hasattr(module, "base_layer"):
            out[name.removeprefix(PREFIX)] = float(scaling[ADAPTER])
    return out


async def merged_weights(model, items: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[tuple[str, Any]]:
    """The Hugging Face weights of a LoRA model: ``(hf_name, tensor)`` with adapters merged.

    :param items: ``(state-dict name, full tensor)`` in the model's state-dict order (a
        LoRA layer's ``base_layer.weight`` comes before its ``lora_A`` and ``lora_B``).
    :yields: base weights under their Hugging Face names; a LoRA layer's weight as
        ``W + scaling * (B @ A)`` computed in float32, in ``W``'s dtype (``[out, in]``).
    """
    scalings = _scalings(model)
    held: dict[str, dict[str, Any]] = {}
    async for name, tensor in items:
        hf = name.removeprefix(PREFIX)
        module, _, leaf = hf.rpartition(".")
        for part, key in ((".base_layer", "W"), (f".lora_A.{ADAPTER}", "A"), (f".lora_B.{ADAPTER}", "B")):
            if module.endswith(part):
                owner = module[: -len(part)]
                if leaf == "weight" and owner in scalings:
                    held.setdefault(owner, {})[key] = tensor
                    parts = held[owner]
                    if len(parts) == 3:
                        w, a, b = parts["W"], parts["A"], parts["B"]
                        delta = (b.float() @ a.float()) * scalings.pop(owner)
                        yield f"{owner}.weight", (w.float() + delta).to(w.dtype)
                        del held[owner]
                elif key == "W":
                    yield f"{owner}.{leaf}", tensor  # the base layer's bias
                break
        else:
            yield hf, tensor


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "adapter_config.json"))


def adapter_keys(saved: dict) -> dict:
    """peft's saved adapter names (``...q_proj.lora_A.weight``) as the model's state-dict names
    (``...q_proj.lora_A.default.weight``)."""
    out = {}
    for name, tensor in saved.items():
        for part in (".lora_A.", ".lora_B."):
            if part in name and f"{part}{ADAPTER}." not in name:
                name = name.replace(part, f"{part}{ADAPTER}.")
        out[name] = tensor
    return out
