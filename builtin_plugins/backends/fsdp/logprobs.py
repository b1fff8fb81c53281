"""Per-token log-probs and entropy of response tokens from a causal LM forward pass.

The decoder runs once over the micro-batch, right-padded, or on a GPU packed into one row
without padding (:mod:`.packing`); the output projection (``lm_head``) then runs only on the
hidden states of the positions that predict a response token, in chunks of
:data:`VOCAB_CHUNK_TOKENS` rows (``--log-probs-chunk-size`` when set), each chunk's logits
recomputed in the backward pass instead of kept, so no ``[B, L, V]`` logits tensor exists in
any dtype: a plain bias-free projection goes through :mod:`.head_log_probs` (the projection
and the softmax statistics in one autograd Function with a closed-form gradient), any other
head through activation checkpointing of the projection and the log-softmax
(:func:`chunked_log_probs`). Models whose logits are not a plain projection of the last
hidden state (a final soft-cap, a logit scale) and models sharded by FSDP2 (whose root
forward gathers the projection) take the whole-logits path. When samples of the micro-batch
share a prompt (on a CPU), the decoder runs each distinct prompt once: one row per prompt with
its responses end to end under a tree mask, or each response against the prompt's cached keys
and values (:mod:`.shared_prompts`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Sequence

from furlong.hooks.rows import SplitRows
from furlong.kit.shared_rows import prefix_groups
from furlong.kit.trainer import concatenated_ranges, right_padded, to_device

from . import packing, shared_prompts
from .lora import base_model

__all__ = ["VOCAB_CHUNK_TOKENS", "chunked_log_probs", "chunked_token_log_probs", "forward_log_probs", "token_log_probs"]

VOCAB_CHUNK_TOKENS = 4096
"""Rows of the output projection computed at once (a ``[4096, V]`` float32 block: 2.5 GB at V = 152k)."""


def token_log_probs(logits, targets, temperature: float, entropy_grad: bool = True):
    """Log-prob of each target token and the entropy of its distribution.

    ``logp_t = log_softmax(logits_t / tau)[target_t]`` and ``H_t = -sum_v p_v log p_v``
    of the same scaled distribution, with ``tau`` = the rollout temperature when it is
    > 0 and != 1 (else no scaling). Matches what the engine reports for the token it
    sampled (logits [2, 0], tau 0.5, token 0 -> -0.018150; ignoring the temperature would
    give -0.126928 and bias the importance ratios of an on-policy batch).

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
    share_prompts: bool = True,
) -> tuple[list, list]:
    """Forward passes over a micro-batch; per-sample response log-probs and entropy.

    One pass over the right-padded sequences; or, when the model runs packed attention
    (:mod:`.packing`, switched on for GPUs by the backend), one pass over the sequences
    packed into one row without padding; or, when samples share a prompt (GRPO groups) and the model
    takes it, prompt sharing: each distinct prompt once, in one row with its samples' responses
    or in a pass of its own whose key/value cache the responses then attend to (:mod:`.shared_prompts`). All three give the same values and
    gradients up to float rounding.

    :param model: a causal LM returning ``.logits`` ``[B, L, V]``.
    :param tokens: B sequences of prompt + response ids (lists or int tensors).
    :param response_lengths: B response lengths ``T_i`` (the last ``T_i`` tokens).
    :param temperature: logits are divided by it (see :func:`token_log_probs`).
    :param grad: keep the autograd graph (training) or not (old/reference log-probs).
    :param entropy_grad: keep the entropy's graph (only when the entropy is trained on).
    :param autocast: a context manager to run the forward in (bfloat16 autocast), or None.
    :param chunk_size: rows of the output projection and log-softmax computed at once
        (``--log-probs-chunk-size``; <= 0: :data:`VOCAB_CHUNK_TOKENS` on the split-head path, one
        pass on the whole-logits path). The values do not depend on it.
    :param share_prompts: False always takes the one-pass path.
    :returns: ``(log_probs, entropy)``: B float32 tensors ``[T_i]`` each.
    :raises ValueError: a sample whose response starts at position 0 (no previous token).
    """
    import torch

    seqs, ids = right_padded(tokens, response_lengths)
    split = _split_head(model)
    packed = packing.packs(model)
    shared = _sharing_plan(model, seqs, response_lengths, device, packed) if share_prompts else None
    with torch.set_grad_enabled(grad), autocast if autocast is not None else nullcontext():
        if shared is not None and not packed:  # out[i, k] predicts ids[i, k + 1]; the response starts at k = 1
            out, ids = shared_prompts.shared_forward(model, None if split is None else split[0], shared, device)
            rows = [(i, 0, t) for i, t in enumerate(response_lengths)]
        elif packed:  # one row [1, T]: out[0, k] predicts ids[0, k + 1]
            if shared is not None:  # each prompt once, then the suffixes that share it
                ids, positions, spans, starts = packing.pack_shared(shared, device)
                rows = [(0, start, t) for start, t in zip(starts, response_lengths)]
            else:
                ids, positions, spans = packing.pack(seqs, device)
                rows = [(0, end - t - 1, t) for end, t in zip(spans.bounds[1:], response_lengths)]
            net = model if split is None else split[0]
            out = net(input_ids=ids, position_ids=positions, packed_spans=spans, use_cache=False)
            out = out.logits if split is None else out.last_hidden_state
        else:
            # no attention mask: the padding is on the right and attention is causal, so no real
            # position sees a pad token (and the model takes its flash kernels, with no padding check)
            ids = to_device(ids, device)
            if split is None:
                out = model(input_ids=ids, use_cache=False).logits
            else:
                out = split[0](input_ids=ids, use_cache=False).last_hidden_state
            rows = [(i, len(seq) - t - 1, t) for i, (seq, t) in enumerate(zip(seqs, response_lengths))]
    with torch.set_grad_enabled(grad):
        if split is None:
            pairs = [chunked_token_log_probs(out[i, s : s + t], ids[i, s + 1 : s + t + 1], temperature,
                                             entropy_grad=grad and entropy_grad, chunk_size=chunk_size)
                     for i, s, t in rows]
            return [p[0] for p in pairs], [p[1] for p in pairs]
        # one gather over the flattened positions: its backward is one scatter, where a slice per
        # sample would add a zero-filled [B, L, H] gradient per sample
        width = out.shape[1]
        flat = to_device(concatenated_ranges(torch.tensor([i * width + s for i, s, _ in rows], dtype=torch.long),
                                             torch.tensor([t for _, _, t in rows], dtype=torch.long)), out.device)
        states = out.reshape(-1, out.shape[-1]).index_select(0, flat)
        targets = ids.reshape(-1).to(out.device).index_select(0, flat + 1)
        from .head_log_probs import head_log_probs, takes_fused_head

        if autocast is None and takes_fused_head(split[1]):
            log_probs, entropy = head_log_probs(split[1].weight, states, targets, temperature,
                                                entropy_grad=grad and entropy_grad,
                                                chunk=chunk_size if chunk_size > 0 else VOCAB_CHUNK_TOKENS)
        else:
            log_probs, entropy = chunked_log_probs(split[1], states, targets, temperature, autocast=autocast,
                                                   entropy_grad=grad and entropy_grad,
                                                   chunk=chunk_size if chunk_size > 0 else None)
    sizes = [t for _, _, t in rows]
    return SplitRows.of(log_probs, sizes), SplitRows.of(entropy, sizes)


def _sharing_plan(model, seqs, response_lengths, device, packed: bool):
    """How the micro-batch shares its prompts, or None. A packed model shares in its one row whenever two samples
    share a prompt (a :class:`furlong.kit.shared_rows.PrefixGroups`; every FSDP2 rank then still runs one pass);
    otherwise a :class:`.shared_prompts.SharedPrompts` in the cheapest layout by estimate, where the model can run
    it, agreed across FSDP2 ranks."""
    if packed:
        shared = prefix_groups(seqs, response_lengths)
        if shared is not None:
            shared_prompts.log_choice(None)
        return shared
    config = getattr(base_model(model), "config", None)
    shared = shared_prompts.plan_sharing(seqs, response_lengths, shared_prompts.attention_pair_cost(config),
                                         shared_prompts.pass_cost(config))
    if shared is not None:
        reason = shared_prompts.sharing_off_reason(model, shared.layout)
        shared_prompts.log_choice(reason)
        shared = None if reason else shared
    return shared_prompts.all_ranks_share(shared, model, device)


def chunked_log_probs(head, states, targets, temperature: float, *, autocast: Any = None, entropy_grad: bool = True,
                      chunk: int | None = None):
    """:func:`token_log_probs` of ``head(states)`` computed ``chunk`` rows at a time.

    :param head: the output projection (``model.get_output_embeddings()``).
    :param states: ``[N, H]`` hidden states (the positions before each target).
    :param targets: int64 ``[N]``.
    :returns: ``(log_probs, entropy)``, float32 ``[N]`` each. Under autograd each chunk is
        checkpointed, so its ``[chunk, V]`` float32 logits live only while it is computed.
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    chunk = chunk or VOCAB_CHUNK_TOKENS

    def block(h, y):
        with autocast if autocast is not None else nullcontext():
            logits = head(h)
        return token_log_probs(logits, y, temperature, entropy_grad=entropy_grad)

    outs = []
    for start in range(0, states.shape[0], chunk):
        h, y = states[start : start + chunk], targets[start : start + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            outs.append(checkpoint(block, h, y, use_reentrant=False))
        else:
            outs.append(block(h, y))
    if not outs:
        empty = states.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def _split_head(model):
    """``(decoder, lm_head)`` of a causal LM whose logits are ``lm_head(last hidden state)``, else None."""
    model = base_model(model)  # peft (LoRA): the adapters live inside the wrapped model's layers
    config = getattr(model, "config", None)
    if hasattr(model, "unshard"):  # FSDP2: the root's forward gathers the projection's shards
        return None
    if config is None or getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None or decoder is model:
        return None
    return decoder, head
