"""Attention for megatron-core's local layer spec: SDPA / flash core attention and packed-sequence RoPE.

megatron-core's own local ``DotProductAttention`` materialises the ``[b*heads, s, s]``
score matrix and refuses packed (``thd``) sequences. :class:`SDPACoreAttention` takes its
place in ``SelfAttentionSubmodules.core_attention``. Without
TransformerEngine megatron-core applies RoPE to packed input one sequence at a time, with a
host read of the sequence bounds in every layer, and to any input in about ten element-wise
kernels per tensor; :class:`RopeSelfAttention` takes RoPE over: it gathers each token's
frequencies on the device (packed input: :func:`packed_positions`) and the core attention
rotates queries and keys with :func:`rotate` (one fused kernel per tensor on CUDA). Neither module
adds parameters of its own, so state dicts and ``torch_dist`` checkpoints are those of the stock
local spec.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule

from furlong.kit.packed_attention import packed_causal_attention
from furlong.kit.vocab_softmax import fused

from .context import chunk_bounds, context_parallel, gather_sequence

__all__ = ["RopeSelfAttention", "RotaryParams", "SDPACoreAttention", "angles_cos_sin", "packed_positions", "rotate"]


class SDPACoreAttention(MegatronModule):
    """Causal grouped-query attention through torch SDPA (flash / memory-efficient kernels on GPU).

    Built by megatron-core's ``Attention`` with keyword arguments (``config``,
    ``layer_number``, ``attn_mask_type``, ``attention_type``, ``softmax_scale``, ...); only
    ``config`` and ``softmax_scale`` matter here. Dropout is not supported (the backend
    sets ``attention_dropout=0``).
    """

    def __init__(self, config, layer_number=None, attn_mask_type=None, attention_type=None,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None, **_):
        super().__init__(config=config)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        """Causal attention of one layer.

        :param query: ``[s, b, heads, d]`` (packed: ``[t, 1, heads, d]``, or ``[t, heads, d]`` from
            megatron-core's own ``thd`` path).
        :param key: ``[s, b, groups, d]`` (packed ``[t, 1, groups, d]`` or ``[t, groups, d]``), not
            repeated per head.
        :param value: like ``key``.
        :param attention_mask: must be None (causal); a mask raises ``ValueError``.
        :param packed_seq_params: None, ``PackedSeqParams`` or :class:`RotaryParams`. Its
            ``rotary`` frequencies (from :class:`RopeSelfAttention`), when present, rotate query and key
            here (:func:`rotate`); otherwise they come rotated. Its ``cu_seqlens_q``, when set, mark
            packed input: each sequence attends only to itself (:func:`packed_causal_attention`: one
            ``varlen_attn`` flash call on CUDA in bfloat16/float16, else one SDPA call per sequence).
        :returns: ``[s, b, heads*d]`` (packed ``[t, 1, heads*d]``, or ``[t, heads*d]`` for 3-D input),
            the query's dtype.

        Under context parallelism (CP > 1) ``s`` (``t``) is this rank's two chunks of each
        sequence (:mod:`.context`; packed: ``cu_seqlens_q`` holds the whole sequences' bounds,
        each length a multiple of ``2 CP``) and keys/values are gathered over the CP group.
        """
        if attention_mask is not None:
            raise ValueError("SDPACoreAttention is causal only; call the model with attention_mask=None.")
        rotary = getattr(packed_seq_params, "rotary", None)
        if rotary is not None:
            interleaved = self.config.rotary_interleaved
            query, key = rotate(query, *rotary[0], interleaved), rotate(key, *rotary[1], interleaved)
        cp = self.config.context_parallel_size
        if packed_seq_params is None or packed_seq_params.cu_seqlens_q is None:
            if cp > 1:
                key, value = (gather_sequence(x, 0, replicated_loss=False) for x in (key, value))
                return self._chunks_against_whole(query, key, value, cp, context_parallel()[1])
            return self._causal(query, key, value)
        one_row = query.dim() == 4
        if one_row:
            query, key, value = (x.squeeze(1) for x in (query, key, value))
        if cp > 1:
            out = self._context_parallel_packed(query, key, value, packed_seq_params)
        else:
            tokens, heads, d = query.shape
            keys = {}
            key_index = getattr(packed_seq_params, "key_index", None)
            if key_index is not None:  # shared prompts: each suffix attends to its prompt's keys, then its own
                keys = {"key_index": key_index, "key_cu_seqlens": packed_seq_params.cu_seqlens_kv,
                        "key_max_length": int(packed_seq_params.max_seqlen_kv)}
            out = packed_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                          int(packed_seq_params.max_seqlen_q), self.scale,
                                          **keys).reshape(tokens, heads * d)
        return out.unsqueeze(1) if one_row else out

    def _context_parallel_packed(self, query, key, value, params):
        """Packed sequences under CP: keys and values of every whole sequence gathered over the CP
        group, then each sequence's two local query chunks against its own keys."""
        cp, rank, _ = context_parallel()
        bounds = params.cu_seqlens_q.tolist()
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        key, value = (gather_sequence(x, 0, replicated_loss=False, lengths=lengths) for x in (key, value))
        parts, local = [], 0
        for a, n in zip(bounds, lengths):
            if n:
                mine = slice(local, local + n // cp)
                parts.append(self._chunks_against_whole(query[mine].unsqueeze(1), key[a:a + n].unsqueeze(1),
                                                        value[a:a + n].unsqueeze(1), cp, rank).squeeze(1))
            local += n // cp
        return torch.cat(parts, dim=0) if parts else query.new_zeros(0, query.shape[1] * query.shape[2])

    def _chunks_against_whole(self, query, key, value, cp: int, rank: int):
        """Causal attention of this CP rank's two query chunks ``[2 C, b, heads, d]`` (:mod:`.context`)
        against the keys and values of the whole sequence ``[2 C x CP, b, groups, d]``.

        Query chunk ``j`` (positions ``j C .. (j + 1) C``) attends to keys ``0 .. (j + 1) C`` with
        the causal mask aligned to the lower right (query ``t`` sees keys up to ``j C + t``): one
        SDPA call per chunk. Key/value heads are repeated per query head under GQA (the
        lower-right causal bias of torch has no grouped-query path on every kernel).
        """
        from torch.nn.attention.bias import causal_lower_right

        s, b, heads, d = query.shape
        if key.shape[2] != heads:
            key, value = (x.repeat_interleave(heads // x.shape[2], dim=2) for x in (key, value))
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        outs = []
        for (start, end), local in zip(chunk_bounds(k.shape[2], cp, rank), (slice(0, s // 2), slice(s // 2, s))):
            outs.append(F.scaled_dot_product_attention(q[:, :, local], k[:, :, :end], v[:, :, :end],
                                                       attn_mask=causal_lower_right(end - start, end),
                                                       scale=self.scale))
        return torch.cat(outs, dim=2).permute(2, 0, 1, 3).reshape(s, b, heads * d)

    def _causal(self, query, key, value):
        s, b, heads, d = query.shape
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=k.shape[1] != heads)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


def packed_positions(cu_seqlens, tokens: int, cp: int = 1, rank: int = 0):
    """Each packed token's position in its own sequence, computed on ``cu_seqlens``' device (no host read).

    :param cu_seqlens: int32 ``[n + 1]``: 0, then the end of each whole sequence (under CP each
        length a multiple of ``2 cp``).
    :param tokens: this rank's packed tokens (``cu_seqlens[-1] / cp``).
    :param cp: and :param rank: the context-parallel size and rank; the rank holds chunks ``rank``
        and ``2 cp - 1 - rank`` of every sequence, one after another (:mod:`.context`).
    :returns: int64 ``[tokens]``.
    """
    local_bounds = cu_seqlens.long() // cp
    index = torch.arange(tokens, device=cu_seqlens.device)
    sequence = torch.searchsorted(local_bounds[1:], index, right=True)
    offset = index - local_bounds[sequence]
    if cp == 1:
        return offset
    chunk = (local_bounds[sequence + 1] - local_bounds[sequence]) // 2
    late = offset >= chunk
    return torch.where(late, offset - chunk + (2 * cp - 1 - rank) * chunk, offset + rank * chunk)


def _rotate(x, cos, sin):
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def _rotate_interleaved(x, cos, sin):
    turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos + turned * sin


def rotate(x, cos, sin, interleaved: bool = False):
    """RoPE, megatron-core's ``_apply_rotary_pos_emb_bshd`` without scaling of the amplitude:
    ``x cos f + rotate_half(x) sin f`` on the first ``cos.shape[-1]`` channels of each head (all of them
    unless RoPE is partial, ``rotary_percent`` < 1), the other channels unchanged. ``rotate_half`` pairs
    channel ``i`` with ``i + r/2`` (``r`` the rotated channels), or with ``interleaved`` channel ``2i`` with
    ``2i + 1`` (GPT-J style; the table then repeats each angle twice in a row, as megatron-core builds it
    with ``rotary_interleaved``). One fused kernel on CUDA (``torch.compile``), the same arithmetic elsewhere.

    :param x: ``[s, b, heads, d]`` queries or keys.
    :param cos: and :param sin: ``[s, 1, 1, r]`` (``r`` <= ``d``), the cosine and sine of each position's angles
        (``RotaryEmbedding``'s table rows), in ``x``'s dtype (:func:`angles_cos_sin`).
    :returns: ``x`` rotated, its shape and dtype.
    """
    turn = fused(_rotate_interleaved if interleaved else _rotate, x.device)
    rotated = cos.shape[-1]
    if rotated == x.shape[-1]:
        return turn(x, cos, sin)
    return torch.cat((turn(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)


def angles_cos_sin(angles, dtype) -> tuple:
    """``(cos, sin)`` of float32 RoPE angles ``[s, 1, 1, d]``, each ``[s, 1, 1, d]`` rounded to ``dtype``
    (as megatron-core rounds them)."""
    return angles.cos().to(dtype), angles.sin().to(dtype)


@dataclasses.dataclass
class RotaryParams(PackedSeqParams):
    """``PackedSeqParams`` that also carry each token's RoPE ``((cos, sin) of the query, (cos, sin) of
    the key)``, ``[s, 1, 1, d]`` in the activations' dtype (:func:`angles_cos_sin`), for
    :class:`SDPACoreAttention` to apply; ``cu_seqlens_q`` None for padded input.

    A packed row with shared prompts (:mod:`furlong.kit.shared_rows`) also carries ``positions`` (int64 ``[t]``,
    each token's position in its whole sequence, in place of :func:`packed_positions`) and ``key_index`` (int64
    ``[K]``, the row positions of each segment's keys, whose bounds are ``cu_seqlens_kv``)."""

    rotary: tuple | None = None
    positions: Any = None
    key_index: Any = None


class RopeSelfAttention(SelfAttention):
    """megatron-core's ``SelfAttention`` with RoPE left to :class:`SDPACoreAttention` (:func:`rotate`).

    It hands megatron-core no rotary table, and the core attention the cosine and sine of the
    table's rows for each token in :class:`RotaryParams`: the first ``s`` rows for padded input (this rank's, under
    CP), the rows of :func:`packed_positions` for packed (``thd``) input, whose micro-batch
    megatron-core then sees as one ``[t, 1]`` sequence (``qkv_format="sbhd"``) while the sequence
    bounds still reach the core attention. The same values as megatron-core's own RoPE (tested), partial
    (``rotary_percent``) and interleaved (``rotary_interleaved``) RoPE included. Layers without RoPE
    (``no_rope_freq``) stay megatron-core's.
    """

    def forward(self, hidden_states, *args, rotary_pos_emb=None, packed_seq_params=None, **kwargs):
        """megatron-core's ``SelfAttention.forward`` (same arguments and result: ``(output, bias)``,
        output ``[s, b, h]``) with ``rotary_pos_emb`` (float32 ``[max_s, 1, 1, d]`` or a ``(query, key)``
        pair) and ``packed_seq_params`` turned into :class:`RotaryParams`."""
        if rotary_pos_emb is not None and not getattr(self.config, "no_rope_freq", None):
            query_angles, key_angles = (rotary_pos_emb if isinstance(rotary_pos_emb, tuple)
                                        else (rotary_pos_emb, rotary_pos_emb))
            rows = hidden_states.shape[0]  # queries and keys: the whole sequence (gathered under sequence parallelism)
            if self.config.sequence_parallel:
                rows *= self.config.tensor_model_parallel_size
            fields = {}
            if packed_seq_params is not None:
                fields = {f.name: getattr(packed_seq_params, f.name) for f in dataclasses.fields(packed_seq_params)}
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                cp = self.config.context_parallel_size
                positions = getattr(packed_seq_params, "positions", None)
                if positions is None:
                    positions = packed_positions(packed_seq_params.cu_seqlens_q, rows, cp,
                                                 context_parallel()[1] if cp > 1 else 0)

                def mine(angles):
                    return angles.index_select(0, positions)
            else:
                def mine(angles):
                    return angles[:rows]
            query = angles_cos_sin(mine(query_angles), hidden_states.dtype)
            key = query if key_angles is query_angles else angles_cos_sin(mine(key_angles), hidden_states.dtype)
            fields.update(qkv_format="sbhd", rotary=(query, key))
            rotary_pos_emb, packed_seq_params = None, RotaryParams(**fields)
        return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb,
                               packed_seq_params=packed_seq_params, **kwargs)
