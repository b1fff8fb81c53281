"""Packed micro-batches for Hugging Face models: the sequences concatenated into one row, no padding.

A packed micro-batch is ``input_ids [1, sum L_i]`` with ``position_ids`` restarting at 0 for
each sequence (RoPE sees each sequence's own positions) and a :class:`PackedSpans` in the
``packed_spans`` keyword, which transformers passes down to every attention layer. The
model runs with transformers' attention interface set to ``furlong_packed``
(:func:`packed_attention`): with ``packed_spans`` each sequence attends only to itself
(:func:`furlong.kit.packed_attention.packed_causal_attention`, one flash call on CUDA);
without it the function is transformers' ``sdpa`` attention, and the model works as before.

With prompt sharing (:func:`pack_shared`) the row holds each distinct prompt once, followed by the
suffixes of the samples that share it; a suffix attends to its prompt's keys and then its own
(``PackedSpans.key_index``), at the positions it has in its whole sequence, so its outputs are
those of the unshared row up to float rounding.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from furlong.kit.shared_rows import length_bound
from furlong.kit.trainer import to_device

from .lora import base_model

__all__ = ["ATTENTION_NAME", "PackedSpans", "pack", "pack_shared", "packed_attention", "packing_off_reason", "packs",
           "use_packed_attention"]

ATTENTION_NAME = "furlong_packed"

_per_sequence = None
"""``packed_causal_attention`` kept out of torch.compile traces (its loop over host ints would be
specialised on); set by :func:`use_packed_attention`."""


@attrs.frozen
class PackedSpans:
    """Where each sequence of a packed row lies: ``cu_seqlens`` (int32 ``[n + 1]`` on the model's
    device: 0, then each sequence's end), the same ``bounds`` as host ints, and ``max_length``, a
    bound on the longest sequence's length.

    With prompt sharing, each segment attends to keys gathered from the row: ``key_index`` (int64
    ``[K]``, row positions, each segment's keys one after another), ``key_cu_seqlens`` and
    ``key_bounds`` (their ends, as ``cu_seqlens`` and ``bounds``) and ``key_max_length``; a segment's
    queries are its last keys. None: each segment attends to itself."""

    cu_seqlens: Any
    bounds: list
    max_length: int
    key_index: Any = None
    key_cu_seqlens: Any = None
    key_bounds: list | None = None
    key_max_length: int | None = None


def pack(seqs: Sequence[Any], device) -> tuple[Any, Any, PackedSpans]:
    """``(input_ids [1, T], position_ids [1, T], spans)`` of the 1-D int64 sequences ``seqs`` one after another."""
    import torch

    bounds = [0]
    for s in seqs:
        bounds.append(bounds[-1] + len(s))
    ids = torch.cat(list(seqs)).unsqueeze(0)
    positions = torch.cat([torch.arange(len(s)) for s in seqs]).unsqueeze(0)
    spans = PackedSpans(cu_seqlens=_cu_seqlens(bounds, device), bounds=bounds, max_length=length_bound(bounds))
    return to_device(ids, device), to_device(positions, device), spans


def pack_shared(groups, device) -> tuple[Any, Any, PackedSpans, list[int]]:
    """The row of a micro-batch with shared prompts (:func:`furlong.kit.shared_rows.shared_row`) of ``groups``, a
    :class:`furlong.kit.shared_rows.PrefixGroups`.

    :returns: ``(input_ids [1, T], position_ids [1, T], spans, starts)``: ``starts[i]`` is where sample
        ``i``'s suffix begins in the row (its last prompt token, which predicts its first response token).
    """
    from furlong.kit.shared_rows import shared_row

    row = shared_row(groups)
    spans = PackedSpans(cu_seqlens=_cu_seqlens(row.bounds, device), bounds=row.bounds,
                        max_length=length_bound(row.bounds), key_index=to_device(row.key_index, device),
                        key_cu_seqlens=_cu_seqlens(row.key_bounds, device), key_bounds=row.key_bounds,
                        key_max_length=length_bound(row.key_bounds))
    return (to_device(row.ids.unsqueeze(0), device), to_device(row.positions.unsqueeze(0), device), spans,
            row.starts)


def _cu_seqlens(bounds: list[int], device):
    import torch

    return to_device(torch.tensor(bounds, dtype=torch.int32), device)


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function over a packed row (``packed_spans`` keyword), else ``sdpa``.

    :param query: ``[1, H, T, D]``; :param key: and :param value: ``[1, H_kv, T, D]`` (rotary applied).
    :returns: ``(output [1, T, H, D], None)``, as transformers' attention functions do.
    :raises ValueError: a packed row with an attention mask, or with dropout.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from furlong.kit.packed_attention import packed_causal_attention, varlen_kernel

    spans: PackedSpans | None = kwargs.get("packed_spans")
    if spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if attention_mask is not None or (dropout and module.training):
        raise ValueError("packed attention takes no attention mask and no attention dropout")
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [T, heads, D]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # prompt sharing (key_index set): each suffix's keys are its prompt's, then its own
    keys = {"key_index": spans.key_index, "key_cu_seqlens": spans.key_cu_seqlens, "key_max_length": spans.key_max_length}
    if varlen_kernel(q):  # one kernel, traced into compiled decoder layers
        out = packed_causal_attention(q, k, v, spans.cu_seqlens, spans.max_length, scale, **keys)
    else:  # a loop over host ints, which torch.compile would specialise on
        out = _per_sequence(q, k, v, spans.cu_seqlens, spans.max_length, scale, bounds=spans.bounds,
                            key_bounds=spans.key_bounds, **keys)
    return out.unsqueeze(0), None


def _mask(**kwargs):
    """The mask for ``furlong_packed``: none for a causal pass over the whole input without a padding
    mask (a plain or a packed row, whose sequences the attention function separates); otherwise
    (a padding mask, a continuation past cached keys) the one ``sdpa`` would get."""
    from transformers.masking_utils import sdpa_mask

    whole = (kwargs.get("attention_mask") is None and kwargs.get("q_length") == kwargs.get("kv_length")
             and not kwargs.get("q_offset") and not kwargs.get("kv_offset"))
    return None if whole else sdpa_mask(**kwargs)


def packing_off_reason(model) -> str | None:
    """Why ``model`` cannot take packed micro-batches, or None: it must run transformers' ``sdpa``
    attention (or already ``furlong_packed``) with full attention in every layer and no attention
    dropout, under a transformers that has the attention-mask interface and per-layer caches."""
    import transformers
    from transformers import cache_utils, masking_utils

    from furlong.kit.hf import non_full_attention

    if not (hasattr(masking_utils, "AttentionMaskInterface") and hasattr(cache_utils, "DynamicLayer")):
        return f"transformers {transformers.__version__} has no attention-mask interface or per-layer cache"
    base = base_model(model)
    config = getattr(base, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ("sdpa", ATTENTION_NAME):
        return f"attention {attention!r} (packing runs on sdpa)"
    if non_full_attention(config):
        return "the model has sliding-window or other non-full attention layers"
    dropout = max(float(getattr(config, key, 0.0) or 0.0) for key in ("attention_dropout", "attn_pdrop"))
    if dropout > 0:
        return f"attention dropout {dropout:g} (packed attention has none)"
    return None


def use_packed_attention(model) -> str | None:
    """Register :func:`packed_attention` with transformers and switch ``model`` to it; returns None,
    or why it cannot (:func:`packing_off_reason`; the model is then left as it was)."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from furlong.kit.packed_attention import packed_causal_attention

    global _per_sequence
    reason = packing_off_reason(model)
    if reason is not None:
        return reason
    _per_sequence = torch.compiler.disable(packed_causal_attention)
    AttentionInterface.register(ATTENTION_NAME, packed_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _mask)
    base = base_model(model)
    try:
        base.set_attn_implementation(ATTENTION_NAME)
    except (AttributeError, ValueError):
        base.config._attn_implementation = ATTENTION_NAME
    if not packs(model):  # some models keep their attention (transformers only warns)
        return f"{type(base).__name__} kept attention {base.config._attn_implementation!r}"
    return None


def packs(model) -> bool:
    """True when ``model`` (a peft wrapper is looked through) runs :func:`packed_attention`."""
    base = base_model(model)
    return getattr(getattr(base, "config", None), "_attn_implementation", None) == ATTENTION_NAME
