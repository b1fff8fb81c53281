"""Answer extraction helpers shared by the core's ``boxed_<name>`` rule and reward plugins."""

from __future__ import annotations

import re

__all__ = ["last_boxed", "last_boxed_content", "stated_answer"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> tuple[int, int, str] | None:
    """Find the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text`` with balanced braces.

    Also accepts ``\\boxed 5`` (a space and one token, as some models write it).

    :returns: ``(start, end, content)`` of the last complete box, or None when there is
        none or its braces never close (a truncated response).
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    while start >= 0:
        found = _parse_box_at(text, start)
        if found is not None:
            return found
        start = max(text.rfind(cmd, 0, start) for cmd in _BOX_COMMANDS)
    return None


def last_boxed_content(text: str) -> str | None:
    """Content of the last complete ``\\boxed{}``/``\\fbox{}`` of ``text``, or None."""
    found = last_boxed(text)
    return None if found is None else found[2]


def _parse_box_at(text: str, start: int) -> tuple[int, int, str] | None:
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    if text.startswith(" ", i):
        rest = text[i + 1 :]
        token = rest.split("$", 1)[0].split()[0] if rest.strip() else ""
        return (start, i + 1 + len(token), token) if token else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return start, j + 1, text[i + 1 : j]
    return None


# "Answer: X" / "Final answer: X" / "**Answer:** X" at the start of a line (X up to the line's end)
_ANSWER_LINE = re.compile(r"(?im)^[ \t>*_#-]*(?:final\s+)?answer\s*(?:\*\*|__)?\s*[:\uff1a]\s*(?:\*\*|__)?(.+?)\s*$")
# "the answer is X" / "the final answer is: X" (X up to the end of its sentence or line)
_ANSWER_PHRASE = re.compile(r"(?i)\bthe\s+(?:final\s+)?answer\s+is\s*:?\s*(.+)")
_SENTENCE_END = re.compile(r"(?<![\d\\])\.(?=\s|$)|\.(?=\s+[A-Z])|[\n;]|(?<=\$)\s*,")
_MATH_SPAN = re.compile(r"(?<!\\)\$\$(.+?)(?<!\\)\$\$|(?<!\\)\$(.+?)(?<!\\)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)
_NUMBER_THEN_WORDS = re.compile(r"(-?\$?\d[\d,]*(?:\.\d+)?%?)\s+[A-Za-z][A-Za-z ]*")
_GROUPED = re.compile(r"-?\d{1,3}(?:(?:,|\{,\})\d{3})+(?:\.\d+)?")
_WORD = re.compile(r"(?<!\\)\b[A-Za-z]{3,}\b")
_END_MARKERS = re.compile(r"(?:\s*<\|?/?[\w.-]+\|?>)+\s*$")  # "</s>", "<|im_end|>" left by the decoder


def stated_answer(text: str) -> str | None:
    """The final answer a response states in words, for responses without a ``\\boxed{}``.

    Two forms are read; when both occur, the one that comes last in the text wins:

    - a line starting with ``Answer:`` or ``Final answer:`` (markdown bold, a quote marker or
      a full-width colon allowed), up to the end of that line;
    - ``the answer is X`` or ``the final answer is X`` (Minerva's "Final Answer: The final
      answer is $X$. I hope it is correct." included), up to the end of its sentence.

    The captured text is cleaned: end-of-sequence markers the decoder left (``</s>``,
    ``<|im_end|>``) removed, the content of its last ``$...$``, ``$$...$$``,
    ``\\(...\\)`` or ``\\[...\\]`` span when it has one (the rest is prose), a trailing
    period and markdown emphasis removed, a number followed by words kept as the number
    (``12 apples`` -> ``12``), and the commas of a digit-grouped number dropped
    (``1,000`` and ``1{,}000`` -> ``1000``). Outside a math span, text holding a word of
    three or more letters is prose, not an answer (``not 12, it's 13``), unless it is that
    one word (``yes``, ``Monday``).

    :param text: the response.
    :returns: the answer as a string (LaTeX kept for the grader to parse), or None when the
        response states no answer in one of these forms.
    """
    found = [(m.start(), m.group(1)) for m in _ANSWER_LINE.finditer(text)]
    found += [(m.start(), _SENTENCE_END.split(m.group(1), 1)[0]) for m in _ANSWER_PHRASE.finditer(text)]
    for _, raw in sorted(found, reverse=True):
        answer = _clean_stated(raw)
        if answer:
            return answer
    return None


def _clean_stated(raw: str) -> str | None:
    raw = _END_MARKERS.sub("", raw)
    inner = _ANSWER_PHRASE.search(raw)  # "Final Answer: The final answer is $5$. I hope ..."
    if inner:
        raw = _SENTENCE_END.split(inner.group(1), 1)[0]
    spans = [next(g for g in m.groups() if g is not None) for m in _MATH_SPAN.finditer(raw)]
    s = spans[-1] if spans else raw
    s = s.strip().strip("*_").strip().rstrip(".").strip()
    boxed = last_boxed_content(s)
    if boxed is not None:
        s = boxed.strip()
    if not spans:
        number = _NUMBER_THEN_WORDS.fullmatch(s)
        if number:
            s = number.group(1)
        if _WORD.search(s) and not _WORD.fullmatch(s):  # prose, not an answer ("not 12, it's 13")
            return None
    if _GROUPED.fullmatch(s.lstrip("\\$")):
        s = s.replace("{,}", "").replace(",", "")
    return s or None
