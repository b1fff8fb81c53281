"""Building one :class:`~furlong.hooks.Sample` over several engine calls (multi-turn generation).

The multi-turn contract of PLUGINS.md ("Multi-turn and tool-use `generate` plugins"): the
model's tokens get ``loss_mask`` 1 and the engine's log-probs, inserted tokens (tool output,
chat-template glue) ``loss_mask`` 0 and log-prob 0.0; ``weight_versions`` one entry per call;
the token budget ``max_new_tokens`` covers every response token, inserted ones included.
"""

from __future__ import annotations

from typing import Any, Sequence

from furlong.hooks.errors import PluginError
from furlong.hooks.types import Status

__all__ = ["FINISH_STATUS", "append_generated", "append_inserted", "appended_messages_ids", "tokens_left"]

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
"""Sample status from an engine finish reason (anything else: completed)."""


def tokens_left(sample, budget: int | None, context_cap: int | None) -> int | None:
    """How many more response tokens ``sample`` may get: ``budget - response_length``, and at most
    ``context_cap - len(tokens)`` when a context cap is set; None when neither bounds it."""
    left = None if budget is None else int(budget) - sample.response_length
    if context_cap:
        room = int(context_cap) - len(sample.tokens)
        left = room if left is None else min(left, room)
    return left


def append_generated(sample, out, tokenizer, params: dict) -> None:
    """Append one engine answer ``out`` (a :class:`~furlong.hooks.GenerateOutput`) to ``sample``.

    Its ids go to ``tokens``, its log-probs to ``rollout_log_probs``, its text (``out.text``,
    else the ids decoded with ``params["skip_special_tokens"]``) to ``response``; ``loss_mask``
    (when it is a list) gets a 1 per id; ``weight_versions`` the answer's version and, for an
    answer that straddled a weight update, ``extra["weight_version_spans"]`` its spans in
    response-token positions; ``rollout_routed_experts`` the answer's record (it covers every fed
    token); ``status`` follows the finish reason (:data:`FINISH_STATUS`).
    """
    previous, new = sample.response_length, len(out.output_ids)
    sample.tokens.extend(out.output_ids)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + list(out.output_log_probs)
    sample.response += out.text if out.text is not None else tokenizer.decode(
        out.output_ids, skip_special_tokens=bool(params.get("skip_special_tokens", False)))
    sample.response_length = previous + new
    if sample.loss_mask is not None:
        sample.loss_mask = sample.loss_mask + [1] * new
    sample.weight_versions.append(str(out.weight_version))
    if out.weight_version_spans:
        spans = [(version, previous + start, previous + end) for version, start, end in out.weight_version_spans]
        sample.extra.setdefault("weight_version_spans", []).extend(spans)
    if out.routed_experts is not None or new:  # a record that no longer covers the tokens is dropped
        sample.rollout_routed_experts = out.routed_experts
    sample.status = FINISH_STATUS.get(out.finish_reason, Status.COMPLETED)


def append_inserted(sample, ids: Sequence[int], tokenizer) -> None:
    """Append tokens the model did not generate (tool output, template glue): ``loss_mask`` 0,
    log-prob 0.0, their decoded text to ``response``. The engine never routed them, so a
    routing record (``rollout_routed_experts``) no longer covers the sample and is dropped."""
    ids = [int(t) for t in ids]
    sample.tokens.extend(ids)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + [0.0] * len(ids)
    sample.loss_mask = (sample.loss_mask or []) + [0] * len(ids)
    sample.response += tokenizer.decode(ids)
    sample.response_length += len(ids)
    if ids:
        sample.rollout_routed_experts = None


def _render(tokenizer, messages: list[dict], tools, generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                        add_generation_prompt=generation_prompt, return_dict=False)
    if hasattr(ids, "get"):  # a BatchEncoding under some tokenizers
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def appended_messages_ids(tokenizer, messages: list[dict[str, Any]], *, calls: Sequence[dict] = (),
                          tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids that the chat template puts after an assistant turn for ``messages`` (tool
    results), up to and including the next assistant turn's opening (the generation prompt).

    The template renders a stand-in conversation (a user turn, an assistant turn carrying
    ``calls``, OpenAI ``tool_calls`` entries) with and without ``messages``; the ids are what the
    second adds to the first. The same construction as Miles' ``tokenize_tool_responses``
    (``miles/rollout/generate_utils/tool_call_utils.py``). The stand-in assistant turn has a
    non-empty ``reasoning_content``: templates that drop the reasoning of all but the last
    assistant turn (Qwen3's) then render it the same way in both.

    :raises PluginError: the tokenizer has no chat template, or its rendering without
        ``messages`` is not a prefix of the one with them (the template rewrites earlier turns).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise PluginError("the tokenizer has no chat template, so tool results cannot be rendered as the model "
                          "expects them; give --chat-template-path or a checkpoint whose tokenizer has one.")
    base = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "reasoning_content": " ", "tool_calls": list(calls)}]
    without = _render(tokenizer, base, tools, False)
    with_them = _render(tokenizer, base + list(messages), tools, True)
    if with_them[:len(without)] != without:
        raise PluginError("the chat template renders a conversation differently once tool results follow it, so "
                          "the results cannot be appended to the tokens generated so far (a template that rewrites "
                          f"earlier turns): without them {tokenizer.decode(without)!r}, with them "
                          f"{tokenizer.decode(with_them)!r}.")
    return with_them[len(without):]
