"""The tool-call parsers of ``--generate-tool-call-parser`` against hand-written model output."""

from __future__ import annotations

import pytest

from furlong.hooks import PluginError
from furlong.kit.tool_parsers import KNOWN_PARSERS, ParsedTurn, ToolCall, parse_tool_calls, tool_call_parser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "units": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "get_year", "parameters": {"type": "object", "properties": {}}}},
]
PARIS = ToolCall("get_weather", {"city": "Paris", "days": 3})


@pytest.mark.parametrize("parser", ["qwen25", "qwen", "hermes"])
def test_qwen_and_hermes_tagged_json(parser):
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_year", "arguments": {}}\n</tool_call><|im_end|>')
    assert parse_tool_calls(text, TOOLS, parser) == ParsedTurn((PARIS, ToolCall("get_year", {})))
    assert parse_tool_calls("The answer is 4.", TOOLS, parser) == ParsedTurn(())


def test_qwen_drops_unknown_tools_and_bad_json():
    text = ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}</tool_call>'  # one } short
            '<tool_call>{"name": "get_year", "arguments": "{}"}</tool_call>')  # arguments as a JSON string
    assert parse_tool_calls(text, TOOLS, "qwen25") == ParsedTurn((ToolCall("get_year", {}),), dropped=2)


def test_llama3_json_tool_calls():
    one = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}<|eom_id|>'
    assert parse_tool_calls(one, TOOLS, "llama3") == ParsedTurn((PARIS,))
    # the tag is a special token SGLang's text leaves out: a turn that starts with JSON is a call too
    two = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; {"name": "get_year", "parameters": {}}'
    assert parse_tool_calls(two, TOOLS, "llama3") == ParsedTurn((PARIS, ToolCall("get_year", {})))
    array = '[{"name": "get_year", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'
    assert parse_tool_calls(array, TOOLS, "llama3") == ParsedTurn((ToolCall("get_year", {}), PARIS))
    assert parse_tool_calls("It is sunny in Paris.", TOOLS, "llama3") == ParsedTurn(())


def test_mistral_both_forms():
    listed = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]</s>'
    assert parse_tool_calls(listed, TOOLS, "mistral") == ParsedTurn((PARIS,))
    named = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_year[ARGS]{}'
    assert parse_tool_calls(named, TOOLS, "mistral") == ParsedTurn((PARIS, ToolCall("get_year", {})))
    assert parse_tool_calls("No tools needed.", TOOLS, "mistral") == ParsedTurn(())


def test_qwen3_coder_parameters_follow_the_schema():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=units>\n{\"t\": \"C\"}\n</parameter>\n</function>\n"
            "</tool_call>")
    assert parse_tool_calls(text, TOOLS, "qwen3_coder") == ParsedTurn(
        (ToolCall("get_weather", {"city": "Paris", "days": 3, "units": {"t": "C"}}),))
    # a string parameter stays text even when it reads as a number
    text = "<tool_call><function=get_weather><parameter=city>2026</parameter></function></tool_call>"
    assert parse_tool_calls(text, TOOLS, "qwen3_coder") == ParsedTurn((ToolCall("get_weather", {"city": "2026"}),))


def test_an_unknown_parser_name_is_one_error_listing_the_known_ones():
    known = "qwen25, qwen, hermes, llama3, mistral, qwen3_coder"
    assert ", ".join(KNOWN_PARSERS) == known
    with pytest.raises(PluginError) as info:
        tool_call_parser("qwen2.5")
    assert str(info.value) == f"--generate-tool-call-parser qwen2.5: unknown tool-call parser; the parsers furlong has: {known}."
    with pytest.raises(PluginError) as info:
        tool_call_parser("glm47")
    assert str(info.value) == ("--generate-tool-call-parser glm47: SGLang's 'glm47' parser is not written for furlong "
                               f"yet; the parsers furlong has: {known}.")
