"""Math answer reward: the last ``\\boxed{}`` of the response (or, without one, the answer it
states as ``Answer: X`` or ``the answer is X``) against the label (MATH, Hendrycks et al. 2021;
equivalence by math-verify)."""

from __future__ import annotations

from typing import Any

from furlong.hooks import hookimpl
from furlong.kit.answers import last_boxed_content, stated_answer

from ._grading import grading_stats, score_pairs
from ._normalize import label_answer

__all__ = ["boxed_response", "grading_stats", "reward"]


@hookimpl
async def reward(config, samples):
    """Score each sample 1 when the final answer of its response equals its label.

    Per sample, in order:

    1. An empty label (``None`` or a blank string) scores 0. A numeric label is a real
       answer: the integer ``0`` is graded like the string ``"0"`` (Miles tests emptiness
       with ``not label`` before stringifying, so its ``0`` label always scores 0).
    2. The label is stringified; if it holds a ``\\boxed{}``, its content is the answer.
    3. The answer is the content of the response's last complete ``\\boxed{}``/``\\fbox{}``
       (balanced braces). A response with no complete box is graded on the answer it
       states in words (:func:`furlong.kit.answers.stated_answer`): the last ``Answer: X``
       / ``Final answer: X`` line or ``the answer is X`` sentence, math delimiters, a
       trailing period, unit words after a number and thousands separators removed. A
       response whose box never closes (cut off inside its answer) and one with neither form
       score 0.
    4. 1 when both are equal after MATH normalization, or when math-verify finds them
       mathematically equal (``\\frac{2}{4}`` = ``0.5``; ``1,000`` = ``1000``; ``x=5`` = ``5``);
       a comparison running past its time-out scores 0 (``grading_stats()["timeouts"]``).

    Flags: none.

    :param samples: finished samples; ``response`` (str) and ``label`` (any) are read.
    :returns: one int per sample, 1 or 0, in order.

    Reference: Hendrycks et al. 2021, "Measuring Mathematical Problem Solving With the MATH
    Dataset" (boxed answers, normalization); math-verify (Hugging Face) for equivalence.
    """
    return await score_pairs([_answer_and_label(s.response, s.label) for s in samples])


def boxed_response(content: str) -> str:
    """The response ``boxed_math`` hands to this grader: ``\\boxed{content}``."""
    return "\\boxed{" + content + "}"


def _answer_and_label(response: str, label: Any) -> tuple[str, str] | None:
    if label is None or (isinstance(label, str) and not label.strip()):
        return None  # a numeric 0 is an answer, not a missing label
    response = response or ""
    answer = last_boxed_content(response)
    if answer is None and not _opens_a_box(response):
        answer = stated_answer(response)
    if answer is None:
        return None
    return answer, label_answer(label)


def _opens_a_box(response: str) -> bool:
    # called when no box is complete: a response cut off inside its \boxed{ never stated its
    # final answer, and an "the answer is" before that box is a guess the model went on to revise
    return "\\boxed" in response or "\\fbox" in response
