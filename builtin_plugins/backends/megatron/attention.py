"""A core attention for megatron-core's local layer spec built on ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's own local ``DotProductAttention`` materialises the ``[b*heads, s, s]``
score matrix and refuses packed (``thd``) sequences. This module takes its place in
``SelfAttentionSubmodules.core_attention`` (MEGATRON.md 7): it has no parameters, so
state dicts and ``torch_dist`` checkpoints are those of the stock local spec.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

__all__ = ["SDPACoreAttention"]


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

        :param query: ``[s, b, heads, d]`` (``[t, heads, d]`` packed), RoPE applied.
        :param key: ``[s, b, groups, d]`` (``[t, groups, d]`` packed), not repeated per head.
        :param value: like ``key``.
        :param attention_mask: must be None (causal); a mask raises ``ValueError``.
        :param packed_seq_params: ``PackedSeqParams`` with ``cu_seqlens_q`` for ``thd``
            input: each sequence attends only to itself.
        :returns: ``[s, b, heads*d]`` (``[t, heads*d]`` packed), the query's dtype.
        """
        if attention_mask is not None:
            raise ValueError("SDPACoreAttention is causal only; call the model with attention_mask=None.")
        if packed_seq_params is not None:
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            parts = [self._causal(query[a:b].unsqueeze(1), key[a:b].unsqueeze(1), value[a:b].unsqueeze(1))
                     for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
            return torch.cat(parts, dim=0).squeeze(1) if parts else query.new_zeros(0, query.shape[1] * query.shape[2])
        return self._causal(query, key, value)

    def _causal(self, query, key, value):
        s, b, heads, d = query.shape
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=k.shape[1] != heads)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)
