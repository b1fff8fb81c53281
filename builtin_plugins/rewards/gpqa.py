"""Multiple-choice letter reward (GPQA, Rein et al. 2023; also MMLU-style choice questions)."""

from __future__ import annotations

import re
import string
from typing import Any

from furlong.hooks import hookimpl

__all__ = ["boxed_response", "correct_letter", "extract_letter", "reward", "valid_letters"]

DEFAULT_LETTERS = tuple("ABCDEFGH")
_OPEN = r"[\s(\[{*:]*(?:\\boxed\{|\\text\{|\\textbf\{)?[\s(\[{*]*"
# "answer is (B)", "Answer: B", "final answer: **C**", "option B", "choice: D"; the keyword
# is case-insensitive, the letter must be a capital standing alone.
_NAMED = re.compile(r"(?i:answer|option|choice)(?:\s*(?i:is|:|=))?" + _OPEN + r"([A-Z])(?![A-Za-z])")
_IS_CORRECT = re.compile(r"(?<![A-Za-z\\])\(?([A-Z])\)?\s+(?i:is\s+(?:the\s+)?correct)\b")
_STANDALONE = re.compile(r"(?<![A-Za-z\\])([A-Z])(?![A-Za-z])")


@hookimpl
def reward(config, samples):
    """Score each sample 1.0 when the choice letter it picks is the correct one.

    Per sample:

    1. Only the text after the last ``</think>`` is read (the whole response without one).
    2. Valid letters: ``metadata["valid_letters"]``, else ``A``, ``B``... one per entry of
       ``metadata["choices"]``, else ``A``-``H``.
    3. The picked letter is the last valid letter named by "answer/option/choice (is/:) X"
       (``final answer: X`` included) or by "X is correct"; without any, the last
       standalone valid capital letter of the text (``\\boxed{C}`` counts).
    4. The correct letter is ``metadata["correct_letter"]``, else a one-letter label, else an
       integer label as a 0-based index into the valid letters, else the letter of the
       choice whose text equals the label (case and punctuation ignored).
    5. When both letters are known: 1.0 iff equal. When no letter is picked (or the correct
       one is unknown): 1.0 iff the normalized correct text (the label, or the correct
       choice) appears in the normalized response as whole words.

    Flags: none.

    :param samples: finished samples; ``response``, ``label`` and ``metadata`` are read.
    :returns: one float per sample, 1.0 or 0.0, in order.

    Reference: Rein et al. 2023, "GPQA: A Graduate-Level Google-Proof Q&A Benchmark".
    """
    return [_score(s.response or "", s.label, s.metadata or {}) for s in samples]


def boxed_response(content: str) -> str:
    """The response ``boxed_gpqa`` hands to this grader: ``Answer: content``."""
    return "Answer: " + content


def valid_letters(metadata: dict) -> tuple[str, ...]:
    """The letters a response may pick for this question (step 2 of :func:`reward`)."""
    given = metadata.get("valid_letters")
    if given:
        return tuple(str(x).strip().upper() for x in given)
    choices = _choices(metadata)
    if choices:
        return tuple(string.ascii_uppercase[: len(choices)])
    return DEFAULT_LETTERS


def extract_letter(text: str, letters: tuple[str, ...]) -> str | None:
    """The letter ``text`` picks (step 3 of :func:`reward`), or None."""
    named = [(m.start(), m.group(1)) for rx in (_NAMED, _IS_CORRECT) for m in rx.finditer(text)]
    for _, letter in sorted(named, reverse=True):
        if letter in letters:
            return letter
    for letter in reversed(_STANDALONE.findall(text)):
        if letter in letters:
            return letter
    return None


def correct_letter(label: Any, metadata: dict, letters: tuple[str, ...]) -> str | None:
    """The correct letter (step 4 of :func:`reward`), or None when it cannot be told."""
    given = metadata.get("correct_letter")
    if isinstance(given, str) and given.strip():
        return given.strip().upper()
    if isinstance(label, str) and len(label.strip()) == 1 and label.strip().upper() in letters:
        return label.strip().upper()
    if isinstance(label, int) and not isinstance(label, bool):
        return letters[label] if 0 <= label < len(letters) else None
    if isinstance(label, str):
        wanted = _norm(label)
        for i, choice in enumerate(_choices(metadata)):
            if i < len(letters) and _norm(str(choice)) == wanted:
                return letters[i]
    return None


def _score(response: str, label: Any, metadata: dict) -> float:
    at = response.rfind("</think>")
    text = response[at + len("</think>"):] if at >= 0 else response
    letters = valid_letters(metadata)
    picked = extract_letter(text, letters)
    right = correct_letter(label, metadata, letters)
    if picked is not None and right is not None:
        return 1.0 if picked == right else 0.0
    truth = _correct_text(label, metadata, letters, right)
    if not truth:
        return 0.0
    return 1.0 if f" {truth} " in f" {_norm(text)} " else 0.0


def _correct_text(label: Any, metadata: dict, letters: tuple[str, ...], right: str | None) -> str:
    choices = _choices(metadata)
    if right is not None and right in letters and letters.index(right) < len(choices):
        return _norm(str(choices[letters.index(right)]))
    if isinstance(label, str) and len(label.strip()) > 1:
        return _norm(label)
    return ""


def _choices(metadata: dict) -> list:
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        return list(choices.values())
    return list(choices) if choices else []


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())
