"""Per-token log-probs and entropy from vocab-parallel logits (docs/megatron.md).

Each tensor-parallel rank holds the logits of its vocabulary slice. The softmax pieces are
combined with all-reduces over the TP group: the row maximum, ``sum exp``, the target's
shifted logit (non-zero on its owner rank only) and ``sum exp * z``. Padded vocabulary
columns are left out of every sum.

The work is one autograd Function over row chunks, like megatron-core's fused
vocab-parallel cross-entropy: the float32 softmax of a chunk lives only while that chunk
is processed (forward and backward), so the full ``[tokens, vocab]`` float32 tensors are
never built and the gradient comes back in the logits' dtype. On CUDA each chunk's
passes are compiled into fused kernels (:mod:`furlong.kit.vocab_softmax`, shared with the
fsdp backend). Backward needs no communication: each rank computes the gradient of its own columns.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Sequence

import attrs
import torch
import torch.nn.functional as F

from furlong.kit import vocab_softmax as vs
from furlong.hooks.rows import SplitRows
from furlong.kit.shared_rows import PrefixGroups, length_bound, prefix_groups, shared_row
from furlong.kit.trainer import concatenated_ranges, right_padded, to_device

from .context import context_parallel, gather_sequence, local_chunks, padded_length

__all__ = ["MicroBatchInputs", "forward_log_probs", "micro_batch_inputs", "model_extra", "projecting_rows",
           "response_log_probs", "sequence_parallel_size", "shared_prompt_inputs", "vocab_parallel_log_probs"]


def _tp():
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_group())


def _all_reduce(tensor, op, tp: int, group) -> None:
    if tp > 1:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=op, group=group)


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, inv_temperature: float, vocab_size: int, chunk_rows: int):
        import torch.distributed as dist

        tp, tp_rank, group = _tp()
        rows, width = logits.shape
        start = tp_rank * width
        log_norm = torch.empty(rows, dtype=torch.float32, device=logits.device)
        log_probs = torch.empty_like(log_norm)
        entropy = torch.empty_like(log_norm)
        local, mine = vs.local_targets(targets, start, width)
        step = vs.rows_per_chunk(chunk_rows, width)
        for a in range(0, rows, step):
            b = min(rows, a + step)
            log_norm[a:b], log_probs[a:b], entropy[a:b] = vs.row_stats(
                logits[a:b], local[a:b], mine[a:b], start, vocab_size, inv_temperature,
                reduce_max=lambda t: _all_reduce(t, dist.ReduceOp.MAX, tp, group),
                reduce_sum=lambda t: _all_reduce(t, dist.ReduceOp.SUM, tp, group))
        ctx.save_for_backward(logits, targets, log_norm, entropy)
        ctx.inv_temperature, ctx.vocab_size, ctx.chunk_rows = inv_temperature, vocab_size, chunk_rows
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, targets, log_norm, entropy = ctx.saved_tensors
        _, tp_rank, _ = _tp()
        rows, width = logits.shape
        start = tp_rank * width
        grad = torch.empty_like(logits)
        grad_log_probs, grad_entropy = vs.incoming_grads(grad_log_probs, grad_entropy, log_norm)
        chunk_grad = vs.fused(vs.chunk_grad, logits.device)
        local, mine = vs.local_targets(targets, start, width)
        step = vs.rows_per_chunk(ctx.chunk_rows, width)
        for a in range(0, rows, step):
            b = min(rows, a + step)
            grad[a:b] = chunk_grad(logits[a:b], log_norm[a:b], entropy[a:b], grad_log_probs[a:b], grad_entropy[a:b],
                                   local[a:b], mine[a:b], start, ctx.vocab_size, ctx.inv_temperature)
        return grad, None, None, None, None


def vocab_parallel_log_probs(logits, targets, temperature: float, vocab_size: int, *, entropy_grad: bool = True,
                             chunk_rows: int = -1):
    """Log-prob of each target and the entropy of its distribution, from this rank's vocab slice.

    ``logp_t = z_t[target] - log sum_v exp z_t[v]`` and ``H_t = log sum exp z_t - sum_v p_v z_t[v]``
    with ``z = logits / tau`` (``tau`` the rollout temperature when > 0 and != 1), the same
    values as the fsdp backend's full-vocabulary ``log_softmax``.

    :param logits: ``[T, V/tp]`` (any float dtype): logits at the position before each target.
    :param targets: int64 ``[T]``, global vocabulary ids.
    :param vocab_size: the HF vocabulary size; columns at or above it (padding) are ignored.
    :param entropy_grad: False returns the entropy detached.
    :param chunk_rows: tokens per float32 softmax chunk (``--log-probs-chunk-size``); <= 0:
        as many as fit in 2**28 elements (1 GiB).
    :returns: ``(log_probs, entropy)``: float32 ``[T]`` each, equal on every TP rank.
    """
    inv = 1.0 / temperature if temperature > 0 and temperature != 1 else 1.0
    log_probs, entropy = _VocabParallelLogProbs.apply(logits, targets, inv, vocab_size, chunk_rows)
    return log_probs, entropy if entropy_grad else entropy.detach()


@attrs.frozen
class MicroBatchInputs:
    """What one GPTModel forward of a micro-batch needs, and where its responses lie.

    ``ids``: int64 input ids (``[B, L]`` right-padded, or ``[1, sum L_i]`` packed) on the
    device; ``extra``: more model keyword arguments (``packed_seq_params``).

    Without context or sequence parallelism only the positions that predict a response token reach the
    output layer (:func:`projecting_rows`): ``head_rows``, int64 ``[N]`` on the device, are their
    indices in the decoder's output ``[s, b, h]`` flattened to ``[s * b, h]``; ``targets`` ``[1, N]``
    holds the token each predicts; ``spans``: per sample ``(0, start, end)`` of its response in
    these N. Under context or sequence parallelism (``head_rows`` None) every position is projected:
    ``targets`` is the next token at each position of ``ids`` and ``spans`` give ``(row, start,
    end)`` in the whole ``[rows, positions]`` grid; ``ids`` and ``targets`` are this rank's two
    chunks ``[B, 2 L / (2 CP)]`` of the ``[B, L]`` grid (L padded to a multiple of ``2 CP``,
    :mod:`.context`; packed, each sequence is padded to a multiple of ``2 CP`` and ``segments``
    holds these lengths).

    ``padding``: bool, ``ids``' shape, True at pad positions (megatron-core's ``padding_mask``, which keeps
    pad tokens out of an MoE router's load-balancing loss; under sequence parallelism megatron-core gives each TP
    rank its share; this rank's chunks under context parallelism).
    """

    ids: Any
    targets: Any
    extra: dict
    spans: list
    segments: list | None = None
    head_rows: Any = None
    padding: Any = None


def micro_batch_inputs(tokens: Sequence[Any], response_lengths: Sequence[int], device, *, packed: bool = False,
                       sequence_parallel: int = 1, share_prompts: bool = False) -> MicroBatchInputs:
    """The model inputs of a micro-batch (see :func:`forward_log_probs` for the layouts).

    :param sequence_parallel: the TP size under sequence parallelism (else 1): the positions (each CP
        rank's share of them under CP) are padded to a multiple of it (packed: the last sequence's segment
        is lengthened; its pad tokens come after its real ones, which causal attention keeps them from
        reaching), and every position is projected.
    :param share_prompts: packed, without context or sequence parallelism: samples that share a prompt run it
        once (:func:`shared_prompt_inputs`).
    :raises ValueError: a response that starts at position 0 (no previous token).
    """
    seqs, ids = right_padded(tokens, response_lengths)
    cp, cp_rank, _ = context_parallel()
    if share_prompts and packed and cp == 1 and sequence_parallel == 1:
        groups = prefix_groups(seqs, response_lengths)
        if groups is not None:
            return shared_prompt_inputs(groups, response_lengths, device)
    extra: dict = {}
    segments = None
    # positions in all: a multiple of 2 CP (CP's chunks) whose share per CP rank is a multiple of TP (sequence parallel)
    multiple = math.lcm(2 * cp, cp * sequence_parallel) if cp > 1 else sequence_parallel
    if packed:
        from megatron.core.packed_seq_params import PackedSeqParams

        lengths = [len(s) for s in seqs]
        segments = [padded_length(n, cp) if cp > 1 else n for n in lengths]
        segments[-1] += -sum(segments) % multiple
        starts = [0]
        for n in segments:
            starts.append(starts[-1] + n)
        ids = torch.cat([F.pad(s, (0, n - len(s))) for s, n in zip(seqs, segments)]).unsqueeze(0)
        bounds = to_device(torch.tensor(starts, dtype=torch.int32), device)
        extra["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                                                     max_seqlen_q=max(segments), max_seqlen_kv=max(segments))
        spans = [(0, a + n - int(t) - 1, a + n - 1) for a, n, t in zip(starts, lengths, response_lengths)]
    else:
        ids = F.pad(ids, (0, -ids.shape[1] % multiple))
        spans = [(i, len(s) - int(t) - 1, len(s) - 1) for i, (s, t) in enumerate(zip(seqs, response_lengths))]
    real = [len(s) for s in seqs]
    if packed:
        padding = torch.ones_like(ids, dtype=torch.bool)
        for a, n in zip(starts, real):
            padding[0, a:a + n] = False
    else:
        padding = torch.arange(ids.shape[1]).unsqueeze(0) >= torch.tensor(real).unsqueeze(1)
    if cp > 1:
        padding = local_chunks(padding, cp, cp_rank, 1, segments)
    padding = to_device(padding, device)
    if cp == 1 and sequence_parallel == 1:
        return attrs.evolve(_response_rows(ids, spans, device, extra), padding=padding)
    ids = to_device(ids, device)
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]  # across a packed boundary the target is unused: no span ends there
    if cp > 1:
        ids, targets = (local_chunks(x, cp, cp_rank, 1, segments) for x in (ids, targets))
    return MicroBatchInputs(ids=ids, targets=targets, extra=extra, spans=spans, segments=segments if cp > 1 else None,
                            padding=padding)


def shared_prompt_inputs(groups: PrefixGroups, response_lengths: Sequence[int], device) -> MicroBatchInputs:
    """The packed (``thd``) inputs of a micro-batch whose samples share prompts: each prompt once, then the suffixes
    of its samples (:func:`furlong.kit.shared_rows.shared_row`). :class:`~.attention.RotaryParams` carry each
    token's position in its whole sequence and each segment's keys (``cu_seqlens_kv``: a suffix's keys are its
    prompt's, then its own), so every output is that of the unshared row up to float rounding."""
    from .attention import RotaryParams

    row = shared_row(groups)
    bounds, key_bounds = (to_device(torch.tensor(b, dtype=torch.int32), device) for b in (row.bounds, row.key_bounds))
    # max_seqlen_kv also sizes megatron-core's RoPE table: a key segment is a whole sequence, so it covers every position
    params = RotaryParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=key_bounds,
                          max_seqlen_q=length_bound(row.bounds), max_seqlen_kv=length_bound(row.key_bounds),
                          positions=to_device(row.positions, device), key_index=to_device(row.key_index, device))
    ids = row.ids.unsqueeze(0)
    spans = [(0, start, start + int(t)) for start, t in zip(row.starts, response_lengths)]
    padding = to_device(torch.zeros_like(ids, dtype=torch.bool), device)
    return attrs.evolve(_response_rows(ids, spans, device, {"packed_seq_params": params}), padding=padding)


def _response_rows(ids, spans: list, device, extra: dict) -> MicroBatchInputs:
    """The inputs with ``head_rows``: the positions ``p`` of each span ``(row, a, b)`` (predicting
    ``ids[row, p + 1]``), as indices ``p * B + row`` of the decoder's ``[L, B, h]`` output."""
    sizes = torch.tensor([b - a for _, a, b in spans], dtype=torch.long)
    rows = torch.repeat_interleave(torch.tensor([r for r, _, _ in spans], dtype=torch.long), sizes)
    firsts = torch.tensor([a for _, a, _ in spans], dtype=torch.long)
    positions = concatenated_ranges(firsts, sizes)
    targets = ids[rows, positions + 1].unsqueeze(0)
    head_rows = positions * ids.shape[0] + rows
    spans = [(0, int(a), int(a + n)) for a, n in zip(sizes.cumsum(0) - sizes, sizes)]
    ids, targets, head_rows = (to_device(x, device) for x in (ids, targets, head_rows))
    return MicroBatchInputs(ids=ids, targets=targets, extra=extra, spans=spans, head_rows=head_rows)


def model_extra(model, inputs: MicroBatchInputs) -> dict:
    """The keyword arguments of ``model``'s forward (a GPTModel, or a pipeline stage of one) beside the ids:
    ``inputs.extra`` and, on a model with experts, the padding mask that keeps pad positions out of the routers'
    load-balancing loss. megatron-core gives each TP rank its share of the mask under sequence parallelism on the
    first pipeline stage only; a later stage gets its share here."""
    extra = dict(inputs.extra)
    if getattr(model.config, "num_moe_experts", None) and inputs.padding is not None:
        padding = inputs.padding
        if model.config.sequence_parallel and not model.pre_process:
            tp, tp_rank, _ = _tp()
            padding = padding.chunk(tp, dim=1)[tp_rank]
        extra["padding_mask"] = padding
    return extra


def sequence_parallel_size(model) -> int:
    """The TP size when ``model`` (a GPTModel) runs with sequence parallelism, else 1."""
    config = getattr(model, "config", None)
    return int(config.tensor_model_parallel_size) if getattr(config, "sequence_parallel", False) else 1


@contextlib.contextmanager
def projecting_rows(model, rows):
    """Within this block, only ``rows`` (int64 ``[N]`` on the model's device, or None) of ``model``'s
    decoder output reach its output layer.

    A forward hook on megatron-core's ``TransformerBlock`` (``model.decoder``) replaces its output
    ``[s, b, h]`` by the selected rows ``[N, 1, h]`` of ``[s * b, h]``, so the GPTModel returns
    logits ``[1, N, V / tp]`` (the positions that predict response tokens: the prompt's others
    cost a third of the output layer and of the vocab-parallel softmax at 128 + 256 tokens).
    Nothing is changed for ``rows`` None or a pipeline stage without the output layer.
    """
    if rows is None or not getattr(model, "post_process", True):
        yield
        return

    def keep(_module, _args, output):
        return output.reshape(-1, output.shape[-1]).index_select(0, rows).unsqueeze(1)

    handle = model.decoder.register_forward_hook(keep)
    try:
        yield
    finally:
        handle.remove()


def response_log_probs(logits, inputs: MicroBatchInputs, temperature: float, *, vocab_size: int,
                       entropy_grad: bool, chunk_rows: int = -1) -> tuple[list, list]:
    """Per-sample response log-probs and entropy from a forward's vocab-parallel logits
    (:func:`vocab_parallel_log_probs`; views, no copy): ``[1, N, V/tp]`` for the ``N`` projected
    rows of ``inputs.head_rows``, else ``[rows, positions, V/tp]``. Under context parallelism the
    values of this rank's chunks are gathered over the CP group into the whole ``[rows, L]`` grid
    (every CP rank returns every token's; each back-propagates its own).

    :returns: ``(log_probs, entropy)``: B float32 tensors ``[T_i]`` each (a
        :class:`~furlong.hooks.rows.SplitRows` of the ``N`` projected rows when only the responses are).
    """
    lp, ent = vocab_parallel_log_probs(logits.reshape(-1, logits.shape[-1]), inputs.targets.reshape(-1), temperature,
                                       vocab_size, entropy_grad=entropy_grad, chunk_rows=chunk_rows)
    if inputs.head_rows is not None:  # the projected rows are the responses, one after another
        lengths = [b - a for _, a, b in inputs.spans]
        return SplitRows.of(lp, lengths), SplitRows.of(ent, lengths)
    lp, ent = (gather_sequence(x.view(inputs.targets.shape), 1, replicated_loss=True, lengths=inputs.segments)
               for x in (lp, ent))
    return [lp[row, a:b] for row, a, b in inputs.spans], [ent[row, a:b] for row, a, b in inputs.spans]


def forward_log_probs(model, tokens: Sequence[Any], response_lengths: Sequence[int], temperature: float, device, *,
                      vocab_size: int, grad: bool, entropy_grad: bool, packed: bool = False,
                      chunk_rows: int = -1, share_prompts: bool = False) -> tuple[list, list]:
    """One GPTModel forward over a micro-batch; response log-probs and entropy per sample.

    Padded (``packed=False``): the sequences are right-padded into ``[B, L]``; no attention
    mask is needed because attention is causal, so pad tokens after a sequence never reach
    its positions (GPTModel's RoPE positions are implicit). Packed (``packed=True``, the
    ``thd`` layout): the sequences are concatenated into ``[1, sum L_i]`` with
    ``PackedSeqParams``; attention and RoPE restart at each sequence (:mod:`.attention`),
    and no pad token is computed. Under context parallelism each sequence (padded: the
    ``[B, L]`` grid's rows; packed: each sequence, padded to a multiple of ``2 CP``) is split
    over the CP ranks (:mod:`.context`) and the output layer projects every position, as under
    sequence parallelism (the positions padded to a multiple of TP); otherwise it projects only the
    positions that predict response tokens (:func:`projecting_rows`). Packed without context or sequence
    parallelism, ``share_prompts`` lets samples that share a prompt run it once (:func:`shared_prompt_inputs`).

    :param tokens: B sequences of prompt + response ids.
    :param response_lengths: B response lengths ``T_i`` (the last ``T_i`` tokens).
    :returns: ``(log_probs, entropy)``: B float32 tensors ``[T_i]`` each.
    :raises ValueError: a response that starts at position 0 (no previous token).
    """
    inputs = micro_batch_inputs(tokens, response_lengths, device, packed=packed,
                                sequence_parallel=sequence_parallel_size(model), share_prompts=share_prompts)
    with torch.set_grad_enabled(grad), projecting_rows(model, inputs.head_rows):
        logits = model(input_ids=inputs.ids, position_ids=None, attention_mask=None, **model_extra(model, inputs))
        return response_log_probs(logits, inputs, temperature, vocab_size=vocab_size,
                                  entropy_grad=grad and entropy_grad, chunk_rows=chunk_rows)
