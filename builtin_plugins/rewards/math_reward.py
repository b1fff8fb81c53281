"""Math answer reward: the last ``\\boxed{}`` of the response against the label (MATH, Hendrycks et al. 2021;
equivalence by math-verify)."""

from __future__ import annotations

from typing import Any

from furlong.hooks import hookimpl
from furlong.hooks.answers import last_boxed_content

from ._grading import grading_stats, score_pairs
from ._normalize import label_answer

__all__ = ["boxed_response", "grading_stats", "reward"]


@hookimpl
async def reward(args, samples):
    """Score each sample 1 when the content of its response's last ``\\boxed{}`` equals its label.

    Per sample, in order (SPEC.md 4.2, CASES.md C018):

    1. An empty label (``None`` or a blank string) scores 0. A numeric label is a real
       answer: the integer ``0`` is graded like the string ``"0"`` (Miles tests emptiness
       with ``not label`` before stringifying, so its ``0`` label always scores 0).
    2. The label is stringified; if it holds a ``\\boxed{}``, its content is the answer.
    3. The answer is the content of the response's last complete ``\\boxed{}``/``\\fbox{}``
       (balanced braces). No box, or a box whose brace never closes (a truncated response),
       scores 0.
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
        return None  # a numeric 0 is an answer, not a missing label (CASES.md C018)
    answer = last_boxed_content(response or "")
    if answer is None:
        return None
    return answer, label_answer(label)
