"""DAPO reward: ``Answer: X`` in the response's tail, compared as a normalized string with an
integer label (Yu et al. 2025, DAPO; Minerva normalization, Lewkowycz et al. 2022)."""

from __future__ import annotations

import re
from typing import Any

from furlong.hooks import PluginError, hookimpl

from ._normalize import normalize_final_answer

__all__ = ["boxed_response", "reward", "score_response"]

TAIL_CHARS = 300
INVALID = "[INVALID]"
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


@hookimpl
def reward(config, samples):
    """Score each sample +1.0 when its final ``Answer:`` equals its integer label, else -1.0.

    Per sample:

    1. Only the last 300 characters of the response are read; the prediction is the text
       after the last ``Answer:`` there (case-insensitive, up to the end of its line), or
       ``[INVALID]`` when there is none.
    2. Prediction and label are normalized (:func:`normalize_final_answer`: text after the
       last ``=``, ``\\boxed``/``\\text{}``/``$`` and unit words removed, ``\\frac12``
       expanded, ``1,000`` -> ``1000``); the label is then cast with ``str(int(float(.)))``.
    3. Correct iff the two strings are equal (``12.0`` as a prediction does not equal 12).

    Flags: ``--reward-key score`` is needed so the core trains on the ``score`` entry.

    :param samples: finished samples; ``response`` (str) and ``label`` (int, float or
        numeric string) are read.
    :returns: one dict per sample: ``{"score": 1.0 or -1.0, "acc": bool, "pred": str}``.
    :raises PluginError: a label that is not a number (the message names the sample).

    Reference: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale" (rule-based reward modeling, sec. 2.4); Lewkowycz et al. 2022 (Minerva) normalization.
    """
    return [score_response(s.response or "", _integer_label(s.label, s.index)) for s in samples]


def boxed_response(content: str) -> str:
    """The response ``boxed_dapo`` hands to this grader: ``Answer: content``."""
    return "Answer: " + content


def score_response(response: str, label: str) -> dict:
    """DAPO's score of ``response`` against an already-cast integer ``label`` string."""
    found = _ANSWER_LINE.findall(response[-TAIL_CHARS:])
    pred = normalize_final_answer(found[-1]) if found else INVALID
    correct = pred == label
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def _integer_label(label: Any, index: int | None) -> str:
    try:
        return str(int(float(normalize_final_answer(str(label)))))
    except (ValueError, OverflowError) as exc:
        raise PluginError(
            f"reward 'dapo': sample {index} has label {label!r}, which is not a number; dapo compares "
            "integer answers (the label is cast with int(float(label))). Use --rm-type math for "
            "non-integer answers."
        ) from exc
