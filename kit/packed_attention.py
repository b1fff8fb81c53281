"""Causal attention over packed sequences: several sequences concatenated into one row of tokens.

Each sequence attends only to its own earlier tokens. On CUDA in bfloat16 or float16 the
whole row is one flash-attention call (torch's ``varlen_attn``, which takes the sequence
bounds ``cu_seqlens``); elsewhere it is one SDPA call per sequence, the same arithmetic.
The megatron backend's core attention (``thd`` input) and the fsdp backend's packed
micro-batches both attend through :func:`packed_causal_attention`.

A segment's keys may also run longer than its queries (``key_cu_seqlens``): its queries are then
the last tokens of its keys, and query ``i`` of ``n`` sees keys ``0 .. m - n + i`` of ``m``
(causal, aligned to the bottom right, as flash attention aligns it). Prompt sharing uses this: a
response's keys are its prompt's keys, computed once for the group, followed by its own.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

__all__ = ["packed_causal_attention", "varlen_kernel", "varlen_supported"]


def _varlen_signature():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return inspect.signature(varlen_attn).parameters


_VARLEN_PARAMETERS = _varlen_signature()
_VARLEN_GQA = _VARLEN_PARAMETERS is not None and "enable_gqa" in _VARLEN_PARAMETERS


def varlen_supported(device, dtype) -> bool:
    """True when :func:`packed_causal_attention` attends in one ``varlen_attn`` call on ``device`` in
    ``dtype`` (CUDA, bfloat16 or float16, a torch that has ``torch.nn.attention.varlen``)."""
    return _VARLEN_PARAMETERS is not None and torch.device(device).type == "cuda" and dtype in (torch.bfloat16,
                                                                                                torch.float16)


def varlen_kernel(query) -> bool:
    """:func:`varlen_supported` for ``query``'s device and dtype."""
    return varlen_supported(query.device, query.dtype)


def packed_causal_attention(query, key, value, cu_seqlens, max_length: int, scale: float, bounds=None, *,
                            key_index=None, key_cu_seqlens=None, key_max_length: int | None = None, key_bounds=None):
    """Causal grouped-query attention of packed sequences.

    :param query: ``[T, heads, d]``, the sequences' tokens one after another, RoPE applied.
    :param key: and :param value: ``[T, groups, d]`` (``heads`` a multiple of ``groups``), not repeated per head.
    :param cu_seqlens: int32 ``[n + 1]`` on ``query``'s device: ``0``, then each sequence's end.
    :param max_length: the longest sequence's length.
    :param scale: the softmax scale (usually ``d ** -0.5``).
    :param bounds: ``cu_seqlens`` as a list of ints, when the caller has it (saves a device read
        on the per-sequence path).
    :param key_index: int64 ``[K]``, or None: the rows of ``key`` and ``value`` each segment attends to, one segment
        after another, when keys run longer than queries (the module docstring: a segment's queries are its last
        keys); None: each segment attends to its own tokens.
    :param key_cu_seqlens: int32 ``[n + 1]``, each segment's end in ``key_index`` (with ``key_index``).
    :param key_max_length: the longest key segment; :param key_bounds: ``key_cu_seqlens`` as host ints.
    :returns: ``[T, heads, d]`` in the query's dtype.
    :raises ValueError: a key segment shorter than its query segment (checked on the per-sequence path; the flash
        call is not given such bounds by the callers, whose key segments hold their query segments).
    """
    if key_index is None:
        key_cu_seqlens, key_max_length, key_bounds = cu_seqlens, max_length, bounds
    else:
        key, value = key.index_select(0, key_index), value.index_select(0, key_index)
    tokens, heads, _ = query.shape
    if varlen_kernel(query):
        from torch.nn.attention.varlen import varlen_attn

        extra = {}
        grouped = key.shape[1] != heads
        # torch 2.11's varlen_attn (window_size, no enable_gqa yet) hands fewer key/value heads to its flash
        # kernel as they are (checked on an H200); torch 2.10's form (is_causal) is not known to: copies
        takes_grouped = _VARLEN_GQA or "window_size" in _VARLEN_PARAMETERS
        if grouped and (torch.compiler.is_compiling() or not takes_grouped):
            # traced into a compiled layer, the repeat fuses into the kernel that writes the keys
            # and values; at the Qwen2.5-0.5B shape on an H200 this trained 3 % faster than grouped heads
            key, value = (x.repeat_interleave(heads // key.shape[1], dim=1) for x in (key, value))
        elif grouped and _VARLEN_GQA:
            extra["enable_gqa"] = True
        # else the flash kernel takes the grouped key/value heads as they are: eagerly, 3-4 % faster
        # than repeated copies at that shape
        if "window_size" in _VARLEN_PARAMETERS:  # torch 2.11: causal is a window of every earlier key
            extra["window_size"] = (-1, 0)
        else:  # torch 2.10
            extra["is_causal"] = True
        return varlen_attn(query, key, value, cu_seqlens, key_cu_seqlens, int(max_length), int(key_max_length),
                           scale=scale, **extra)
    bounds = cu_seqlens.tolist() if bounds is None else bounds
    key_bounds = key_cu_seqlens.tolist() if key_bounds is None else key_bounds
    parts = []
    for a, b, ka, kb in zip(bounds[:-1], bounds[1:], key_bounds[:-1], key_bounds[1:]):
        if kb - ka < b - a:
            raise ValueError(f"packed attention: a segment of {b - a} queries has {kb - ka} keys (needs at least as many)")
        if b > a:
            q = query[a:b].transpose(0, 1).unsqueeze(0)  # [1, h, n, d]
            k, v = (x[ka:kb].transpose(0, 1).unsqueeze(0) for x in (key, value))  # [1, groups, m, d]
            # is_causal aligns to the top left; the queries are the last keys, so the mask is shifted by m - n
            mask = None if kb - ka == b - a else torch.ones(b - a, kb - ka, dtype=torch.bool,
                                                            device=query.device).tril(kb - ka - (b - a))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                 enable_gqa=k.shape[1] != heads)
            parts.append(out[0].transpose(0, 1))
    return torch.cat(parts, dim=0) if parts else query.new_zeros(0, heads, query.shape[2])

