"""Batched decoding with a KV cache for the embedded engine (runs in a worker thread).

One call of :func:`decode_batch` prefills a left-padded batch of prompts and decodes one
token per step for every unfinished request until all are finished. A request finishes
on a stop token ("stop"), a stop string in its decoded tail ("stop"), its token budget
("length", checked first, as SGLang does), or an abort ("abort"; the tokens so far are
kept). Each request is resolved as soon as it finishes, through ``on_finish``. Finished
rows are dropped from the batch and its KV cache once they are half of it, so a long
request at the tail decodes alone.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable

import attrs

from .sampling import SamplingParams, sample_token

__all__ = ["Request", "decode_batch"]


@attrs.define(eq=False)
class Request:
    """One ``generate`` call: its prompt, parameters, generator seed and results so far.

    ``epoch``: the engine's abort epoch at submission; the request is aborted as soon as
    the engine's epoch is larger. ``cancelled``: the caller stopped waiting. ``rid``: the
    caller's request id (``abort_request(rid)`` sets ``aborted``). ``on_token``: called
    in the decode thread with ``(token_id, log_prob)`` after each new token (streaming).
    """

    input_ids: list[int]
    params: SamplingParams
    seed: int
    epoch: int
    stop_ids: set[int]
    future: Any = None
    cancelled: bool = False
    rid: str | None = None
    aborted: bool = False
    on_token: Callable[[int, float], None] | None = None
    output_ids: list[int] = attrs.field(factory=list)
    log_probs: list[float] = attrs.field(factory=list)
    finish_reason: str | None = None


def _forward_kwargs(model) -> tuple[str, str | None]:
    """Names of the cache and logits-to-keep arguments of ``model.forward`` (transformers 4.x and 5.x)."""
    names = inspect.signature(model.forward).parameters
    cache = "cache" if "cache" in names else "past_key_values"
    keep = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in names), None)
    return cache, keep


def decode_batch(
    model,
    tokenizer,
    requests: list[Request],
    *,
    device,
    pad_id: int,
    lock: threading.Lock,
    aborted: Callable[[Request], bool],
    on_finish: Callable[[Request], None],
) -> None:
    """Generate for every request of ``requests`` (mutated in place), calling ``on_finish`` once each.

    :param model: a transformers causal LM in eval mode on ``device``.
    :param requests: requests with non-empty ``input_ids`` and ``max_new_tokens >= 1``.
    :param pad_id: token fed at padding positions and for finished rows (never attended).
    :param lock: held around every forward pass (weight updates take it between steps).
    :param aborted: tells whether a request must stop now.
    """
    import torch
    from transformers import DynamicCache

    cache_arg, keep_arg = _forward_kwargs(model)
    width = max(len(r.input_ids) for r in requests)
    ids = torch.tensor([[pad_id] * (width - len(r.input_ids)) + r.input_ids for r in requests], device=device)
    mask = torch.tensor([[0] * (width - len(r.input_ids)) + [1] * len(r.input_ids) for r in requests], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    generators = [torch.Generator(device=device).manual_seed(r.seed) for r in requests]
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56
        cache = DynamicCache()
    extra = {keep_arg: 1} if keep_arg else {}
    rows = list(range(len(requests)))  # batch row -> index into requests
    with torch.no_grad():
        while True:
            for q in rows:
                if requests[q].finish_reason is None and aborted(requests[q]):
                    _finish(requests[q], "abort", on_finish)
            live = [r for r, q in enumerate(rows) if requests[q].finish_reason is None]
            if not live:
                break
            if len(live) <= len(rows) // 2 and hasattr(cache, "batch_select_indices"):
                # drop finished rows once they are half the batch (long-tail requests decode alone)
                keep = torch.tensor(live, device=device)
                cache.batch_select_indices(keep)
                ids, mask, positions = ids[keep], mask[keep], positions[keep]
                rows = [rows[r] for r in live]
                live = list(range(len(rows)))
            with lock:
                out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            **{cache_arg: cache}, **extra)
            logits = out.logits[:, -1, :].float()
            next_ids = [pad_id] * len(rows)
            for r in live:
                req = requests[rows[r]]
                banned = sorted(req.stop_ids) if len(req.output_ids) < req.params.min_new_tokens else []
                token, log_prob = sample_token(logits[r], req.params, banned, generators[rows[r]])
                req.output_ids.append(token)
                req.log_probs.append(log_prob)
                if req.on_token is not None:
                    req.on_token(token, log_prob)
                reason = _finish_reason(req, token, tokenizer)
                if reason:
                    _finish(req, reason, on_finish)
                else:
                    next_ids[r] = token
            ids = torch.tensor(next_ids, device=device)[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1


def _finish_reason(req: Request, token: int, tokenizer) -> str | None:
    """"length", "stop" or None after ``token`` was appended (SGLang's order: budget first)."""
    p = req.params
    if len(req.output_ids) >= p.max_new_tokens:
        return "length"
    if len(req.output_ids) < p.min_new_tokens:
        return None
    if token in req.stop_ids:
        return "stop"
    if p.stop:
        window = 4 * max(len(s) for s in p.stop) + 4  # a character is at most 4 byte-level tokens
        tail = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=p.skip_special_tokens)
        if any(s in tail for s in p.stop):
            return "stop"
    return None


def _finish(req: Request, reason: str, on_finish: Callable[[Request], None]) -> None:
    req.finish_reason = reason
    on_finish(req)
