"""Sampling parameters and the per-token sampling math of the embedded engine.

Order of operations for one request at one decode step (the usual top-k, then top-p
order of SGLang and Hugging Face samplers): logits / temperature, stop tokens banned
while fewer than ``min_new_tokens`` tokens exist, top-k, top-p nucleus (Holtzman et al.,
2020, "The Curious Case of Neural Text Degeneration", sec. 3.1), then a draw from the
renormalized distribution. Temperature 0 is greedy (argmax).

Reported log-prob: ``log_softmax(logits / T)[token]`` over the full vocabulary, before
the ban, top-k and top-p (for greedy, ``T = 1``). That is what SGLang reports and what
the trainer recomputes (SPEC.md 6.1), so ``exp(train - rollout)`` is 1 on-policy.
"""

from __future__ import annotations

from typing import Any

import attrs

from furlong.hooks import PluginError

__all__ = ["SamplingParams", "filter_logits", "sample_token"]


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


def filter_logits(logits, top_k: int, top_p: float):
    """Set to ``-inf`` every logit outside the top-k and outside the top-p nucleus.

    :param logits: float tensor ``[V]`` (already temperature-scaled).
    :param top_k: keep the ``top_k`` largest (exactly that many; -1 = all).
    :param top_p: keep the smallest set of most likely tokens whose probabilities sum to
        at least ``top_p`` (the most likely token is always kept; 1 = all).
    :returns: a new float tensor ``[V]``.
    """
    import torch

    out = logits.clone()
    if 0 < top_k < out.numel():
        keep = torch.topk(out, top_k).indices
        masked = torch.full_like(out, float("-inf"))
        masked[keep] = out[keep]
        out = masked
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
        drop = before >= top_p
        drop[0] = False
        out[order[drop]] = float("-inf")
    return out


def sample_token(logits, params: SamplingParams, banned: list[int], generator) -> tuple[int, float]:
    """Choose the next token of one request and its reported log-prob.

    :param logits: float32 tensor ``[V]``, raw logits of the last position.
    :param params: the request's :class:`SamplingParams`.
    :param banned: token ids that may not be chosen now (stop tokens before
        ``min_new_tokens``); they still count in the reported log-prob.
    :param generator: the request's ``torch.Generator`` (same device as ``logits``).
    :returns: ``(token_id, log_prob)``, ``log_prob = log_softmax(logits / T)[token_id]``
        (``T = 1`` when greedy).
    """
    import torch

    greedy = params.temperature == 0
    scaled = logits if greedy else logits / params.temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    allowed = scaled.clone()
    if banned:
        allowed[torch.tensor(banned, device=allowed.device)] = float("-inf")
    if greedy:
        token = int(torch.argmax(allowed))
    else:
        allowed = filter_logits(allowed, params.top_k, params.top_p)
        probs = torch.softmax(allowed, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(log_probs[token])
