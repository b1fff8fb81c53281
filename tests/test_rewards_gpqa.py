"""The ``gpqa`` reward: multiple-choice letters (Rein et al. 2023)."""

import pytest

from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import Sample

from .configs import flag_defaults

CHOICES = ["Argon", "Neon", "Xenon", "Krypton"]


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def gpqa(pm, response, label, **metadata):
    sample = Sample(response=response, label=label, metadata=metadata)
    return pm.get_plugin("gpqa").reward(config=flag_defaults(), samples=[sample])[0]


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("The answer is C.", "C", 1.0),
        ("Answer: (C)", "C", 1.0),
        ("final answer: **C**", "C", 1.0),
        (r"So the choice is \boxed{C}", "C", 1.0),
        ("Option B is wrong. The answer is C", "C", 1.0),  # the last named letter wins
        ("The answer is C. Hmm, no: the answer is D.", "C", 0.0),
        ("(C) is correct", "C", 1.0),
        ("B is the correct one? No. C is correct.", "C", 1.0),
        ("After checking each option, I pick C", "C", 1.0),  # last standalone capital
        ("The answer is a noble gas, so C", "C", 1.0),  # lower-case 'a' is not a letter choice
        ("<think>The answer is A</think>The answer is C", "C", 1.0),  # only after </think>
        ("<think>The answer is C</think>The answer is A", "C", 0.0),
        ("The answer is I think J", "C", 0.0),  # no valid letter in A-H named; standalone none valid
        ("The answer is C", "c", 1.0),  # lower-case one-letter label
        ("I cannot tell.", "C", 0.0),
    ],
)
def test_gpqa_default_letters(pm, response, label, expected):
    assert gpqa(pm, response, label) == expected


def test_correct_letter_from_metadata(pm):
    assert gpqa(pm, "Answer: B", "Neon", correct_letter="b", choices=CHOICES) == 1.0
    assert gpqa(pm, "Answer: C", "Neon", correct_letter="B", choices=CHOICES) == 0.0


def test_int_label_is_an_index(pm):
    assert gpqa(pm, "Answer: C", 2, choices=CHOICES) == 1.0  # 0 -> A, 1 -> B, 2 -> C
    assert gpqa(pm, "Answer: A", 0, choices=CHOICES) == 1.0
    assert gpqa(pm, "Answer: A", 2, choices=CHOICES) == 0.0


def test_label_text_matches_a_choice(pm):
    assert gpqa(pm, "The answer is (D).", "krypton", choices=CHOICES) == 1.0
    assert gpqa(pm, "The answer is (C).", "krypton", choices=CHOICES) == 0.0


def test_valid_letters_limit_the_choices(pm):
    # with four choices E is not a valid letter: the later "answer: E" is skipped, B counts
    assert gpqa(pm, "The answer is B. Final answer: E", "B", choices=CHOICES) == 1.0
    assert gpqa(pm, "Answer: E", "E", choices=CHOICES) == 0.0
    assert gpqa(pm, "Answer: J", "J", valid_letters=["I", "J"]) == 1.0


def test_text_fallback_when_no_letter(pm):
    assert gpqa(pm, "it must be xenon gas", 2, choices=CHOICES) == 1.0  # correct C = Xenon
    assert gpqa(pm, "it must be neon gas", 2, choices=CHOICES) == 0.0
    assert gpqa(pm, "it must be xenonite", 2, choices=CHOICES) == 0.0  # whole words only
    assert gpqa(pm, "it's the mitochondria", "the mitochondria") == 1.0  # no choices: label text


def test_gpqa_boxed_response(pm):
    module = pm.get_plugin("gpqa")
    assert module.boxed_response("C") == "Answer: C"
    assert gpqa(pm, module.boxed_response("C"), "C") == 1.0
    assert gpqa(pm, module.boxed_response("Xenon"), 2, choices=CHOICES) == 1.0
