"""Prompt sharing: a prompt that several samples of a micro-batch share runs through the decoder once.

GRPO and its relatives draw ``n`` responses per prompt, so a micro-batch usually holds
groups of samples whose prompt tokens are identical. Instead of one right-padded pass over
every whole sequence, :func:`shared_forward` runs two:

1. the ``U`` distinct *prefixes* (each sample's tokens before its last prompt token),
   right-padded to ``P``, with a key/value cache: per layer ``[U, kv_heads, P, d]``;
2. the cache gathered along the batch dimension (one row per sample; an indexing op, so
   differentiable) and each sample's *suffix* (its last prompt token, then its response),
   right-padded to ``S``, at positions ``len(prefix) + 0 .. S-1``, under a ``[N, P + S]``
   attention mask that is 1 on the sample's real prefix tokens and its real suffix tokens
   and 0 on the prefix padding and the suffix padding.

Every suffix query attends to exactly the keys it attends to in one pass over the whole
sequence (its prefix, then the suffix tokens up to itself), at the same rotary positions,
so the outputs are those of the unshared pass up to float rounding; the backward pass runs
through the gather into stage 1, so parameter gradients are too. Stage 2 starts at the last
prompt token rather than the first response token so that every position that predicts a
response token is a stage-2 output (stage 1 needs no output projection at all).

Work saved: the prompt of a group of ``n`` runs once instead of ``n`` times; a micro-batch
takes this path only when its padded token count ``U * P + N * S`` is below the unshared
``N * L``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Sequence

import attrs

from furlong.hooks.hf import decoder_layers

from .lora import base_model

__all__ = ["ATTENTION_IMPLEMENTATIONS", "MODEL_TYPES", "SharedPrompts", "all_ranks_share", "log_choice",
           "plan_sharing", "shared_forward", "sharing_off_reason"]

log = logging.getLogger("furlong.backends.fsdp")

MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"})
"""``config.model_type`` values whose decoders take prompt sharing (each is checked against
the unshared pass in tests/test_fsdp_shared_prompts.py)."""

ATTENTION_IMPLEMENTATIONS = frozenset({"sdpa", "eager"})
"""Attention implementations prompt sharing runs under (both build the padded 4-D mask from the 2-D one)."""

_logged: set[str] = set()


@attrs.frozen
class SharedPrompts:
    """How a micro-batch's samples share prefixes.

    :ivar prefixes: the ``U`` distinct prefixes, int64 tensors ``[P_u]`` (``P_u >= 1``), in
        order of first appearance.
    :ivar owner: per sample, the index of its prefix in ``prefixes``.
    :ivar suffixes: per sample, int64 ``[T_i + 1]``: its last prompt token, then its response.
    """

    prefixes: list
    owner: list[int]
    suffixes: list


def plan_sharing(seqs: Sequence[Any], response_lengths: Sequence[int]) -> SharedPrompts | None:
    """Group the samples of a micro-batch by prefix; None when sharing saves nothing.

    :param seqs: B int64 tensors ``[L_i]`` (prompt + response).
    :param response_lengths: B response lengths ``T_i`` (the last ``T_i`` tokens).
    :returns: the plan, or None when no two samples share a prefix, a sample's prompt is a
        single token (its prefix is empty), or the two-stage padded token count
        ``U * max P_u + B * max (T_i + 1)`` is not below the one-pass ``B * max L_i``.
    """
    index: dict[tuple[int, ...], int] = {}
    owner, prefixes, suffixes = [], [], []
    for seq, t in zip(seqs, response_lengths):
        cut = len(seq) - int(t) - 1
        if cut < 1:
            return None
        key = tuple(seq[:cut].tolist())
        if key not in index:
            index[key] = len(prefixes)
            prefixes.append(seq[:cut])
        owner.append(index[key])
        suffixes.append(seq[cut:])
    if len(prefixes) == len(seqs):
        return None
    shared_tokens = len(prefixes) * max(len(p) for p in prefixes) + len(seqs) * max(len(s) for s in suffixes)
    if shared_tokens >= len(seqs) * max(len(s) for s in seqs):
        return None
    return SharedPrompts(prefixes=prefixes, owner=owner, suffixes=suffixes)


def sharing_off_reason(model) -> str | None:
    """Why prompt sharing cannot run on ``model`` now (a peft wrapper is looked through), or None when it can.

    Never on CUDA: measured on an H200 at the Qwen2.5-0.5B shape (docs/benchmarks.md), the
    shared step took twice the one-pass step's time, whose unmasked causal attention runs on
    flash kernels.

    Not with compiled decoder layers (``--train-torch-compile``). A model in train mode with
    gradient checkpointing on cannot: its decoder layers drop the
    cache (transformers before 5.2x drops it even without grad). The fsdp backend runs its
    log-prob passes in eval mode, so only its training passes lose sharing.
    """
    import transformers

    if any(p.is_cuda for p in model.parameters()):
        return ("on CUDA the second pass's attention mask (prompt padding in the middle) keeps SDPA off its flash "
                "kernels, which costs more than the prompts save (docs/benchmarks.md)")
    if any(getattr(layer, "_compiled_call_impl", None) is not None for layer in decoder_layers(model)):
        return ("--train-torch-compile: the compiled decoder layers would be compiled again for every shape of the "
                "key/value cache")
    from transformers import cache_utils

    if not hasattr(cache_utils, "DynamicLayer"):
        return f"transformers {transformers.__version__} has no per-layer key/value cache (DynamicLayer)"
    base = base_model(model)
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(sorted(MODEL_TYPES))}"
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ATTENTION_IMPLEMENTATIONS:
        return f"attention {attention!r} (prompt sharing runs under {' or '.join(sorted(ATTENTION_IMPLEMENTATIONS))})"
    if base.training and _checkpointing(base):
        return "--gradient-checkpointing drops the key/value cache in training passes"
    if non_full_attention(config):
        return "the model has sliding-window or other non-full attention layers"
    return None


def non_full_attention(config) -> bool:
    """True when a model of ``config`` has sliding-window or other layers that are not full causal attention
    (the layers of transformers' ``DynamicCache`` for it are not all plain ``DynamicLayer``)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return any(type(layer) is not DynamicLayer for layer in getattr(DynamicCache(config=config), "layers", []))


def all_ranks_share(share: bool, model, device) -> bool:
    """``share`` where every rank of an FSDP2-sharded ``model`` also shares, else False (a MIN all-reduce).

    Each forward pass of a sharded model all-gathers every layer's parameters on all ranks, so
    the ranks must run the same passes: one pass everywhere, or two everywhere. An unsharded
    model (one process) returns ``share`` without communicating.
    """
    import torch
    import torch.distributed as dist

    base = base_model(model)
    sharded = hasattr(model, "unshard") or hasattr(base, "unshard")  # fully_shard on the root (peft or not)
    if not (sharded and dist.is_available() and dist.is_initialized()):
        return share
    flag = torch.tensor([1 if share else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def log_choice(reason: str | None) -> None:
    """Log, once per process and reason, whether micro-batches with shared prompts share them (rank 0 only)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    message = ("fsdp: samples that share a prompt run it once per micro-batch (prompt sharing)" if reason is None
               else f"fsdp: prompt sharing is off ({reason}); every sample runs its whole sequence")
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def shared_forward(model, decoder, shared: SharedPrompts, device):
    """The two passes of prompt sharing (see the module docstring); run under the caller's grad and autocast.

    :param model: the causal LM (peft-wrapped or FSDP2-sharded alike).
    :param decoder: the model's decoder (returns ``.last_hidden_state``), or None to call
        ``model`` itself (returns ``.logits``).
    :param shared: the plan from :func:`plan_sharing`.
    :returns: ``(out, ids)``: ``out`` ``[N, S, H]`` hidden states (or ``[N, S, V]`` logits)
        at the suffix positions and ``ids`` the right-padded suffixes, int64 ``[N, S]`` on
        ``device``: ``out[i, k]`` predicts ``ids[i, k + 1]``.
    :raises RuntimeError: the first pass left no cache of the prefixes (a model outside
        :data:`MODEL_TYPES`, or one :func:`sharing_off_reason` should have refused).
    """
    import torch
    from transformers.cache_utils import DynamicCache

    base = base_model(model)
    net = model if decoder is None else decoder
    cache_kwarg, keep = _cache_kwarg(base if decoder is None else decoder)
    prefix_len = max(len(p) for p in shared.prefixes)
    suffix_len = max(len(s) for s in shared.suffixes)
    prefix_ids = torch.zeros(len(shared.prefixes), prefix_len, dtype=torch.long)
    prefix_mask = torch.zeros_like(prefix_ids)
    for u, prefix in enumerate(shared.prefixes):
        prefix_ids[u, : len(prefix)] = prefix
        prefix_mask[u, : len(prefix)] = 1
    ids = torch.zeros(len(shared.suffixes), suffix_len, dtype=torch.long)
    mask = torch.zeros(len(shared.suffixes), prefix_len + suffix_len, dtype=torch.long)
    starts = torch.tensor([len(shared.prefixes[u]) for u in shared.owner], dtype=torch.long)
    for i, (u, suffix) in enumerate(zip(shared.owner, shared.suffixes)):
        ids[i, : len(suffix)] = suffix
        mask[i, : len(shared.prefixes[u])] = 1
        mask[i, prefix_len : prefix_len + len(suffix)] = 1
    positions = starts.unsqueeze(1) + torch.arange(suffix_len).unsqueeze(0)

    cache = DynamicCache(config=base.config)
    extra = {"logits_to_keep": 1} if decoder is None and keep else {}
    first = net(input_ids=prefix_ids.to(device), attention_mask=prefix_mask.to(device), use_cache=True,
                **{cache_kwarg: cache}, **extra)
    if cache.get_seq_length() != prefix_len:
        raise RuntimeError(f"prompt sharing: the prefix pass cached {cache.get_seq_length()} of {prefix_len} "
                           f"positions ({type(base).__name__} does not fill a key/value cache here)")
    cache.batch_select_indices(torch.tensor(shared.owner, device=device))
    ids = ids.to(device)
    out = net(input_ids=ids, attention_mask=mask.to(device), position_ids=positions.to(device), use_cache=True,
              **{cache_kwarg: cache})
    if decoder is not None:
        return out.last_hidden_state, ids
    if torch.is_grad_enabled() and first.logits.requires_grad:
        # The prefix pass's logits feed nothing, so no gradient reaches its last layer's output and FSDP2's
        # pre-backward hook there (which gathers the layer's parameters) would never run before the backward
        # through that layer's cached keys and values. A zero-weighted term makes it run; the values are unchanged.
        return out.logits + 0.0 * first.logits.sum(), ids
    return out.logits, ids


def _checkpointing(model) -> bool:
    """Whether activation (gradient) checkpointing is on: transformers' property, renamed in 5.2x."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def _cache_kwarg(module) -> tuple[str, bool]:
    """The forward's name for the cache argument (``cache`` from transformers 5.2x, ``past_key_values``
    before) and whether it takes ``logits_to_keep``."""
    params = inspect.signature(module.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params
