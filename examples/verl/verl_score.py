"""A reward function in verl's form, for the verl data sets of docs/from-verl.md.

verl calls a custom reward function (``custom_reward_function.path`` / ``.name``) as
``compute_score(data_source, solution_str, ground_truth, extra_info)``; furlong calls it the same way
when ``--custom-rm-path`` names it (PYTHONPATH=examples/verl ... --custom-rm-path
verl_score.compute_score). It grades the final answer: the content of the last ``\\boxed{}``, or the
number after the last ``####`` (the answer format of verl's GSM8K prompts).
"""

from __future__ import annotations

import re

_HASHES = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def final_answer(text: str) -> str | None:
    """The last ``\\boxed{...}`` content (balanced braces), else the number after the last ``####``, or None."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1:j].strip()
    found = _HASHES.findall(text)
    return found[-1] if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the response's final answer equals the ground truth (thousands separators ignored), else 0.0."""
    answer = final_answer(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if answer.replace(",", "") == str(ground_truth).replace(",", "").strip() else 0.0
