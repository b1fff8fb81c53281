"""Prompt sharing: a prompt that several samples of a micro-batch share runs through the decoder once.

GRPO and its relatives draw ``n`` responses per prompt, so a micro-batch usually holds
groups of samples whose prompt tokens are identical. Each sample splits into a *prefix* (its
tokens before its last prompt token) and a *suffix* (its last prompt token, then its
response); samples with the same prefix share it. Instead of one right-padded pass over every
whole sequence, :func:`shared_forward` takes one of two layouts:

``rows`` (one pass): one row per distinct prefix, the prefix followed by the suffixes of all
its samples one after another, right-padded to the longest row, under a 4-D attention mask
that lets each suffix token see its prefix and the earlier tokens of its own suffix, and
nothing else (the row is a tree: a trunk and one branch per sample). Suffix tokens sit at
rotary positions ``len(prefix) + 0, 1, ...``, as in the whole sequence.

``two_passes``: the ``U`` distinct prefixes, right-padded to ``P``, with a key/value cache
(per layer ``[U, kv_heads, P, d]``); then the cache gathered along the batch dimension (one
row per sample; an indexing op, so differentiable) and each sample's suffix, right-padded to
``S``, at positions ``len(prefix) + 0 .. S-1``, under a ``[N, P + S]`` attention mask that is
1 on the sample's real prefix tokens and its real suffix tokens and 0 on the padding.

In both, every suffix query attends to exactly the keys it attends to in one pass over the
whole sequence, at the same rotary positions, so the outputs are those of the unshared pass
up to float rounding, and so are the parameter gradients. The suffix starts at the last prompt
token rather than the first response token so that every position that predicts a response
token is a suffix position.

Which layout, if any: :func:`plan_sharing` estimates each one's work as padded tokens (each
costs a pass through a layer's weights) plus query-key pairs of attention (each costs
:func:`attention_pair_cost` of a token) plus, for ``two_passes``, the fixed cost of its second
pass (:func:`pass_cost` tokens), and takes the cheapest of the two and the unshared pass.
``rows`` wins when responses are short beside the prompt (its attention is over whole rows, so
long responses make it quadratic in the group's total length); it also pads less, since a
group's responses are laid end to end rather than each padded to the longest.

A model that runs packed attention (the fsdp backend's default on GPUs) takes neither: its
micro-batch is one row without padding, so sharing there (:func:`..packing.pack_shared`) puts each
prefix in the row once and its samples' suffixes after it, and the attention kernel gathers each
suffix's keys from its prefix and itself. No mask is built, so it runs on CUDA and in compiled
decoder layers; it does strictly less work than the unshared row whenever two samples share a
prefix, so it needs no estimate.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Sequence

import attrs

from furlong.kit.hf import decoder_layers, non_full_attention
from furlong.kit.shared_rows import prefix_groups

from .lora import base_model

__all__ = ["ATTENTION_IMPLEMENTATIONS", "MODEL_TYPES", "PASS_OVERHEAD", "ROWS", "ROWS_MASK_LIMIT", "TWO_PASSES",
           "SharedPrompts", "all_ranks_share", "attention_pair_cost", "log_choice", "pass_cost", "plan_sharing",
           "shared_forward", "sharing_off_reason"]

log = logging.getLogger("furlong.backends.fsdp")

MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"})
"""``config.model_type`` values whose decoders take prompt sharing (each is checked against
the unshared pass in tests/test_fsdp_shared_prompts.py)."""

ATTENTION_IMPLEMENTATIONS = frozenset({"sdpa", "eager"})
"""Attention implementations prompt sharing runs under (both build the padded 4-D mask from the 2-D one)."""

_logged: set[str] = set()


ROWS = "rows"
TWO_PASSES = "two_passes"

PASS_OVERHEAD = 33_000_000
"""Multiply-adds per decoder layer that one more pass costs whatever its size: its kernels' fixed
cost (launch, thread fork and join) in a forward and backward. Measured on a 2-core x86 CPU
(docs/benchmarks.md, "Prompt sharing: the cost of a second pass"): a forward and backward of the
demo model (3 layers of 163,840 weights) over 2 tokens took as long as about 150-300 tokens more."""

ROWS_MASK_LIMIT = 1 << 24
"""Most elements of the ``rows`` layout's ``[U, 1, R, R]`` attention mask (16M: 64 MB as float32);
a micro-batch that would need more takes ``two_passes``."""


@attrs.frozen
class SharedPrompts:
    """How a micro-batch's samples share prefixes.

    :ivar prefixes: the ``U`` distinct prefixes, int64 tensors ``[P_u]`` (``P_u >= 1``), in
        order of first appearance.
    :ivar owner: per sample, the index of its prefix in ``prefixes``.
    :ivar suffixes: per sample, int64 ``[T_i + 1]``: its last prompt token, then its response.
    :ivar layout: :data:`ROWS` or :data:`TWO_PASSES` (the module docstring).
    """

    prefixes: list
    owner: list[int]
    suffixes: list
    layout: str = ROWS


def attention_pair_cost(config) -> float:
    """Work of one query-key pair of attention relative to one token's pass through a decoder layer's weights.

    A pair costs ``2 x heads x head_dim`` multiply-adds (its score and its share of the values); a
    token costs one per weight of the layer (:func:`_layer_weights`). 0 when ``config`` lacks the sizes.
    """
    weights = _layer_weights(config)
    if not weights:
        return 0.0
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * heads * head_dim / weights


def pass_cost(config) -> float:
    """The fixed cost of one more pass through the decoder, in tokens: :data:`PASS_OVERHEAD` over a
    layer's weights (about 200 tokens for the demo model, 9 for SmolLM2-135M). 0 when ``config`` lacks
    the sizes."""
    weights = _layer_weights(config)
    return PASS_OVERHEAD / weights if weights else 0.0


def _layer_weights(config) -> int:
    """Weights of one decoder layer: the query, key, value and output projections and the gated MLP
    (``3 x hidden x intermediate``; a mixture of experts counts its routed experts). 0 when ``config``
    lacks the sizes."""
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if not hidden or not heads:
        return 0
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    routed = (getattr(config, "moe_intermediate_size", None) or 0) * (getattr(config, "num_experts_per_tok", None) or 0)
    intermediate = routed or getattr(config, "intermediate_size", None) or 4 * hidden
    return hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate


def plan_sharing(seqs: Sequence[Any], response_lengths: Sequence[int], pair_cost: float = 0.0,
                 pass_tokens: float = 0.0) -> SharedPrompts | None:
    """Group the samples of a micro-batch by prefix and choose the layout; None when sharing saves nothing.

    :param seqs: B int64 tensors ``[L_i]`` (prompt + response).
    :param response_lengths: B response lengths ``T_i`` (the last ``T_i`` tokens).
    :param pair_cost: :func:`attention_pair_cost` of the model (0 counts tokens only).
    :param pass_tokens: :func:`pass_cost` of the model, the fixed cost of ``two_passes``' second
        pass (0: none).
    :returns: the plan, or None when no two samples share a prefix, a sample's prompt is a
        single token (its prefix is empty), or neither layout's estimated work (padded tokens
        plus ``pair_cost`` x query-key pairs) is below the unshared pass's: ``B L + B L^2 c``
        against ``U R + U R^2 c`` (``rows``, ``R`` = the longest prefix plus its suffixes; only
        while ``U R^2`` is at most :data:`ROWS_MASK_LIMIT`) and
        ``U P + B S + (U P^2 + B S (P + S)) c + pass_tokens`` (``two_passes``).
    """
    grouped = prefix_groups(seqs, response_lengths)
    if grouped is None:
        return None
    prefixes, owner, suffixes = grouped.prefixes, grouped.owner, grouped.suffixes
    n, u = len(seqs), len(prefixes)
    whole = max(len(s) for s in seqs)
    prefix, suffix = max(len(p) for p in prefixes), max(len(s) for s in suffixes)
    row = max(_row_lengths(prefixes, owner, suffixes))
    costs = {TWO_PASSES: u * prefix + n * suffix + (u * prefix**2 + n * suffix * (prefix + suffix)) * pair_cost
             + pass_tokens}
    if u * row * row <= ROWS_MASK_LIMIT:
        costs[ROWS] = u * row + u * row * row * pair_cost
    layout = min(costs, key=costs.__getitem__)
    if costs[layout] >= n * whole + n * whole * whole * pair_cost:
        return None
    return SharedPrompts(prefixes=prefixes, owner=owner, suffixes=suffixes, layout=layout)


def _row_lengths(prefixes, owner, suffixes) -> list[int]:
    """Per prefix, the length of its ``rows`` row: the prefix, then its samples' suffixes."""
    lengths = [len(p) for p in prefixes]
    for u, suffix in zip(owner, suffixes):
        lengths[u] += len(suffix)
    return lengths


def sharing_off_reason(model, layout: str = TWO_PASSES) -> str | None:
    """Why prompt sharing in ``layout`` cannot run on ``model`` now (a peft wrapper is looked through), or None
    when it can.

    Never on CUDA: measured on an H200 at the Qwen2.5-0.5B shape (docs/benchmarks.md), the
    shared step took twice the one-pass step's time, whose unmasked causal attention runs on
    flash kernels.

    Not with compiled decoder layers (``--train-torch-compile``). ``two_passes`` not in a model in
    train mode with gradient checkpointing on: its decoder layers drop the cache (transformers
    before 5.2x drops it even without grad); ``rows`` keeps no cache, so it runs there too.
    """
    import transformers

    if any(p.is_cuda for p in model.parameters()):
        return ("on CUDA the attention mask that both layouts need keeps SDPA off its flash kernels, which costs "
                "more than the prompts save (docs/benchmarks.md)")
    if any(getattr(layer, "_compiled_call_impl", None) is not None for layer in decoder_layers(model)):
        return ("--train-torch-compile: the compiled decoder layers would be compiled again for every shape of the "
                "shared-prompt passes")
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
    if layout == TWO_PASSES and base.training and _checkpointing(base):
        return "--gradient-checkpointing drops the key/value cache in training passes"
    if non_full_attention(config):
        return "the model has sliding-window or other non-full attention layers"
    return None


def all_ranks_share(shared: SharedPrompts | None, model, device) -> SharedPrompts | None:
    """``shared`` in a layout every rank of an FSDP2-sharded ``model`` runs too, or None (a MIN all-reduce).

    Each forward pass of a sharded model all-gathers every layer's parameters on all ranks, so
    the ranks must run the same passes: one pass everywhere (unshared or ``rows``), or two
    everywhere. The ranks agree on the least sharing among them (no sharing, then
    ``two_passes``, then ``rows``), and a rank that planned ``rows`` runs ``two_passes`` when
    another rank does. An unsharded model (one process) returns ``shared`` without communicating.
    """
    import torch
    import torch.distributed as dist

    base = base_model(model)
    sharded = hasattr(model, "unshard") or hasattr(base, "unshard")  # fully_shard on the root (peft or not)
    if not (sharded and dist.is_available() and dist.is_initialized()):
        return shared
    order = [None, TWO_PASSES, ROWS]
    flag = torch.tensor([order.index(None if shared is None else shared.layout)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    layout = order[int(flag.item())]
    return None if layout is None else attrs.evolve(shared, layout=layout)


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
    """The pass or passes of prompt sharing in ``shared.layout`` (the module docstring); run under the
    caller's grad and autocast.

    :param model: the causal LM (peft-wrapped or FSDP2-sharded alike).
    :param decoder: the model's decoder (returns ``.last_hidden_state``), or None to call
        ``model`` itself (returns ``.logits``).
    :param shared: the plan from :func:`plan_sharing`.
    :returns: ``(out, ids)``: ``out`` ``[N, S, H]`` hidden states (or ``[N, S, V]`` logits)
        at the suffix positions and ``ids`` the right-padded suffixes, int64 ``[N, S]`` on
        ``device``: ``out[i, k]`` predicts ``ids[i, k + 1]``.
    :raises RuntimeError: in ``two_passes``, the first pass left no cache of the prefixes (a
        model outside :data:`MODEL_TYPES`, or one :func:`sharing_off_reason` should have refused).
    """
    import torch

    ids = torch.nn.utils.rnn.pad_sequence(list(shared.suffixes), batch_first=True).to(device)
    suffix_len = ids.shape[1]
    net = model if decoder is None else decoder
    if shared.layout == ROWS:
        out = _rows_pass(net, base_model(model), shared, suffix_len, device)
    else:
        out = _two_passes(model, net, decoder is None, shared, ids, device)
    return out, ids


def _rows_pass(net, base, shared: SharedPrompts, suffix_len: int, device):
    """The ``rows`` layout: ``[N, S, ...]`` outputs at the suffix positions, gathered from one pass over ``[U, R]``."""
    import torch

    from furlong.kit.trainer import concatenated_ranges

    owner = torch.tensor(shared.owner, dtype=torch.long)
    prefix_lengths = torch.tensor([len(p) for p in shared.prefixes], dtype=torch.long)
    suffix_lengths = torch.tensor([len(s) for s in shared.suffixes], dtype=torch.long)
    # each sample's suffix starts after its prefix and the suffixes of the earlier samples of that prefix
    order = torch.argsort(owner, stable=True)
    before = suffix_lengths[order].cumsum(0) - suffix_lengths[order]  # suffix tokens ahead of it, all prefixes
    first = torch.zeros(len(shared.prefixes), dtype=torch.long).scatter_reduce_(
        0, owner[order], before, reduce="amin", include_self=False)
    start = torch.empty_like(owner)
    start[order] = prefix_lengths[owner[order]] + before - first[owner[order]]
    width = max(_row_lengths(shared.prefixes, shared.owner, shared.suffixes))

    rows = torch.cat([torch.arange(len(shared.prefixes)).repeat_interleave(prefix_lengths),
                      owner.repeat_interleave(suffix_lengths)])
    columns = torch.cat([concatenated_ranges(torch.zeros_like(prefix_lengths), prefix_lengths),
                         concatenated_ranges(start, suffix_lengths)])
    # rotary positions: the prefix from 0, each suffix from its prefix's length, as in the whole sequence
    positions = torch.cat([concatenated_ranges(torch.zeros_like(prefix_lengths), prefix_lengths),
                           concatenated_ranges(prefix_lengths[owner], suffix_lengths)])
    branches = torch.cat([torch.full((int(prefix_lengths.sum()),), -1, dtype=torch.long),
                          torch.arange(len(owner)).repeat_interleave(suffix_lengths)])
    flat = rows * width + columns
    ids = torch.zeros(len(shared.prefixes) * width, dtype=torch.long).index_copy_(
        0, flat, torch.cat([*shared.prefixes, *shared.suffixes]))
    position_ids = torch.zeros_like(ids).index_copy_(0, flat, positions)
    # per token: -1 on the prefix (the trunk), the sample's index on its suffix, -2 on the padding
    branch = torch.full_like(ids, -2).index_copy_(0, flat, branches).view(len(shared.prefixes), width)
    # key k is visible from query q when it is not later and lies on the trunk or on q's own branch
    # (padding sees earlier padding, itself included, so no row of the mask is empty)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = (causal & ((branch.unsqueeze(1) == -1) | (branch.unsqueeze(1) == branch.unsqueeze(2)))).unsqueeze(1)
    if getattr(base.config, "_attn_implementation", None) == "eager":  # eager adds the mask to the scores
        mask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    step = torch.arange(suffix_len)
    where = (owner * width + start).unsqueeze(1) + step  # flat index of each suffix position
    where = where.masked_fill_(step >= suffix_lengths.unsqueeze(1), 0)
    out = net(input_ids=ids.view(len(shared.prefixes), width).to(device), attention_mask=mask.to(device),
              position_ids=position_ids.view(len(shared.prefixes), width).to(device), use_cache=False)
    out = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return out.reshape(-1, out.shape[-1]).index_select(0, where.reshape(-1).to(out.device)).view(
        len(shared.suffixes), suffix_len, -1)


def _two_passes(model, net, whole_logits: bool, shared: SharedPrompts, ids, device):
    """The ``two_passes`` layout: ``[N, S, ...]`` outputs of the suffixes run against the prefixes' gathered cache."""
    import torch
    from transformers.cache_utils import DynamicCache

    base = base_model(model)
    cache_kwarg, keep = _cache_kwarg(base if whole_logits else net)
    prefix_ids = torch.nn.utils.rnn.pad_sequence(list(shared.prefixes), batch_first=True)
    prefix_len, suffix_len = prefix_ids.shape[1], ids.shape[1]
    prefix_lengths = torch.tensor([len(p) for p in shared.prefixes], dtype=torch.long)
    suffix_lengths = torch.tensor([len(s) for s in shared.suffixes], dtype=torch.long)
    prefix_mask = (torch.arange(prefix_len) < prefix_lengths.unsqueeze(1)).long()
    owner = torch.tensor(shared.owner, dtype=torch.long)
    starts = prefix_lengths[owner]
    mask = torch.cat([prefix_mask[owner], (torch.arange(suffix_len) < suffix_lengths.unsqueeze(1)).long()], dim=1)
    positions = starts.unsqueeze(1) + torch.arange(suffix_len).unsqueeze(0)

    cache = DynamicCache(config=base.config)
    extra = {"logits_to_keep": 1} if whole_logits and keep else {}
    first = net(input_ids=prefix_ids.to(device), attention_mask=prefix_mask.to(device), use_cache=True,
                **{cache_kwarg: cache}, **extra)
    if cache.get_seq_length() != prefix_len:
        raise RuntimeError(f"prompt sharing: the prefix pass cached {cache.get_seq_length()} of {prefix_len} "
                           f"positions ({type(base).__name__} does not fill a key/value cache here)")
    cache.batch_select_indices(owner.to(device))
    out = net(input_ids=ids, attention_mask=mask.to(device), position_ids=positions.to(device), use_cache=True,
              **{cache_kwarg: cache})
    if not whole_logits:
        return out.last_hidden_state
    if torch.is_grad_enabled() and first.logits.requires_grad:
        # The prefix pass's logits feed nothing, so no gradient reaches its last layer's output and FSDP2's
        # pre-backward hook there (which gathers the layer's parameters) would never run before the backward
        # through that layer's cached keys and values. A zero-weighted term makes it run; the values are unchanged.
        return out.logits + 0.0 * first.logits.sum()
    return out.logits


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
