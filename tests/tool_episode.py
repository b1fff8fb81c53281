"""A two-turn tool episode with a real model: the scripted model, its chat template, its tools, the tokens by hand.

The model is a real one-layer Llama whose weights make it write a fixed script word by word
(:func:`tiny_model.build_script_model`); its chat template renders tool results as Qwen's do
(``<tool_response>`` inside a turn) and opens the assistant turn after them with ``answer:``, so
the scripted model calls ``get_year`` once (Qwen 2.5's ``<tool_call>`` JSON form, parser
``qwen25``) and then answers. Used by tests/test_multi_turn_tools.py and
benchmarks/multi_turn_tools_gpu.py.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import build_script_model  # noqa: E402

TEMPLATE = (
    "{%- if tools %}<|im_start|> system tools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|> "
    "{% endif -%}"
    "{%- for m in messages %}<|im_start|> {{ m.role }} "
    "{% if m.role == 'tool' %}<tool_response> {{ m.content }} </tool_response>{% else %}{{ m.content }}{% endif %}"
    " <|im_end|> {% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|> assistant"
    "{% if messages[-1].role == 'tool' %} answer:{% endif %}{% endif %}"
)
CALL = ["<tool_call>", '{"name":', '"get_year",', '"arguments":', "{}}", "</tool_call>"]
SCRIPT = {"assistant": CALL[0], **dict(zip(CALL, CALL[1:])), "answer:": "2026"}
TOOLS_MODULE = textwrap.dedent('''
    import json

    TOOLS = [{"type": "function", "function": {"name": "get_year", "description": "the year",
                                               "parameters": {"type": "object", "properties": {}}}}]
    CALLS = []

    async def execute(name, params):
        CALLS.append((name, params))
        return json.dumps({"year": 2026})

    NOT_A_LIST = 3

    def abort_while_running(name, params):
        """The rollout aborts its leftovers while this call runs."""
        from furlong.builtin_plugins.generate import multi_turn

        multi_turn.abort(config=None, rollout_id=0)
        return json.dumps({"year": 2026})
''')
PROMPT = [{"role": "user", "content": "year?"}]


def build_tool_model(path, strength: float = 2.0, hidden: int | None = None):
    """Save the scripted model to ``path``; ``strength`` 8 makes the script win at temperature 1 too."""
    return build_script_model(path, SCRIPT, eos="<|im_end|>", chat_template=TEMPLATE, strength=strength, hidden=hidden,
                              extra_words=["<|im_start|>", "system", "tools:", "get_year", "user", "year?", "tool",
                                           "<tool_response>", "</tool_response>", '{"year":', "2026}"])


def expected(tokenizer):
    """The episode by hand: prompt, the call, the tool turn and the next opening, the answer."""
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = ids("<|im_start|> system tools: get_year <|im_end|> <|im_start|> user year? <|im_end|> "
                 "<|im_start|> assistant")
    call = ids(" ".join(CALL) + " <|im_end|>")
    tool = ids('<|im_start|> tool <tool_response> {"year": 2026} </tool_response> <|im_end|> '
               "<|im_start|> assistant answer:")
    answer = ids("2026 <|im_end|>")
    return prompt, call, tool, answer
