"""Softmax statistics of logit row chunks: each token's log-prob, its entropy, and their gradient.

Train backends compute ``logp_t = z_t[target] - log sum_v exp z_t[v]`` and
``H_t = log sum exp z_t - sum_v p_v z_t[v]`` (``z = logits / tau``, ``tau`` the rollout
temperature) a chunk of rows at a time, so the float32 ``[tokens, V]`` softmax never
exists. A chunk may be one slice of the vocabulary (tensor parallelism: ``start`` is its
first column, and the caller combines the per-slice maxima and sums across ranks). The
gradient needs no softmax kept from the forward pass:
``d logp_t / d z_v = 1[v = target] - p_v`` and ``d H_t / d z_v = -p_v (log p_v + H_t)``.

On CUDA :func:`fused` compiles each function (``torch.compile``, the rows dynamic) into
kernels that read the chunk once per pass instead of writing float32 intermediates; the
arithmetic is the same on every device.
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK_ELEMENTS", "PAD_LOGIT", "chunk_grad", "chunk_max", "chunk_sums", "fused", "incoming_grads",
           "local_targets", "row_stats", "rows_per_chunk", "scaled"]

CHUNK_ELEMENTS = 1 << 28
"""Default logits per row chunk (1 GiB of float32)."""

PAD_LOGIT = -1e30
"""What padded vocabulary columns become: ``exp`` gives 0 and ``0 * -1e30`` stays finite."""


def scaled(chunk, start: int, vocab_size: int, inv_temperature: float):
    """Float32 ``z = chunk / tau`` ``[rows, width]`` (a new tensor), columns at or past ``vocab_size``
    (``start`` is the chunk's first column in the whole vocabulary) at :data:`PAD_LOGIT`."""
    z = chunk.float() * inv_temperature
    columns = torch.arange(z.shape[-1], device=z.device) + start
    return torch.where(columns < vocab_size, z, PAD_LOGIT)


def chunk_max(chunk, start: int, vocab_size: int, inv_temperature: float):
    """Row maxima of ``z`` (:func:`scaled`): float32 ``[rows]``."""
    return scaled(chunk, start, vocab_size, inv_temperature).amax(dim=-1)


def chunk_sums(chunk, top, local, mine, start: int, vocab_size: int, inv_temperature: float):
    """Float32 ``[3, rows]``: ``sum exp(z - top)``, ``z[target] - top`` (0 where ``mine`` is False:
    the target lies in another slice) and ``sum exp(z - top) (z - top)``.

    :param top: float32 ``[rows]``, the maxima of ``z`` over the whole vocabulary.
    :param local: int64 ``[rows]``, each target's column in this chunk (:func:`local_targets`).
    :param mine: bool ``[rows]``, whether this chunk holds the target.
    """
    z = scaled(chunk, start, vocab_size, inv_temperature) - top.unsqueeze(-1)
    exp = z.exp()
    picked = torch.where(mine, z.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
    return torch.stack([exp.sum(dim=-1), picked, (exp * z).sum(dim=-1)])


def chunk_grad(chunk, log_norm, entropy, grad_log_probs, grad_entropy, local, mine, start: int, vocab_size: int,
               inv_temperature: float):
    """``d loss / d chunk`` in the chunk's dtype ``[rows, width]``:
    ``((1[v = target] - p_v) g_logp - p_v (log p_v + H) g_H) / tau``.

    :param log_norm: float32 ``[rows]``, ``log sum exp z`` over the whole vocabulary.
    :param entropy: float32 ``[rows]``, ``H``.
    :param grad_log_probs: and :param grad_entropy: float32 ``[rows]``, the incoming gradients.
    """
    log_p = scaled(chunk, start, vocab_size, inv_temperature) - log_norm.unsqueeze(-1)
    p = log_p.exp()
    out = -p * (grad_log_probs.unsqueeze(-1) + (log_p + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1))
    columns = torch.arange(chunk.shape[-1], device=chunk.device)
    hit = (columns == local.unsqueeze(-1)) & mine.unsqueeze(-1)
    out = out + torch.where(hit, grad_log_probs.unsqueeze(-1), 0.0)
    return (out * inv_temperature).to(chunk.dtype)


def row_stats(chunk, local, mine, start: int, vocab_size: int, inv_temperature: float, reduce_max=None,
              reduce_sum=None):
    """``(log_norm, log_probs, entropy)`` of a chunk's rows, float32 ``[rows]`` each, from
    :func:`chunk_max` and :func:`chunk_sums` (run through :func:`fused`).

    :param reduce_max: and :param reduce_sum: called in place on this slice's maxima and on its
        ``[3, rows]`` sums when the vocabulary is split over ranks (tensor parallelism: an
        all-reduce MAX, then SUM, over the group); None for the whole vocabulary.
    """
    top = fused(chunk_max, chunk.device)(chunk, start, vocab_size, inv_temperature)
    if reduce_max is not None:
        reduce_max(top)
    stats = fused(chunk_sums, chunk.device)(chunk, top, local, mine, start, vocab_size, inv_temperature)
    if reduce_sum is not None:
        reduce_sum(stats)
    total, picked, weighted = stats
    log_total = total.log()
    return top + log_total, picked - log_total, log_total - weighted / total


def incoming_grads(grad_log_probs, grad_entropy, like):
    """The two incoming gradients of a log-prob Function's backward, zeros (like ``like``) for None."""
    zeros = torch.zeros_like(like)
    return (zeros if grad_log_probs is None else grad_log_probs), (zeros if grad_entropy is None else grad_entropy)


_compiled: dict = {}


def fused(fn, device):
    """``fn`` compiled with ``torch.compile`` on CUDA, else ``fn`` itself.

    Only the first dimension of each tensor argument (the rows, which change from call to call)
    is compiled as dynamic; the others (the vocabulary width, the head size) stay fixed, so the
    kernels index with constant strides. With every dimension dynamic the log-prob kernels ran
    at about 60 % of this speed on an H200 (docs/benchmarks.md).
    """
    if device.type != "cuda":
        return fn
    if fn not in _compiled:
        compiled = torch.compile(fn)

        def call(*args):
            for arg in args:
                if isinstance(arg, torch.Tensor) and arg.dim():
                    torch._dynamo.maybe_mark_dynamic(arg, 0)
            return compiled(*args)

        _compiled[fn] = call
    return _compiled[fn]


def local_targets(targets, start: int, width: int):
    """``(local, mine)``: each target's column in the slice ``start .. start + width`` (clamped into
    it) and whether the slice holds it; int64 and bool ``[rows]``."""
    local = targets.long() - start
    mine = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), mine


def rows_per_chunk(chunk_rows: int, width: int) -> int:
    """``chunk_rows`` when > 0, else as many rows of ``width`` columns as :data:`CHUNK_ELEMENTS` allows."""
    return chunk_rows if chunk_rows > 0 else max(1, CHUNK_ELEMENTS // max(width, 1))
