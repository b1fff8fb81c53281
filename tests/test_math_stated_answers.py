"""The ``math`` reward on responses without a box: ``Answer: X`` lines and ``the answer is X``
sentences, checked against human grades of MATH-style responses (tests/data)."""

import asyncio
import json
from pathlib import Path

import pytest

from furlong.builtin_plugins.rewards._normalize import label_answer, normalize_math_answer
from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import Sample
from furlong.kit.answers import last_boxed_content, stated_answer

from .configs import flag_defaults

GRADED = Path(__file__).parent / "data" / "math_graded_responses.jsonl"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 12.", "12"),
        ("so the answer is 1,000 apples.", "1000"),
        ("Answer: $\\frac{3}{4}$", "\\frac{3}{4}"),
        ("**Answer:** 3.5", "3.5"),
        ("Final Answer: The final answer is $5$. I hope it is correct.", "5"),
        ("Thus the answer is $x = 5$, as required.", "x = 5"),
        ("the answer is 3.14.", "3.14"),
        ("Answer: \\(2\\sqrt{3}\\)", "2\\sqrt{3}"),
        ("The answer is (1, 2).", "(1, 2)"),
        ("The answer is $\\$2{,}500$.", "\\$2500"),
        ("Answer: 1{,}024{,}000", "1024000"),
        ("The answer is 5. Next we check.", "5"),
        ("the answer is yes", "yes"),
        ("Answer: 5 cm", "5"),
        ("The answer is 42 </s>", "42"),
        ("Answer: $7$<|im_end|>", "7"),
        # the last statement wins
        ("I first thought the answer is 5.\nAnswer: 6", "6"),
        ("Answer: 6\nWait, the answer is 7.", "7"),
        # prose is not an answer
        ("The answer is not 12, it's 13.", None),
        ("The answer is what we get after simplifying.", None),
        ("The total is 12.", None),
        ("", None),
    ],
)
def test_stated_answer(text, expected):
    assert stated_answer(text) == expected


def _graded():
    return [json.loads(line) for line in GRADED.read_text().splitlines()]


def test_math_reward_agrees_with_human_grades_well_above_exact_match():
    rows = _graded()
    assert len(rows) >= 70 and 0.4 < sum(r["human"] for r in rows) / len(rows) < 0.8
    pm = get_plugin_manager()
    scores = asyncio.run(pm.call_chosen(
        "reward", "math", "--rm-type", config=flag_defaults(),
        samples=[Sample(response=r["response"], label=r["label"]) for r in rows]))
    # exact match: the last box's content equals the label as a string (after MATH normalization
    # for the second grader)
    boxed = [(last_boxed_content(r["response"]) or "").strip() for r in rows]
    exact = [int(b == r["label"].strip()) for b, r in zip(boxed, rows)]
    exact_normalized = [int(bool(b) and normalize_math_answer(b) == normalize_math_answer(label_answer(r["label"])))
                        for b, r in zip(boxed, rows)]

    def agreement(grades):
        return sum(g == r["human"] for g, r in zip(grades, rows)) / len(rows)

    disagree = [r["response"] for s, r in zip(scores, rows) if s != r["human"]]
    # the only misses: a human reads a bare final equation or sentence as the answer
    assert all(r["kind"] == "implicit" for s, r in zip(scores, rows) if s != r["human"]), disagree
    assert agreement(scores) >= 0.95
    assert agreement(exact) < 0.5 and agreement(exact_normalized) < 0.6
    # no false positives: every response the reward accepts, a human accepts
    assert all(r["human"] == 1 for s, r in zip(scores, rows) if s == 1)
