"""Context parallelism (``--context-parallel-size`` CP > 1): each sequence split over the CP group.

Layout (megatron-core's load-balanced one, which its ``RotaryEmbedding`` assumes: it keeps
the positions of chunks ``r`` and ``2 CP - 1 - r`` on CP rank ``r``,
``get_pos_emb_on_this_cp_rank``): a micro-batch's right-padded ``[B, L]`` ids are padded
to a multiple of ``2 CP`` positions and cut along the sequence into ``2 CP`` chunks of
``C = L / (2 CP)``; rank ``r`` computes chunks ``r`` and ``2 CP - 1 - r`` (``[B, 2 C]``), so
every rank gets as much causal-attention work as the others. Attention gathers the keys
and values of the whole sequence (:func:`gather_sequence` with a summing backward, in
:mod:`.attention`); per-token log-probs and entropy are gathered back into sequence order
(:func:`gather_sequence` with ``replicated_loss=True``), so the objective sees the
``[B, L]`` values one rank would compute. A packed (``thd``) micro-batch is split the same
way sequence by sequence: each sequence is padded to a multiple of ``2 CP`` and rank ``r``
holds chunks ``r`` and ``2 CP - 1 - r`` of every one, one after another (megatron-core's
``thd`` RoPE, ``_get_thd_freqs_on_this_cp_rank``, assumes this too).

Gradients: every CP rank computes the same loss from the gathered values, and each
back-propagates only its own tokens' share of it; the backend then sums gradients over
the data-parallel x context-parallel group (megatron-core's
``get_data_parallel_group(with_context_parallel=True)``), which counts every token once.
"""

from __future__ import annotations

import torch

__all__ = ["chunk_bounds", "context_parallel", "gather_sequence", "local_chunks", "padded_length"]


def context_parallel() -> tuple[int, int, object]:
    """``(size, rank, group)`` of this rank's context-parallel group (megatron-core
    ``parallel_state``); ``(1, 0, None)`` when its groups are not initialised."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0, None
    size = parallel_state.get_context_parallel_world_size()
    if size <= 1:
        return 1, 0, None
    return size, parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_group()


def padded_length(length: int, cp: int) -> int:
    """``length`` rounded up to a multiple of ``2 cp`` (positions per sequence under CP)."""
    step = 2 * cp
    return -(-length // step) * step


def chunk_bounds(length: int, cp: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(start, end)`` positions of the two chunks CP rank ``rank`` holds of a sequence of ``length``
    positions (a multiple of ``2 cp``): chunks ``rank`` and ``2 cp - 1 - rank``."""
    size = length // (2 * cp)
    late = 2 * cp - 1 - rank
    return (rank * size, (rank + 1) * size), (late * size, (late + 1) * size)


def local_chunks(x, cp: int, rank: int, dim: int = 1, lengths: list[int] | None = None):
    """This rank's two chunks of each sequence of ``x`` along ``dim``, concatenated: ``[..., 2 C, ...]``
    from ``[..., L, ...]``.

    :param lengths: the lengths of the sequences laid one after another along ``dim`` (packed),
        each a multiple of ``2 cp``; None: one sequence, the whole of ``dim``.
    """
    pieces, start = [], 0
    for length in lengths or [x.shape[dim]]:
        for a, b in chunk_bounds(length, cp, rank):
            pieces.append(x.narrow(dim, start + a, b - a))
        start += length
    return torch.cat(pieces, dim=dim)


def _in_sequence_order(parts: list, dim: int, lengths: list[int] | None):
    """The whole sequences from every rank's :func:`local_chunks` (rank order) along ``dim``."""
    cp = len(parts)
    pieces, start = [], 0
    for length in lengths or [parts[0].shape[dim] * cp]:
        size = length // (2 * cp)
        chunks = [None] * (2 * cp)
        for rank, part in enumerate(parts):
            chunks[rank] = part.narrow(dim, start, size)
            chunks[2 * cp - 1 - rank] = part.narrow(dim, start + size, size)
        pieces += chunks
        start += 2 * size
    return torch.cat(pieces, dim=dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather of every rank's chunks into sequence order. Backward: this rank's slice of the
    gradient (``replicated``, see :func:`gather_sequence`), else the sum of every rank's gradient
    for this rank's chunks (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, dim: int, group, replicated: bool, lengths):
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.dim, ctx.group, ctx.replicated, ctx.lengths = dim, group, replicated, lengths
        ctx.rank, ctx.cp = dist.get_rank(group), len(parts)
        return _in_sequence_order(parts, dim, lengths)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        if ctx.replicated:
            return local_chunks(grad, ctx.cp, ctx.rank, ctx.dim, ctx.lengths), None, None, None, None
        parts = [local_chunks(grad, ctx.cp, r, ctx.dim, ctx.lengths).contiguous() for r in range(ctx.cp)]
        mine = torch.empty_like(parts[ctx.rank])
        dist.reduce_scatter(mine, parts, group=ctx.group)
        return mine, None, None, None, None


def gather_sequence(x, dim: int, *, replicated_loss: bool, lengths: list[int] | None = None):
    """The whole sequences along ``dim`` from every CP rank's :func:`local_chunks` of them (a collective
    over the CP group; ``x`` itself when CP is 1).

    :param x: this rank's ``[..., 2 C, ...]``.
    :param lengths: whole lengths of packed sequences along ``dim`` (:func:`local_chunks`).
    :param replicated_loss: True when every CP rank computes the same loss from the result and
        back-propagates it only into its own chunks (per-token log-probs): the backward keeps this
        rank's slice of the gradient. False when each rank back-propagates a different part of the
        loss through the whole result (keys and values, which every rank's own queries attend to):
        the backward sums the gradients of all ranks for this rank's chunks (a reduce-scatter).
    :returns: ``[..., 2 C x CP, ...]`` in sequence order.
    """
    cp, _, group = context_parallel()
    if cp == 1:
        return x
    return _GatherSequence.apply(x, dim, group, replicated_loss, lengths)
