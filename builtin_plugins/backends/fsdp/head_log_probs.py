"""The output projection and the token log-probs in one autograd Function, a chunk of rows at a time.

For a bias-free projection ``logits = states @ W.T`` the Function computes each chunk's
logits, reduces them to the target's log-prob and the entropy (:mod:`furlong.kit.vocab_softmax`,
fused kernels on CUDA) and keeps nothing of them: the backward pass projects the chunk
again and turns it straight into ``d loss / d logits`` with the closed form
``(1[v = target] - p_v) g_logp - p_v (log p_v + H) g_H``, then into the gradients of the
states and of ``W``. Against activation checkpointing of ``log_softmax`` (the generic path
of :func:`.logprobs.chunked_log_probs`) the matrix products are the same four per chunk,
while the float32 ``[chunk, V]`` element-wise passes drop from about twenty to three
reads of the logits.
"""

from __future__ import annotations

import torch

from furlong.kit import vocab_softmax as vs

__all__ = ["head_log_probs", "takes_fused_head"]


def takes_fused_head(head) -> bool:
    """True when ``head`` is a plain ``torch.nn.Linear`` without bias (the usual ``lm_head``); a
    wrapped one (LoRA on the head, a quantized layer) takes the generic path."""
    return type(head) is torch.nn.Linear and head.bias is None


def head_log_probs(weight, states, targets, temperature: float, *, entropy_grad: bool = True, chunk: int):
    """Log-prob of each target under ``softmax(states @ weight.T / tau)`` and the entropy of that distribution.

    :param weight: the projection ``[V, H]`` (``lm_head.weight``; tied embeddings are fine: its
        gradient is accumulated as usual).
    :param states: ``[N, H]`` hidden states, the positions before each target, same dtype as ``weight``.
    :param targets: int64 ``[N]``.
    :param temperature: the rollout temperature (no scaling when <= 0 or == 1), as in
        :func:`.logprobs.token_log_probs`, whose values these are up to float summation order.
    :param entropy_grad: False returns the entropy detached.
    :param chunk: rows projected at once (``[chunk, V]`` logits in the weight's dtype).
    :returns: ``(log_probs, entropy)``: float32 ``[N]`` each.
    """
    inv = 1.0 / temperature if temperature > 0 and temperature != 1 else 1.0
    log_probs, entropy = _HeadLogProbs.apply(states, weight, targets, inv, chunk)
    return log_probs, entropy if entropy_grad else entropy.detach()


class _HeadLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, states, weight, targets, inv_temperature: float, chunk: int):
        rows, vocab = states.shape[0], weight.shape[0]
        log_norm, log_probs, entropy = (states.new_empty(rows, dtype=torch.float32) for _ in range(3))
        local, mine = vs.local_targets(targets, 0, vocab)
        for a in range(0, rows, chunk):
            b = min(rows, a + chunk)
            log_norm[a:b], log_probs[a:b], entropy[a:b] = vs.row_stats(
                states[a:b] @ weight.t(), local[a:b], mine[a:b], 0, vocab, inv_temperature)
        ctx.save_for_backward(states, weight, targets, log_norm, entropy)
        ctx.inv_temperature, ctx.chunk = inv_temperature, chunk
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        states, weight, targets, log_norm, entropy = ctx.saved_tensors
        want_states, want_weight = ctx.needs_input_grad[:2]
        rows, vocab = states.shape[0], weight.shape[0]
        grad_log_probs, grad_entropy = vs.incoming_grads(grad_log_probs, grad_entropy, log_norm)
        grad_states = torch.empty_like(states) if want_states else None
        # summed over the chunks in float32, rounded to the weight's dtype once
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        chunk_grad = vs.fused(vs.chunk_grad, states.device)
        local, mine = vs.local_targets(targets, 0, vocab)
        for a in range(0, rows, ctx.chunk):
            b = min(rows, a + ctx.chunk)
            logits = states[a:b] @ weight.t()
            grad_logits = chunk_grad(logits, log_norm[a:b], entropy[a:b], grad_log_probs[a:b], grad_entropy[a:b],
                                     local[a:b], mine[a:b], 0, vocab, ctx.inv_temperature)
            if want_states:
                grad_states[a:b] = grad_logits @ weight
            if want_weight:
                grad_weight += (grad_logits.t() @ states[a:b]).float()
        return grad_states, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None
