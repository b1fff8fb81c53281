"""Where a Hugging Face-named tensor of a weight update goes in the embedded engine's model.

A name of the model's ``state_dict`` goes to that tensor. A mixture-of-experts model's
experts are fused in memory (transformers 5: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
the gate rows first, and ``mlp.experts.down_proj`` ``[E, H, I]``), while checkpoints on disk
(and trainers that convert to them, such as Megatron's) name one matrix per expert:
``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj`` ``[I, H]``, ``down_proj`` ``[H, I]``
(transformers' ``conversion_mapping.py``, the ``qwen2_moe`` converters, stacks the experts and
concatenates gate and up in that order). Such a name goes to its slice of the fused tensor, so
a weight update writes in place and captured CUDA graphs stay valid.
"""

from __future__ import annotations

import re
from typing import Any

from furlong.kit.moe import is_experts_module

__all__ = ["target_of"]

PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def target_of(model, state: dict[str, Any], name: str) -> Any:
    """The tensor (a view into the model's parameters) that ``name`` is copied into, or None when the
    model has nothing of that name.

    :param state: ``model.state_dict()`` (tensors sharing the parameters' storage).
    """
    if name in state:
        return state[name]
    match = PER_EXPERT.match(name)
    if match is None:
        return None
    experts, expert, proj = match["experts"], int(match["expert"]), match["proj"]
    try:
        module = model.get_submodule(experts)
    except AttributeError:
        return None
    fused = state.get(f"{experts}.down_proj" if proj == "down_proj" else f"{experts}.gate_up_proj")
    if (fused is None or not is_experts_module(module) or not getattr(module, "is_concatenated", True)
            or getattr(module, "is_transposed", False) or expert >= module.num_experts):
        return None
    if proj == "down_proj":
        return fused[expert]
    half = fused.shape[1] // 2
    return fused[expert, :half] if proj == "gate_proj" else fused[expert, half:]
