"""Token ids and a loss mask over the assistant turns of a chat conversation.

Supervised fine-tuning trains on what the assistant said, not on the system prompt, the
user's turns or tool results. :func:`assistant_loss_mask` renders a conversation with the
tokenizer's chat template and marks the tokens of each assistant turn: the turn's content
and its end-of-turn tokens, not the header the template opens it with (``<|im_start|>assistant\\n``:
what ``add_generation_prompt=True`` appends, which the model never has to produce).

Styles (``--loss-mask-type``):

- ``qwen``, ``qwen3``: the conversation is rendered prefix by prefix. Assistant turn ``i``
  spans from the end of ``messages[:i]`` rendered with the generation prompt to the end of
  ``messages[:i + 1]``. This needs a template that renders a conversation's prefix as the
  prefix of its rendering (true of Qwen 2.5, Llama 3 and most templates; Qwen3's strips the
  reasoning of earlier assistant turns, so give those turns without ``reasoning_content``);
  a template that is not is one clear error naming the turn.
- ``distill_qwen``: one prompt and one response: the first message rendered with the
  generation prompt, then the last message's content tokenized as is (all trained).

A message with ``"step_loss_mask": 0`` is kept in the tokens and not trained on.
"""

from __future__ import annotations

from typing import Any, Sequence

from furlong.hooks.errors import PluginError

__all__ = ["MASK_STYLES", "assistant_loss_mask", "response_span"]

MASK_STYLES = ("qwen", "qwen3", "distill_qwen")


def _render(tokenizer, messages: Sequence[dict], tools: list | None, generation_prompt: bool,
            template_kwargs: dict | None = None) -> list[int]:
    kwargs: dict[str, Any] = {**(template_kwargs or {}), "tokenize": True, "add_generation_prompt": generation_prompt,
                              "return_dict": False}
    if tools:
        kwargs["tools"] = tools
    ids = tokenizer.apply_chat_template(list(messages), **kwargs)
    if hasattr(ids, "get"):  # a BatchEncoding under some tokenizers
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _trained(message: dict) -> bool:
    return message.get("role") == "assistant" and message.get("step_loss_mask", 1) == 1


def assistant_loss_mask(tokenizer, messages: Sequence[dict], style: str = "qwen", tools: list | None = None,
                        where: str = "sample", template_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """``(token ids, loss mask)`` of a whole conversation: mask 1 on assistant-turn tokens, 0 elsewhere.

    :param tokenizer: a transformers tokenizer with a chat template.
    :param messages: ``[{"role": ..., "content": ...}, ...]``.
    :param style: one of :data:`MASK_STYLES`.
    :param tools: tool schemas given to the template (with the whole conversation).
    :param where: names the sample in errors.
    :param template_kwargs: extra arguments of the chat template (``{"enable_thinking": False}``).
    :raises PluginError: an unknown style, no chat template, or a template whose rendering of a
        prefix of the conversation is not a prefix of the next one's.
    """
    if style not in MASK_STYLES:
        raise PluginError(f"--loss-mask-type {style!r}: choose one of {', '.join(MASK_STYLES)}.")
    if not getattr(tokenizer, "chat_template", None):
        raise PluginError(f"{where}: the tokenizer has no chat template; the loss mask of a conversation needs one "
                          "(give --chat-template-path, or a checkpoint whose tokenizer_config.json has one).")
    if style == "distill_qwen":
        prompt = _render(tokenizer, messages[:1], tools, True, template_kwargs)
        response = [int(t) for t in tokenizer(str(messages[-1]["content"]), add_special_tokens=False)["input_ids"]]
        trained = int(messages[-1].get("step_loss_mask", 1) == 1)
        return prompt + response, [0] * len(prompt) + [trained] * len(response)
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        opened = _render(tokenizer, messages[:i], tools, True, template_kwargs) if message["role"] == "assistant" \
            else ids
        closed = _render(tokenizer, messages[: i + 1], tools, False, template_kwargs)
        if closed[: len(ids)] != ids or closed[: len(opened)] != opened:
            raise PluginError(f"{where}: message {i} ({message['role']}): the chat template does not render the "
                              f"conversation before it as a prefix of the conversation up to it, so its tokens "
                              f"cannot be told apart (--loss-mask-type {style}); a template that rewrites earlier "
                              f"turns (Qwen3 drops their reasoning_content) needs those turns without it.")
        header = len(opened) - len(ids)
        body = len(closed) - len(opened)
        mask += [0] * header + [int(_trained(message))] * body
        ids = closed
    return ids, mask


def response_span(mask: Sequence[int]) -> int:
    """The response length of a masked conversation: from the first trained token to the end (0 if none)."""
    for i, value in enumerate(mask):
        if value:
            return len(mask) - i
    return 0
