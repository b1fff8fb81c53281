"""Answer normalization shared by the math-style rewards (``math``, ``deepscaler``, ``dapo``).

Two canonical forms:

- :func:`normalize_math_answer`: the MATH benchmark's string normalization (Hendrycks et
  al. 2021, "Measuring Mathematical Problem Solving With the MATH Dataset", answer
  checking): used by ``math``/``deepscaler`` as the fast exact check before math-verify.
- :func:`normalize_final_answer`: the Minerva-style normalization (Lewkowycz et al. 2022,
  "Solving Quantitative Reasoning Problems with Language Models", appendix D.1) that DAPO
  (Yu et al. 2025) compares as strings.

Both are pure string functions: they never raise on odd input and never call sympy.
"""

from __future__ import annotations

import re
from typing import Any

from furlong.kit.answers import last_boxed_content

__all__ = ["label_answer", "normalize_final_answer", "normalize_math_answer"]


def label_answer(label: Any) -> str:
    """The answer a ground-truth label stands for: ``str(label)``, stripped, with the
    content of its last ``\\boxed{}`` taken when it has one.

    Numbers are stringified (``12`` -> ``"12"``, ``0`` -> ``"0"``), so a numeric label read
    from JSON never crashes the grader; the caller decides first whether the label counts as
    missing (``None``, a blank string).
    """
    text = str(label).strip()
    inner = last_boxed_content(text)
    return text if inner is None else inner.strip()


# --- MATH (Hendrycks et al. 2021) --------------------------------------------------------

_TRAILING_UNIT = re.compile(r"\\(?:text|mbox)\{\s[^{}]*\}\s*$")
_FRAC_ARG = r"(\{[^{}]*\}|[^{}\\])"
_FRAC = re.compile(r"\\frac" + _FRAC_ARG + _FRAC_ARG)
_SQRT_BARE = re.compile(r"\\sqrt([^{\[\\])")
_INT_RATIO = re.compile(r"(-?\d+)/(\d+)")


def normalize_math_answer(text: str) -> str:
    """Canonical string of a math answer, so that trivially different spellings compare equal.

    Rules, in order: drop line breaks and ``\\!``; ``\\\\`` becomes ``\\``; ``\\tfrac`` and
    ``\\dfrac`` become ``\\frac``; ``\\left``/``\\right``, degree marks, ``\\$``, a trailing
    ``\\text{ unit}`` and percent signs are removed; ``.5`` becomes ``0.5``; ``x = 5``
    (left side of at most two characters) becomes ``5``; spaces are removed; ``\\sqrt2``
    and ``\\frac12`` get their braces; ``0.5`` becomes ``\\frac{1}{2}`` and ``a/b`` of two
    integers becomes ``\\frac{a}{b}``.

    Reference: Hendrycks et al. 2021 (MATH), answer normalization of the evaluation code.

    :param text: an extracted answer (box content or label), without the ``\\boxed``.
    :returns: the normalized string (possibly empty).
    """
    s = str(text).strip().replace("\n", "").replace("\\!", "")
    s = s.replace("\\\\", "\\")
    s = s.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = _TRAILING_UNIT.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    s = _drop_short_lhs(s)
    s = "".join(s.split())
    s = _SQRT_BARE.sub(r"\\sqrt{\1}", s)
    s = _FRAC.sub(_braced_frac, s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    ratio = _INT_RATIO.fullmatch(s)
    if ratio:
        s = f"\\frac{{{ratio.group(1)}}}{{{ratio.group(2)}}}"
    return s


def _drop_short_lhs(s: str) -> str:
    # "x = 5" -> "5", "k=3" -> "3"; a longer left side ("x+y=5") is an equation to keep.
    parts = s.split("=")
    if len(parts) == 2 and len(parts[0].strip()) <= 2:
        return parts[1].strip()
    return s


def _braced_frac(match: re.Match) -> str:
    def brace(arg: str) -> str:
        return arg if arg.startswith("{") else "{" + arg + "}"

    return "\\frac" + brace(match.group(1)) + brace(match.group(2))


# --- Minerva / DAPO (Lewkowycz et al. 2022; Yu et al. 2025) -----------------------------

_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|overline)\{([^{}]*)\}")
_LATEX_SPACE = re.compile(r"\\[,;:! ]")
_DEGREE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?")
_UNIT_WORDS = re.compile(
    r"\b(?:units?|square|sq|cubic|degrees?|cm|mm|km|meters?|metres?|feet|foot|ft|inch(?:es)?|miles?|mph|"
    r"hours?|hrs?|minutes?|mins?|seconds?|secs?|days?|weeks?|years?|dollars?|cents?|pounds?|lbs?|"
    r"grams?|kg|points?|ways|students|people|persons|integers?|digits?|edges?|numbers?|percent)\b",
    re.IGNORECASE,
)
_SHORT_FRAC = re.compile(r"\\frac(\w)(\w)")
_HALF_SHORT_FRAC = re.compile(r"\\frac(\w)(\{)")
_SHORT_SQRT = re.compile(r"\\sqrt(\w)")
_GROUPED_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def normalize_final_answer(text: str) -> str:
    """Canonical string of a final answer, DAPO's way (compared as plain strings).

    Rules, in order: keep the text after the last ``=``; take the content of a
    ``\\boxed{}``; unwrap ``\\text{}``-like commands; remove ``$``, ``\\$``, markdown
    ``*``, degree marks, percent signs, LaTeX spacing commands and unit/filler words
    (``dollars``, ``cm``, ``degrees``, ``ways``...); expand ``\\frac12`` to ``\\frac{1}{2}`` and
    ``\\sqrt2`` to ``\\sqrt{2}``; remove all whitespace and trailing periods; remove the
    commas of a digit-grouped number (``1,000`` -> ``1000``).

    Reference: Lewkowycz et al. 2022 (Minerva), appendix D.1 answer normalization, as used
    by DAPO (Yu et al. 2025).

    :param text: the text captured after ``Answer:`` (or a label).
    :returns: the normalized string (possibly empty).
    """
    s = str(text).split("=")[-1]
    inner = last_boxed_content(s)
    if inner is not None:
        s = inner
    previous = None
    while previous != s:  # nested wrappers: \text{\textbf{5}}
        previous, s = s, _TEXT_WRAPPER.sub(r" \1 ", s)
    s = s.replace("\\$", " ").replace("$", " ").replace("*", " ")
    s = _DEGREE.sub(" ", s)
    s = s.replace("\\%", " ").replace("%", " ")
    s = _LATEX_SPACE.sub(" ", s)
    s = _UNIT_WORDS.sub(" ", s)
    s = _SHORT_FRAC.sub(r"\\frac{\1}{\2}", s)
    s = _HALF_SHORT_FRAC.sub(r"\\frac{\1}\2", s)
    s = _SHORT_SQRT.sub(r"\\sqrt{\1}", s)
    s = "".join(s.split()).rstrip(".")
    if _GROUPED_NUMBER.fullmatch(s):
        s = s.replace(",", "")
    return s
