"""Sampling parameters and the per-token sampling math of the embedded engine.

Order of operations for one request at one decode step (the usual top-k, then top-p
order of SGLang and Hugging Face samplers): logits / temperature, stop tokens banned
while fewer than ``min_new_tokens`` tokens exist, top-k, top-p nucleus (Holtzman et al.,
2020, "The Curious Case of Neural Text Degeneration", sec. 3.1), then a draw from the
renormalized distribution. Temperature 0 is greedy (argmax). Every request of a batch is
sampled at once on the model's device (:func:`sample_batch`).

The draw is inverse-CDF sampling with a uniform number that depends only on the request's
seed and the index of the token being drawn (a counter-based hash, SplitMix64's
finalizer: Steele, Lea and Flood, 2014, "Fast splittable pseudorandom number
generators"), so a request samples the same tokens whatever else shares its batch and
whichever slot it runs in.

Reported log-prob: ``log_softmax(logits / T)[token]`` over the full vocabulary, before
the ban, top-k and top-p (for greedy, ``T = 1``). That is what SGLang reports and what
the trainer recomputes from the same scaled logits, so ``exp(train - rollout)`` is 1 on-policy.
"""

from __future__ import annotations

from typing import Any

import attrs

from furlong.hooks import PluginError

__all__ = ["SamplingParams", "filter_logits", "inverse_cdf", "sample_batch", "uniform_from_counter"]


@attrs.define
class SamplingParams:
    """The SGLang ``sampling_params`` keys the engine honours (others are ignored).

    ``temperature`` >= 0 (0 = greedy); ``top_p`` in (0, 1]; ``top_k`` -1 (off) or >= 1;
    ``max_new_tokens`` >= 0 and ``min_new_tokens`` >= 0 tokens; ``stop`` strings;
    ``stop_token_ids``; ``ignore_eos``; ``skip_special_tokens`` (for ``text`` and stop
    strings); ``sampling_seed`` (None: drawn from torch's global generator per request).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: list[str] = attrs.field(factory=list)
    stop_token_ids: list[int] = attrs.field(factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> "SamplingParams":
        """Parse an SGLang-style dict; None values mean "default".

        :raises PluginError: a value out of range (the message names the key).
        """
        params = {k: v for k, v in (params or {}).items() if v is not None}
        stop = params.get("stop", [])
        out = cls(
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=int(params.get("top_k", -1)),
            max_new_tokens=int(params.get("max_new_tokens", 128)),
            min_new_tokens=int(params.get("min_new_tokens", 0)),
            stop=[stop] if isinstance(stop, str) else [s for s in stop if s],
            stop_token_ids=[int(t) for t in params.get("stop_token_ids", [])],
            ignore_eos=bool(params.get("ignore_eos", False)),
            skip_special_tokens=bool(params.get("skip_special_tokens", True)),
            sampling_seed=None if params.get("sampling_seed") is None else int(params["sampling_seed"]),
        )
        checks = [
            ("temperature", out.temperature >= 0, ">= 0 (0 = greedy)"),
            ("top_p", 0 < out.top_p <= 1, "in (0, 1]"),
            ("top_k", out.top_k == -1 or out.top_k >= 1, "-1 (off) or >= 1"),
            ("max_new_tokens", out.max_new_tokens >= 0, ">= 0"),
            ("min_new_tokens", out.min_new_tokens >= 0, ">= 0"),
        ]
        for key, ok, rule in checks:
            if not ok:
                raise PluginError(f"embedded engine: sampling_params['{key}'] = {getattr(out, key)!r} must be {rule}.")
        return out


def filter_logits(logits, top_k, top_p):
    """Set to ``-inf`` every logit outside the top-k and outside the top-p nucleus, row by row.

    :param logits: float tensor ``[B, V]`` or ``[V]`` (already temperature-scaled).
    :param top_k: keep the ``top_k`` largest of a row (-1 or >= V = all); an int or an
        int tensor ``[B]``.
    :param top_p: keep the smallest set of most likely tokens (of the top-k) whose
        probabilities sum to at least ``top_p`` (the most likely token is always kept;
        1 = all); a float or a float tensor ``[B]``.
    :returns: a new float tensor of the shape of ``logits``.
    """
    import torch

    rows = logits.reshape(-1, logits.shape[-1])
    n, vocab = rows.shape
    k = torch.as_tensor(top_k, device=rows.device).reshape(-1).expand(n)
    k = torch.where((k > 0) & (k < vocab), k, torch.full_like(k, vocab))
    p = torch.as_tensor(top_p, dtype=rows.dtype, device=rows.device).reshape(-1).expand(n)
    ordered, order = torch.sort(rows, dim=-1, descending=True)
    drop = torch.arange(vocab, device=rows.device)[None, :] >= k[:, None]
    ordered = ordered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
    drop = (before >= p[:, None]) & (p[:, None] < 1.0)
    drop[:, 0] = False
    kept = torch.full_like(rows, float("-inf")).scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return kept.reshape(logits.shape)


_MIX1 = 0xBF58476D1CE4E5B9 - 2**64  # SplitMix64 constants as signed 64-bit integers
_MIX2 = 0x94D049BB133111EB - 2**64
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64


def _shift_right(x, bits: int):
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def uniform_from_counter(seeds, counters):
    """One float32 in (0, 1) per row, a function of ``(seed, counter)`` only.

    :param seeds: int64 tensor ``[B]``; :param counters: int64 tensor ``[B]`` (the index of
        the token being drawn). Uses 24 bits of SplitMix64's finalizer of
        ``seed * golden + counter`` (64-bit wrap-around arithmetic).
    """
    import torch

    z = seeds * _GOLDEN + counters
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 40).to(torch.float32) + 0.5) * 2.0**-24


def sample_batch(logits, temperature, greedy, seeds, counters, *, top_k=None, top_p=None, banned=None):
    """Choose the next token of every row and its reported log-prob, without leaving the device.

    :param logits: ``[B, V]``, raw logits of each row's last position: float32, or the model's dtype
        (bfloat16), which the first division promotes, so everything is computed in float32.
    :param temperature: float32 ``[B]`` (1 for greedy rows); :param greedy: bool ``[B]``.
    :param seeds: and :param counters: int64 ``[B]`` (see :func:`uniform_from_counter`).
    :param top_k: int64 ``[B]`` and :param top_p: float32 ``[B]``, or None when no row filters.
    :param banned: bool ``[B, V]`` (stop tokens before ``min_new_tokens``), or None; banned
        tokens cannot be chosen but count in the reported log-prob.
    :returns: ``(tokens int64 [B], log_probs float32 [B])`` with
        ``log_prob = log_softmax(logits / T)[token]``.
    """
    import torch

    scaled = logits / temperature[:, None]
    log_probs = torch.log_softmax(scaled, dim=-1)
    allowed = scaled if banned is None else scaled.masked_fill(banned, float("-inf"))
    best = torch.argmax(allowed, dim=-1)
    if top_k is not None:
        allowed = filter_logits(allowed, top_k, top_p)
    probs = log_probs.exp() if allowed is scaled else torch.softmax(allowed, dim=-1)
    drawn = inverse_cdf(probs, uniform_from_counter(seeds, counters))
    tokens = torch.where(greedy, best, drawn)
    return tokens, log_probs.gather(-1, tokens[:, None])[:, 0]


def inverse_cdf(probs, u, block: int = 1024):
    """Per row, the first index whose cumulative probability exceeds ``u * total``.

    Two levels, so no scan runs over the whole vocabulary: the row's mass per block of
    ``block`` tokens, the block where ``u`` falls (a scan over ``V / block`` sums), then a
    scan inside that block only. A vocabulary of at most ``block`` tokens is a single block.

    :param probs: float32 ``[B, V]``, non-negative (need not sum to 1); :param u: ``[B]`` in (0, 1).
    :returns: int64 ``[B]``; a token of zero probability is never chosen.
    """
    import torch

    rows, vocab = probs.shape
    block = min(block, vocab)  # a small vocabulary is one block, not padded to ``block`` columns
    padded = torch.nn.functional.pad(probs, (0, (-vocab) % block)).view(rows, -1, block)
    sums = padded.sum(-1)
    cdf = sums.cumsum(-1)
    target = u * cdf[:, -1]
    chosen = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=cdf.shape[1] - 1)
    before = cdf.gather(1, chosen) - sums.gather(1, chosen)
    mass = padded.gather(1, chosen[:, :, None].expand(rows, 1, block))[:, 0]
    inner = mass.cumsum(-1) + before
    found = torch.searchsorted(inner, target[:, None], right=True)[:, 0]
    # rounding can leave the target past the block's last entry: take its last token of non-zero mass
    last = torch.where(mass > 0, torch.arange(block, device=probs.device), -1).max(-1).values.clamp_(min=0)
    offset = torch.where(found < block, found, last)
    token = (chosen[:, 0] * block + offset).clamp_(max=vocab - 1)
    return token
