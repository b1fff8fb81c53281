"""Token-level F1 reward for short-answer QA (SQuAD F1, Rajpurkar et al. 2016; yes/no rule of
HotpotQA, Yang et al. 2018)."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from furlong.hooks import hookimpl

__all__ = ["boxed_response", "f1_score", "normalize_answer", "reward"]

_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_SPECIAL = ("yes", "no", "noanswer")


@hookimpl
def reward(config, samples):
    """Score each sample with the token F1 between its response and its label.

    Both texts are normalized (:func:`normalize_answer`) and split on whitespace; with
    ``c`` tokens in common (multiset intersection), ``precision = c / len(response
    tokens)``, ``recall = c / len(label tokens)`` and ``F1 = 2 * precision * recall /
    (precision + recall)``; no common token gives 0. If either side normalizes to ``yes``,
    ``no`` or ``noanswer`` and the two differ, the score is 0. A list label scores the best
    F1 over its entries. The whole response is compared.

    Flags: none.

    :param samples: finished samples; ``response`` (str) and ``label`` (str, or list of
        str) are read. A ``None`` label scores 0.
    :returns: one float in [0, 1] per sample, in order.

    Reference: Rajpurkar et al. 2016, "SQuAD: 100,000+ Questions for Machine Comprehension
    of Text", sec. 5 (F1); Yang et al. 2018, "HotpotQA", evaluation (yes/no rule).
    """
    return [_best_f1(s.response or "", s.label) for s in samples]


def boxed_response(content: str) -> str:
    """The response ``boxed_f1`` hands to this grader: the bare box content (LaTeX
    markup would count as words)."""
    return content


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace."""
    text = str(text).lower().translate(_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def f1_score(prediction: str, truth: str) -> float:
    """SQuAD token F1 between two texts, with the yes/no/noanswer rule (see :func:`reward`)."""
    pred, gold = normalize_answer(prediction), normalize_answer(truth)
    if (pred in _SPECIAL or gold in _SPECIAL) and pred != gold:
        return 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _best_f1(response: str, label: Any) -> float:
    if label is None:
        return 0.0
    truths = label if isinstance(label, (list, tuple)) else [label]
    return max((f1_score(response, str(t)) for t in truths), default=0.0)
