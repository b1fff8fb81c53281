"""One matrix product for a layer's query/key/value projections and one for its gate/up projections.

At decode time a small model's projections are matrix products of a few hundred rows, each a
separate kernel: in a profile of the 0.5B shape at 256 rows (one H100) the key and value
projections (128 outputs each) took 3.6 us apiece and the gate and up projections 7.3 us each,
mostly fixed cost. :func:`fuse_projections` stacks the weights of each group into one buffer of the
attention (or MLP) module and makes the separate ``nn.Linear`` weights views of it, so

* the forward pass runs one product per group and splits its output (the module's ``forward`` is
  replaced on the instance by :func:`_fused_attention_forward` / :func:`_fused_mlp_forward`, which
  compute what the transformers classes in :data:`ATTENTIONS` and :data:`MLPS` compute);
* the model's ``state_dict`` names and shapes do not change, and a weight copied into
  ``...q_proj.weight`` lands in the fused buffer (the views share its memory): weight updates by
  name need nothing new;
* no memory is kept beyond the model's: each group's separate weights are freed once the views
  replace them (while one group is fused, its weights exist twice, one group at a time).

The fused attention forward is the engine's: a call with a key/value cache (transformers'
``generate``, a plain ``model(ids)`` with ``use_cache`` on), in training, or with eager attention
runs the class forward instead, on the same weights (the views), so only the MLP product is fused
there; results are the same either way.

A ``module.to()`` that moves or casts the model gives every parameter storage of its own (views are
not kept), so the engine calls :func:`unfuse_projections` before moving the model and
:func:`fuse_projections` after; the engine's move is the only place that moves or casts its model.
Only plain ``nn.Linear`` projections of the listed transformers classes are fused (not FP8 layers,
not LoRA wrappers, not experts, not remote-code classes that share a name).
"""

from __future__ import annotations

import sys
import types

__all__ = ["ATTENTIONS", "MLPS", "fuse_projections", "unfuse_projections"]

WEIGHT, BIAS = "_furlong_fused_weight", "_furlong_fused_bias"

ATTENTIONS = {"LlamaAttention": None, "Qwen2Attention": "module", "Qwen3Attention": "module",
              "MistralAttention": "config"}
"""Attention classes whose forward :func:`_fused_attention_forward` reproduces, and where each reads the
``sliding_window`` it passes to the attention function (None: it passes none)."""

MLPS = {"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"}
"""MLP classes computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""


def fuse_projections(model) -> int:
    """Fuse the projections of every listed attention and MLP module of ``model`` in place.

    :returns: the number of modules fused (0 for a model with none of the listed classes).
    """
    count = 0
    for module in model.modules():
        kind = type(module).__name__
        if not type(module).__module__.startswith("transformers.models."):  # (remote code may reuse a name)
            continue
        if kind in ATTENTIONS:
            names, forward = ("q_proj", "k_proj", "v_proj"), _fused_attention_forward
        elif kind in MLPS:
            names, forward = ("gate_proj", "up_proj"), _fused_mlp_forward
        else:
            continue
        if _fuse(module, names):
            module.forward = types.MethodType(forward, module)
            count += 1
    return count


def unfuse_projections(model) -> None:
    """Undo :func:`fuse_projections`: the class forward again and no fused buffer (the separate weights stay
    views of its memory until they are moved or replaced)."""
    for module in model.modules():
        if WEIGHT in module._buffers:
            del module._buffers[WEIGHT]
            module._buffers.pop(BIAS, None)
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_furlong_sizes", None)


def _fuse(module, names: tuple[str, ...]) -> bool:
    import torch

    linears = [getattr(module, name, None) for name in names]
    if not all(type(linear) is torch.nn.Linear for linear in linears):
        return False
    with_bias = {linear.bias is not None for linear in linears}
    if len(with_bias) != 1 or len({(l.weight.dtype, l.weight.device, l.in_features) for l in linears}) != 1:
        return False
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        bias = torch.cat([linear.bias for linear in linears]) if with_bias == {True} else None
        module.register_buffer(WEIGHT, weight, persistent=False)
        module.register_buffer(BIAS, bias, persistent=False)
        start = 0
        for linear in linears:
            rows = slice(start, start + linear.out_features)
            linear.weight.data = weight[rows]
            if bias is not None:
                linear.bias.data = bias[rows]
            start += linear.out_features
    module._furlong_sizes = [linear.out_features for linear in linears]
    return True


def _fused_mlp_forward(self, x):
    import torch

    gate, up = torch.nn.functional.linear(x, getattr(self, WEIGHT), getattr(self, BIAS)).split(self._furlong_sizes,
                                                                                                 dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def _fused_attention_forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
    import torch

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if (self.training or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
            or self.config._attn_implementation not in ALL_ATTENTION_FUNCTIONS):  # (eager, a key/value cache)
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    fused = torch.nn.functional.linear(hidden_states, getattr(self, WEIGHT), getattr(self, BIAS))
    query, key, value = (x.view(hidden_shape) for x in fused.split(self._furlong_sizes, dim=-1))
    if getattr(self, "q_norm", None) is not None:  # Qwen3: per-head norms before the rotary embedding
        query, key = self.q_norm(query), self.k_norm(key)
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    cos, sin = position_embeddings
    query, key = sys.modules[type(self).__module__].apply_rotary_pos_emb(query, key, cos, sin)
    window = ATTENTIONS[type(self).__name__]
    if window == "module":
        kwargs["sliding_window"] = self.sliding_window
    elif window == "config":
        kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)
    attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    out, weights = attention(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
