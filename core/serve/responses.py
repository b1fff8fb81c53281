"""Response bodies of ``furlong serve``'s ``/generate``, in SGLang 0.5.23's shape.

One response (or one streamed chunk) is ``{"text", "output_ids", "meta_info"}``;
``meta_info`` has ``id``, ``finish_reason``, ``prompt_tokens``, ``weight_version``,
``num_retractions``, ``reasoning_tokens`` (both 0 here), ``completion_tokens``,
``cached_tokens`` (0: no prefix cache), ``e2e_latency``, ``weight_versions`` (spans
``{"version", "start", "end"}`` of output tokens, only for a request that straddled a
weight update) and, when ``return_logprob``, ``input_token_logprobs`` (the prompt's
tokens from ``logprob_start_len`` on; none by default) and ``output_token_logprobs`` as
``[logprob, token_id, text or null]`` triples (the first prompt token's logprob is
null), with ``output_token_logprobs_length``; when ``return_routed_experts``, a finished
request's ``routed_experts``: base64 of int32 ``[prompt + output - 1 - routed_experts_start_len,
num_hidden_layers, topk]`` (:func:`furlong.kit.moe.encode_routed_experts`)
(``sglang/srt/managers/tokenizer_manager.py``, ``api/v1/api_types.py``
``GenerateMetaInfo``/``LogprobEntry``). Finish reasons are SGLang's tagged objects
(``schedule_batch.py`` ``FINISH_*.to_json``): ``{"type": "stop", "matched": id or
string}``, ``{"type": "length", "length": N}``, ``{"type": "abort", "message",
"status_code", "err_type"}``.
"""

from __future__ import annotations

from typing import Any

import attrs

from furlong.kit.moe import encode_routed_experts

__all__ = ["Progress", "generate_body"]


@attrs.define
class Progress:
    """A request's output so far (streaming) or in full (finished: ``reason`` set).

    ``reason``: None while running, else ``"stop"``, ``"length"`` or ``"abort"``;
    ``abort_message`` says why an aborted request ended. ``versions``: ``(weight
    version, first output token decoded with it)`` in order, when the engine streams.
    """

    output_ids: list[int] = attrs.field(factory=list)
    log_probs: list[float] = attrs.field(factory=list)
    reason: str | None = None
    abort_message: str = "Aborted"
    versions: list[tuple[str, int]] = attrs.field(factory=list)
    input_log_probs: list = attrs.field(factory=list)  # of the prompt tokens from logprob_start_len on
    routed_experts: Any = None  # the engine's record, int [fed tokens, MoE layers, topk], once finished

    def version_spans(self) -> list[dict]:
        """SGLang's ``weight_versions``: ``[{"version", "start", "end"}]`` over the output tokens."""
        ends = [start for _, start in self.versions[1:]] + [len(self.output_ids)]
        return [{"version": v, "start": start, "end": end} for (v, start), end in zip(self.versions, ends)]


def generate_body(tokenizer: Any, item: Any, progress: Progress, *, weight_version: str, latency_s: float,
                  text_in_logprobs: bool, start: int = 0, routing: Any = None) -> dict:
    """The response (or stream chunk) for one request.

    :param item: the request's :class:`~furlong.core.serve.schema.GenerateItem`.
    :param progress: its output so far; finished when ``progress.reason`` is set.
    :param weight_version: the server's weight version now.
    :param latency_s: seconds since the request arrived (``e2e_latency``).
    :param text_in_logprobs: put each token's text in ``output_token_logprobs`` (else null).
    :param start: first output token to include in ``text``/``output_ids``/logprobs
        (incremental streaming sends only what is new; 0 = everything).
    :param routing: the engine's :class:`~furlong.kit.moe.RoutingLayout` when it records routing.
    """
    ids = progress.output_ids
    stop_strings = _stop_strings(item.sampling_params)
    finish = _finish_reason(tokenizer, item, progress, stop_strings)
    text = _text(tokenizer, item, ids, finish)
    if start:
        text = text[len(_text(tokenizer, item, ids[:start], None)):]
    meta = {
        "id": item.rid,
        "finish_reason": finish,
        "prompt_tokens": len(item.input_ids),
        "weight_version": weight_version,
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "e2e_latency": latency_s,
    }
    if len(progress.versions) > 1:  # the request straddled a weight update (SGLang: utils/weight_versions.py)
        meta["weight_versions"] = progress.version_spans()
    if item.return_logprob:
        def entry(log_prob, token):
            return [log_prob, token, tokenizer.decode([token]) if text_in_logprobs else None]

        prompt = item.input_ids[len(item.input_ids) - len(progress.input_log_probs):]
        meta["input_token_logprobs"] = [entry(lp, tok) for lp, tok in zip(progress.input_log_probs, prompt)]
        meta["output_token_logprobs"] = [entry(lp, tok) for lp, tok in zip(progress.log_probs[start:], ids[start:])]
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
    if item.return_routed_experts and progress.routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(progress.routed_experts[item.routed_experts_start_len:],
                                                       routing)
    return {"text": text, "output_ids": list(ids[start:]), "meta_info": meta}


def _stop_strings(params: dict) -> list[str]:
    stop = params.get("stop") or []
    return [stop] if isinstance(stop, str) else [s for s in stop if s]


def _finish_reason(tokenizer, item, progress: Progress, stop_strings: list[str]) -> dict | None:
    """SGLang's order: the budget, then a stop token, then a stop string."""
    if progress.reason is None:
        return None
    if progress.reason == "length":
        return {"type": "length", "length": len(progress.output_ids)}
    if progress.reason == "abort":
        return {"type": "abort", "message": progress.abort_message, "status_code": None, "err_type": None}
    last = progress.output_ids[-1]
    stop_ids = set(item.sampling_params.get("stop_token_ids") or [])
    if last not in stop_ids and stop_strings:
        tail = tokenizer.decode(progress.output_ids, skip_special_tokens=item.sampling_params.get(
            "skip_special_tokens", True))
        matched = [s for s in stop_strings if s in tail]
        if matched:
            return {"type": "stop", "matched": min(matched, key=tail.find)}
    return {"type": "stop", "matched": last}


def _text(tokenizer, item, ids: list[int], finish: dict | None) -> str:
    """Decode ``ids``; a finished request's matched stop is trimmed unless ``no_stop_trim``.

    A running request's text drops a trailing replacement character: the bytes of a
    character may still be arriving.
    """
    trim = finish is not None and finish["type"] == "stop" and not item.output_params.get("no_stop_trim", False)
    if trim and isinstance(finish["matched"], int):
        ids = ids[:-1]
    kwargs = {"skip_special_tokens": item.sampling_params.get("skip_special_tokens", True)}
    if not item.output_params.get("spaces_between_special_tokens", True):
        kwargs["spaces_between_special_tokens"] = False
    text = tokenizer.decode(ids, **kwargs)
    if trim and isinstance(finish["matched"], str):
        text = text[: text.find(finish["matched"])] if finish["matched"] in text else text
    if finish is None and text.endswith("\ufffd"):
        text = text[:-1]
    return text
