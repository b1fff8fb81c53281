"""The ``f1`` reward: SQuAD token F1 (Rajpurkar et al. 2016)."""

import pytest

from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import Sample

from .configs import flag_defaults


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def f1(pm, response, label):
    return pm.get_plugin("f1").reward(config=flag_defaults(), samples=[Sample(response=response, label=label)])[0]


@pytest.mark.parametrize(
    "response, label, expected",
    [
        # identical after normalization (case, punctuation, articles): P = R = 1
        ("The Eiffel Tower!", "eiffel tower", 1.0),
        # pred "eiffel tower" (2), gold "eiffel tower in paris" (4), common 2: P=1, R=1/2, F1=2*1*0.5/1.5=2/3
        ("The Eiffel tower", "Eiffel Tower in Paris", 2 / 3),
        # pred "paris france" (2), gold "paris" (1), common 1: P=1/2, R=1, F1=2/3
        ("Paris, France.", "Paris", 2 / 3),
        # pred "a b c d" minus articles -> "b c d" (3); gold "b c e f" (4); common 2: P=2/3, R=1/2, F1=4/7
        ("a b c d", "b c e f", 4 / 7),
        # multiset overlap: pred "red red blue" (3), gold "red blue blue" (3), common red+blue=2: F1=2/3
        ("red red blue", "red blue blue", 2 / 3),
        ("London", "Paris", 0.0),
        ("", "Paris", 0.0),
        ("Paris", "", 0.0),
        ("Paris", None, 0.0),
        # yes/no/noanswer must match exactly
        ("yes", "yes", 1.0),
        ("Yes.", "no", 0.0),
        ("no answer", "noanswer", 0.0),  # "no answer" is two tokens, not the special "noanswer"
        ("yes it is", "yes", 0.0),  # gold is special and pred differs
        # a list label scores the best entry: "tower" vs "the tower" -> 1.0
        ("tower", ["Eiffel Tower", "the tower"], 1.0),
        (12, 12, 1.0),
    ],
)
def test_f1_values(pm, response, label, expected):
    assert f1(pm, str(response), label) == pytest.approx(expected, abs=1e-12)


def test_f1_boxed_response_is_bare_content(pm):
    module = pm.get_plugin("f1")
    assert module.boxed_response("Eiffel Tower") == "Eiffel Tower"
    assert f1(pm, module.boxed_response("Eiffel Tower"), "the Eiffel tower") == 1.0


@pytest.mark.parametrize(
    "text, expected",
    [("The  Quick, brown fox!", "quick brown fox"), ("An apple a day", "apple day"), ("theatre", "theatre")],
)
def test_normalize_answer(pm, text, expected):
    assert pm.get_plugin("f1").normalize_answer(text) == expected
