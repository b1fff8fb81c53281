"""Mixture-of-experts layers of Hugging Face transformers models: where they are, and their routing record.

transformers 5 gives every MoE family (Qwen2/3-MoE, Mixtral, DeepSeek-V3, GLM-4-MoE, ...) an
experts module decorated with ``use_experts_implementation``: one module per MoE layer holding the
stacked expert weights, called as ``experts(hidden_states [N, H], top_k_index [N, k], top_k_weights
[N, k])`` after the router chose ``k`` experts per token. This module finds them; the routing
record of a sequence (:func:`encode_routed_experts`) is SGLang's ``meta_info.routed_experts``
(0.5.23, ``srt/managers/detokenizer_manager.py``): the int32 bytes of ``[rows, num_layers, topk]``
in base64, one row per fed token, every decoder layer (a dense layer's row is zeros).
"""

from __future__ import annotations

import base64
from typing import Any

import attrs

from .hf import decoder_layers

__all__ = ["RoutingLayout", "checkpoint_routing_layout", "decode_routed_experts", "encode_routed_experts",
           "experts_modules", "is_experts_module", "routing_layout"]


@attrs.frozen
class RoutingLayout:
    """The shape of a model's routing record.

    ``num_layers``: decoder layers; ``moe_layers``: the indices of those with an experts module,
    ascending; ``topk``: experts routed per token (``num_experts_per_tok``).
    """

    num_layers: int
    moe_layers: tuple[int, ...]
    topk: int


def is_experts_module(module: Any) -> bool:
    """True for an experts module of transformers' ``use_experts_implementation``: it holds the experts'
    stacked weights (``down_proj`` ``[E, ., .]``) and its class's forward dispatches on the experts
    implementation (the decorator wraps it)."""
    down = getattr(module, "down_proj", None)
    return (hasattr(module, "num_experts") and getattr(down, "ndim", 0) == 3
            and hasattr(type(module).forward, "__wrapped__"))


def experts_modules(model) -> list[tuple[int, Any]]:
    """``(decoder layer index, experts module)`` of every MoE layer of ``model``, in layer order."""
    found = []
    for index, layer in enumerate(decoder_layers(model)):
        found.extend((index, m) for m in layer.modules() if is_experts_module(m))
    return found


def routing_layout(model) -> RoutingLayout | None:
    """The routing layout of a loaded (or meta-device) model; None when it has no MoE layer."""
    found = experts_modules(model)
    if not found:
        return None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return RoutingLayout(num_layers=len(decoder_layers(model)), moe_layers=tuple(i for i, _ in found),
                         topk=int(config.num_experts_per_tok))


def checkpoint_routing_layout(path: str) -> RoutingLayout | None:
    """The routing layout of the model in the Hugging Face directory ``path``, read from its
    ``config.json`` (the model is built on the meta device: no weights are read or allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return routing_layout(model)


def encode_routed_experts(routed, layout: RoutingLayout) -> str:
    """SGLang's ``meta_info.routed_experts`` of one request.

    :param routed: int ``[rows, len(layout.moe_layers), topk]`` (numpy), the engine's record.
    :returns: base64 of the int32 bytes of ``[rows, layout.num_layers, topk]`` (dense layers zero).
    """
    import numpy as np

    full = np.zeros((len(routed), layout.num_layers, layout.topk), dtype=np.int32)
    full[:, list(layout.moe_layers)] = routed
    return base64.b64encode(full.tobytes()).decode("ascii")


def decode_routed_experts(text: str, rows: int, layout: RoutingLayout):
    """Undo :func:`encode_routed_experts`: int32 ``[rows, len(layout.moe_layers), topk]`` (numpy).

    :raises ValueError: the bytes are not ``rows * num_layers * topk`` int32 values.
    """
    import numpy as np

    flat = np.frombuffer(base64.b64decode(text), dtype=np.int32)
    if flat.size != rows * layout.num_layers * layout.topk:
        raise ValueError(f"routed_experts holds {flat.size} values, not rows {rows} x layers {layout.num_layers} "
                         f"x topk {layout.topk}")
    return flat.reshape(rows, layout.num_layers, layout.topk)[:, list(layout.moe_layers)].copy()
