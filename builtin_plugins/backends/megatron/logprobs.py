"""Per-token log-probs and entropy from vocab-parallel logits (SPEC.md 6.1; MEGATRON.md 6).

Each tensor-parallel rank holds the logits of its vocabulary slice. The softmax pieces are
combined with all-reduces over the TP group: the row maximum (a constant shift, no
gradient), ``sum exp``, the target's logit (non-zero on its owner rank only) and
``sum p z``. The sums go through megatron-core's
``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward), so
log-probs and entropy both carry correct gradients. Padded vocabulary rows are left out of
every sum.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Sequence

__all__ = ["forward_log_probs", "vocab_parallel_log_probs"]


def vocab_parallel_log_probs(logits, targets, temperature: float, vocab_size: int, *, entropy_grad: bool = True):
    """Log-prob of each target and the entropy of its distribution, from this rank's vocab slice.

    ``logp_t = z_t[target] - log sum_v exp z_t[v]`` and ``H_t = log sum exp z_t - sum_v p_v z_t[v]``
    with ``z = logits / tau`` (``tau`` the rollout temperature when > 0 and != 1), the same
    values as the fsdp backend's full-vocabulary ``log_softmax``.

    :param logits: ``[T, V/tp]`` (any float dtype): logits at the position before each target.
    :param targets: int64 ``[T]``, global vocabulary ids.
    :param vocab_size: the HF vocabulary size; columns at or above it (padding) are ignored.
    :param entropy_grad: False returns the entropy detached.
    :returns: ``(log_probs, entropy)``: float32 ``[T]`` each, equal on every TP rank.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    z = logits.float()
    if temperature > 0 and temperature != 1:
        z = z / temperature
    width = z.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    valid = (torch.arange(start, start + width, device=z.device) < vocab_size) if start + width > vocab_size else None
    if valid is not None:
        z = z.masked_fill(~valid, float("-inf"))
    top = z.detach().max(dim=-1).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = z - top.unsqueeze(-1)
    exp = shifted.exp()
    total = tp_sum(exp.sum(dim=-1))
    local = targets.long() - start
    mine = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    picked = tp_sum(torch.where(mine, picked, torch.zeros_like(picked)))
    log_total = total.log()
    log_probs = picked - log_total
    with nullcontext() if entropy_grad else torch.no_grad():
        weighted = exp * shifted
        if valid is not None:
            weighted = torch.where(valid, weighted, torch.zeros_like(weighted))
        entropy = log_total - tp_sum(weighted.sum(dim=-1)) / total
    return log_probs, entropy


def forward_log_probs(model, tokens: Sequence[Any], response_lengths: Sequence[int], temperature: float, device, *,
                      vocab_size: int, grad: bool, entropy_grad: bool, autocast: Any = None) -> tuple[list, list]:
    """One GPTModel forward over a right-padded micro-batch; response log-probs and entropy per sample.

    Right padding needs no attention mask: attention is causal, so pad tokens after a
    sequence never reach its positions (GPTModel's RoPE positions are implicit).

    :param tokens: B sequences of prompt + response ids.
    :param response_lengths: B response lengths ``T_i`` (the last ``T_i`` tokens).
    :returns: ``(log_probs, entropy)``: B float32 tensors ``[T_i]`` each.
    :raises ValueError: a response that starts at position 0 (no previous token).
    """
    import torch

    seqs = [torch.as_tensor(t, dtype=torch.long).reshape(-1) for t in tokens]
    for i, (seq, t) in enumerate(zip(seqs, response_lengths)):
        if t > 0 and len(seq) - t < 1:
            raise ValueError(f"sample {i}: response_length {t} leaves no prompt token in {len(seq)} tokens")
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = seq
    ids = ids.to(device)
    positions = torch.arange(width, device=device).unsqueeze(0).expand_as(ids)
    with torch.set_grad_enabled(grad), autocast if autocast is not None else nullcontext():
        logits = model(input_ids=ids, position_ids=positions, attention_mask=None)
        rows = [logits[i, len(s) - t - 1: len(s) - 1] for i, (s, t) in enumerate(zip(seqs, response_lengths))]
        targets = torch.cat([ids[i, len(s) - t: len(s)] for i, (s, t) in enumerate(zip(seqs, response_lengths))])
        lp, ent = vocab_parallel_log_probs(torch.cat(rows), targets, temperature, vocab_size,
                                           entropy_grad=grad and entropy_grad)
    sizes = [int(t) for t in response_lengths]
    return list(lp.split(sizes)), list(ent.split(sizes))
