"""DeepScaleR reward: the boxed answer after the reasoning marker, graded against the label
(DeepScaleR, Luo et al. 2025; MATH normalization, Hendrycks et al. 2021; math-verify)."""

from __future__ import annotations

import logging
from typing import Any

from furlong.hooks import hookimpl
from furlong.kit.answers import last_boxed_content

from ._grading import grading_stats, score_pairs
from ._normalize import label_answer

__all__ = ["boxed_response", "grading_stats", "reward", "solution_text"]

log = logging.getLogger(__name__)

THINK_END = "</think>"
RESPONSE_MARKER = "###Response"

_warned_no_marker = False


@hookimpl
async def reward(config, samples):
    """Score each sample 1 when the boxed answer of its final solution equals its label.

    Per sample:

    1. The solution is the text after the last ``</think>``; without one, the text after the
       last ``###Response`` (the last, not the first: a repeated marker must not make a
       middle segment graded); without either marker the sample scores 0, and a warning is
       logged once per process: a model that writes neither marker always scores 0, and
       ``--rm-type math`` (the last box of the whole response) is usually what a
       non-thinking model needs.
    2. The answer is the content of the solution's last ``\\boxed{}``/``\\fbox{}``; none scores 0.
    3. A label that is ``None`` or blank scores 0; otherwise it is stringified and a
       ``\\boxed{}`` inside it is unwrapped.
    4. 1 when the MATH-normalized strings are equal or math-verify finds the answers
       mathematically equal; a comparison past its time-out scores 0.

    Flags: none.

    :param samples: finished samples; ``response`` (str) and ``label`` (any) are read.
    :returns: one int per sample, 1 or 0, in order.

    Reference: DeepScaleR (Luo et al. 2025, agentica-project/rllm), its rule-based math
    reward; Hendrycks et al. 2021 (MATH) normalization; math-verify for equivalence.
    """
    return await score_pairs([_answer_and_label(s.response or "", s.label) for s in samples])


def boxed_response(content: str) -> str:
    """The response ``boxed_deepscaler`` hands to this grader: ``</think>\\boxed{content}``.

    The end-of-thinking marker is included because this grader reads only the text after
    one; a bare ``\\boxed{content}`` would always score 0.
    """
    return THINK_END + "\\boxed{" + content + "}"


def solution_text(response: str) -> str | None:
    """Text after the last ``</think>``, else after the last ``###Response``, else None."""
    for marker in (THINK_END, RESPONSE_MARKER):
        at = response.rfind(marker)
        if at >= 0:
            return response[at + len(marker):]
    return None


def _answer_and_label(response: str, label: Any) -> tuple[str, str] | None:
    solution = solution_text(response)
    if solution is None:
        if response.strip():
            _warn_no_marker()
        return None
    answer = last_boxed_content(solution)
    if answer is None or label is None or not str(label).strip():
        return None
    return answer, label_answer(label)


def _warn_no_marker() -> None:
    global _warned_no_marker
    if not _warned_no_marker:
        _warned_no_marker = True
        log.warning(
            "reward 'deepscaler': a response has neither '%s' nor '%s'; deepscaler grades only the "
            "text after one of them, so such responses always score 0. For a model that does not "
            "write these markers use --rm-type math (grades the last \\boxed{} of the whole response).",
            THINK_END, RESPONSE_MARKER,
        )
