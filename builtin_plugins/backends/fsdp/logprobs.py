"""Per-token log-probs and entropy of response tokens from a causal LM forward pass (SPEC.md 6.1)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Sequence

from furlong.hooks.trainer import right_padded

__all__ = ["chunked_token_log_probs", "forward_log_probs", "token_log_probs"]


def token_log_probs(logits, targets, temperature: float, entropy_grad: bool = True):
    """Log-prob of each target token and the entropy of its distribution.

    ``logp_t = log_softmax(logits_t / tau)[target_t]`` and ``H_t = -sum_v p_v log p_v``
    of the same scaled distribution, with ``tau`` = the rollout temperature when it is
    > 0 and != 1 (else no scaling). Matches what the engine reports for the token it
    sampled (CASES.md C014: logits [2, 0], tau 0.5, token 0 -> -0.018150).

    :param logits: float tensor ``[T, V]``: the logits at the position *before* each target.
    :param targets: int64 tensor ``[T]``.
    :param temperature: the rollout temperature.
    :param entropy_grad: False returns the entropy detached (no autograd graph kept).
    :returns: ``(log_probs, entropy)``, float32 tensors ``[T]``.
    """
    import torch

    logits = logits.float()
    if temperature > 0 and temperature != 1:
        logits = logits / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    chosen = log_p.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    with nullcontext() if entropy_grad else torch.no_grad():
        entropy = -(log_p.exp() * log_p).sum(-1)
    return chosen, entropy


def chunked_token_log_probs(logits, targets, temperature: float, entropy_grad: bool = True, chunk_size: int = -1):
    """:func:`token_log_probs` over ``chunk_size`` tokens at a time (``--log-probs-chunk-size``).

    Each token's distribution is a row of its own, so the values are those of one pass;
    only the float32 ``[chunk, V]`` intermediates are smaller. ``chunk_size`` <= 0: one pass.
    """
    import torch

    if chunk_size <= 0 or logits.shape[0] <= chunk_size:
        return token_log_probs(logits, targets, temperature, entropy_grad=entropy_grad)
    parts = [token_log_probs(logits[s : s + chunk_size], targets[s : s + chunk_size], temperature,
                             entropy_grad=entropy_grad) for s in range(0, logits.shape[0], chunk_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def forward_log_probs(
    model,
    tokens: Sequence[Any],
    response_lengths: Sequence[int],
    temperature: float,
    device,
    *,
    grad: bool,
    entropy_grad: bool,
    autocast: Any = None,
    chunk_size: int = -1,
) -> tuple[list, list]:
    """One forward pass over a right-padded micro-batch; per-sample response log-probs and entropy.

    :param model: a causal LM returning ``.logits`` ``[B, L, V]``.
    :param tokens: B sequences of prompt + response ids (lists or int tensors).
    :param response_lengths: B response lengths ``T_i`` (the last ``T_i`` tokens).
    :param temperature: logits are divided by it (see :func:`token_log_probs`).
    :param grad: keep the autograd graph (training) or not (old/reference log-probs).
    :param entropy_grad: keep the entropy's graph (only when the entropy is trained on).
    :param autocast: a context manager to run the forward in (bfloat16 autocast), or None.
    :param chunk_size: tokens per log-softmax pass (:func:`chunked_token_log_probs`).
    :returns: ``(log_probs, entropy)``: B float32 tensors ``[T_i]`` each.
    :raises ValueError: a sample whose response starts at position 0 (no previous token).
    """
    import torch

    seqs, ids = right_padded(tokens, response_lengths)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(seqs):
        mask[i, : len(seq)] = 1
    ids, mask = ids.to(device), mask.to(device)
    with torch.set_grad_enabled(grad), autocast if autocast is not None else nullcontext():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    log_probs, entropy = [], []
    with torch.set_grad_enabled(grad):
        for i, (seq, t) in enumerate(zip(seqs, response_lengths)):
            n = len(seq)
            lp, ent = chunked_token_log_probs(logits[i, n - t - 1 : n - 1], ids[i, n - t : n], temperature,
                                              entropy_grad=grad and entropy_grad, chunk_size=chunk_size)
            log_probs.append(lp)
            entropy.append(ent)
    return log_probs, entropy
