"""Tool calls in a model's text, by model family: the parsers ``--generate-tool-call-parser`` names.

Each parser reads the whole text of one assistant turn and returns the calls it holds, in
order, as :class:`ToolCall` (a tool name and its arguments as a dict). The names and formats
are SGLang's ``FunctionCallParser`` ones (``sglang/srt/function_call/``, the parsers Miles'
``miles.rollout.generate_hub.multi_turn`` hands the name to); the code is furlong's own:

- ``qwen25`` (alias ``qwen``; Qwen 2.5, Qwen3, QwQ) and ``hermes`` (Hermes 2/3): one
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block per call.
- ``llama3`` (Llama 3.1/3.2/3.3 JSON tool calling): optional text, then ``<|python_tag|>``
  or a turn that starts with ``{``/``[``, then JSON objects ``{"name": ..., "parameters":
  {...}}`` (``"arguments"`` too) separated by ``;``, or one JSON array of them.
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}``
  objects, or by ``name[ARGS]{...}`` (the newer Mistral form), once per call.
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): ``<tool_call><function=NAME><parameter=KEY>VALUE
  </parameter>...</function></tool_call>``; a value is parsed as JSON when the tool's schema
  types that parameter as anything but a string, else kept as text.

As in SGLang, a call naming a tool that is not in the tool specs is dropped, and so is a
block that is not valid JSON; :attr:`ParsedTurn.dropped` counts both.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Sequence

import attrs

from furlong.hooks.errors import PluginError

__all__ = ["KNOWN_PARSERS", "ParsedTurn", "SGLANG_ONLY_PARSERS", "ToolCall", "parse_tool_calls", "tool_call_parser"]


@attrs.frozen
class ToolCall:
    """One call: the tool's ``name`` and its ``arguments`` (the JSON object the model wrote)."""

    name: str
    arguments: dict[str, Any]


@attrs.frozen
class ParsedTurn:
    """What a parser found in one turn: the ``calls`` to run and how many it ``dropped``
    (unknown tool names, text that is not valid JSON)."""

    calls: tuple[ToolCall, ...]
    dropped: int = 0


def _tool_names(tools: Sequence[dict]) -> set[str]:
    return {(t.get("function") or t).get("name") for t in tools}


def _from_objects(objects: list[Any], tools: Sequence[dict], dropped: int) -> ParsedTurn:
    """Calls from decoded JSON values: each a ``{"name", "arguments"|"parameters"}`` object of a known tool."""
    known = _tool_names(tools)
    calls = []
    for obj in objects:
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if args is None and isinstance(obj, dict) and "arguments" not in obj and "parameters" not in obj:
            args = {}
        if not isinstance(obj, dict) or obj.get("name") not in known or not isinstance(args, dict):
            dropped += 1
            continue
        calls.append(ToolCall(obj["name"], args))
    return ParsedTurn(tuple(calls), dropped)


def _json_blocks(blocks: list[str], tools: Sequence[dict]) -> ParsedTurn:
    objects, bad = [], 0
    for block in blocks:
        try:
            objects.append(json.loads(block))
        except json.JSONDecodeError:
            bad += 1
    return _from_objects(objects, tools, bad)


_TAGGED = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _qwen25(text: str, tools: Sequence[dict]) -> ParsedTurn:
    return _json_blocks(_TAGGED.findall(text), tools)


def _json_sequence(text: str) -> tuple[list[Any], int]:
    """JSON values written one after another, separated by ``;`` (or whitespace); one array is its items."""
    decoder, objects, bad, i = json.JSONDecoder(), [], 0, 0
    text = text.strip()
    while i < len(text):
        if text[i] in "; \t\r\n":
            i += 1
            continue
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            bad += 1
            nxt = text.find("{", i + 1)
            if nxt < 0:
                break
            i = nxt
            continue
        objects.extend(value if isinstance(value, list) else [value])
    return objects, bad


def _llama3(text: str, tools: Sequence[dict]) -> ParsedTurn:
    if "<|python_tag|>" in text:
        body = text.split("<|python_tag|>", 1)[1]
    elif text.lstrip().startswith(("{", "[")):
        body = text
    else:
        return ParsedTurn(())
    for end in ("<|eom_id|>", "<|eot_id|>"):
        body = body.split(end, 1)[0]
    objects, bad = _json_sequence(body)
    return _from_objects(objects, tools, bad)


_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")


def _mistral(text: str, tools: Sequence[dict]) -> ParsedTurn:
    if "[TOOL_CALLS]" not in text:
        return ParsedTurn(())
    objects, bad = [], 0
    decoder = json.JSONDecoder()
    for part in text.split("[TOOL_CALLS]")[1:]:
        named = _MISTRAL_NAMED.match(part)
        if named:  # name[ARGS]{...}
            try:
                args, _ = decoder.raw_decode(part, named.end())
                objects.append({"name": named.group(1), "arguments": args})
            except json.JSONDecodeError:
                bad += 1
            continue
        found, wrong = _json_sequence(part.split("</s>", 1)[0])
        objects.extend(found)
        bad += wrong
    return _from_objects(objects, tools, bad)


_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)


def _qwen3_coder(text: str, tools: Sequence[dict]) -> ParsedTurn:
    schemas = {(t.get("function") or t).get("name"): (t.get("function") or t).get("parameters") or {} for t in tools}
    objects = []
    for block in _TAGGED.findall(text):
        for name, body in _FUNCTION.findall(block):
            properties = (schemas.get(name) or {}).get("properties") or {}
            args = {}
            for key, raw in _PARAMETER.findall(body):
                value = raw.strip("\n")
                kind = (properties.get(key) or {}).get("type", "string")
                if kind != "string":
                    try:
                        value = json.loads(value)
                    except json.JSONDecodeError:
                        pass  # kept as text, as the model wrote it
                args[key] = value
            objects.append({"name": name, "arguments": args})
    return _from_objects(objects, tools, 0)


_PARSERS: dict[str, Callable[[str, Sequence[dict]], ParsedTurn]] = {
    "qwen25": _qwen25,
    "qwen": _qwen25,
    "hermes": _qwen25,
    "llama3": _llama3,
    "mistral": _mistral,
    "qwen3_coder": _qwen3_coder,
}
KNOWN_PARSERS: tuple[str, ...] = tuple(_PARSERS)
"""The parser names furlong has."""

SGLANG_ONLY_PARSERS: tuple[str, ...] = (
    "apertus2509", "cohere_command4", "deepseekv3", "deepseekv31", "deepseekv32", "deepseekv4", "dots", "gemma4",
    "gigachat3", "gigachat35", "glm", "glm45", "glm47", "gpt-oss", "hunyuan", "inkling", "interns1", "k2_horizon",
    "kimi_k2", "kimi_k3", "lfm2", "ling3", "mimo", "minicpm5", "minimax-m2", "minimax-m3", "muse", "poolside_v1",
    "pythonic", "spark25", "step3", "step3p5", "trinity",
)
"""SGLang's other parser names (its ``FunctionCallParser.ToolCallParserEnum``): not written for furlong yet."""


def tool_call_parser(name: str | None, flag: str = "--generate-tool-call-parser") -> Callable[[str, Sequence[dict]], ParsedTurn]:
    """The parser called ``name``: ``parser(text, tools) -> ParsedTurn``.

    :param name: one of :data:`KNOWN_PARSERS`.
    :param flag: the flag that named it, for the message.
    :raises PluginError: no name, or a name furlong does not have (one message listing the known ones).
    """
    if name in _PARSERS:
        return _PARSERS[name]
    known = ", ".join(KNOWN_PARSERS)
    if name is None:
        raise PluginError(f"{flag} is needed: name the tool-call format of the model ({known}).")
    if name in SGLANG_ONLY_PARSERS:
        raise PluginError(f"{flag} {name}: SGLang's '{name}' parser is not written for furlong yet; "
                          f"the parsers furlong has: {known}.")
    raise PluginError(f"{flag} {name}: unknown tool-call parser; the parsers furlong has: {known}.")


def parse_tool_calls(text: str, tools: Sequence[dict], parser: str) -> ParsedTurn:
    """The calls in ``text`` (one assistant turn) under parser ``parser``, tools ``tools``
    (OpenAI tool specs, ``[{"type": "function", "function": {"name", "parameters"...}}]``).

    :raises PluginError: an unknown parser name (:func:`tool_call_parser`).
    """
    return tool_call_parser(parser)(text, tools)
