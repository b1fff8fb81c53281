"""The ``dapo`` reward (DAPO, Yu et al. 2025)."""

import pytest

from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import PluginError, Sample

from .configs import flag_defaults


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def dapo(pm, response, label, index=0):
    return pm.get_plugin("dapo").reward(config=flag_defaults().replace(reward_key="score"),
                                         samples=[Sample(response=response, label=label, index=index)])[0]


def right(pred):
    return {"score": 1.0, "acc": True, "pred": pred}


def wrong(pred):
    return {"score": -1.0, "acc": False, "pred": pred}


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("Let me compute.\nAnswer: 42", 42, right("42")),
        ("answer : 42\n", "42", right("42")),  # keyword case and spaces
        ("Answer: 41\nWait, recheck.\nAnswer: 42", 42, right("42")),  # last match wins
        ("Answer: 42\nOn reflection:\nAnswer: 41", 42, wrong("41")),
        ("Answer: $1,000$ dollars", 1000, right("1000")),
        ("Answer: x = 12", 12, right("12")),
        (r"Answer: $\boxed{12}$", 12, right("12")),
        ("**Answer:** 7.", 7, right("7")),
        (r"Answer: 90^\circ", 90, right("90")),
        ("Answer: -5", -5, right("-5")),
        ("Answer: 12.0", 12, wrong("12.0")),  # compared as strings
        (r"Answer: \frac12", 12, wrong(r"\frac{1}{2}")),
        ("The result is 42.", 42, wrong("[INVALID]")),  # no Answer: line
        ("", 42, wrong("[INVALID]")),
        ("Answer: 42" + "x" * 300, 42, wrong("[INVALID]")),  # outside the last 300 characters
        ("Answer: 42", "42.0", right("42")),  # label cast str(int(float(label)))
        ("Answer: 1000", "1,000", right("1000")),  # label normalized before the cast
    ],
)
def test_dapo_scores(pm, response, label, expected):
    assert dapo(pm, response, label) == expected


def test_dapo_non_numeric_label_raises(pm):
    with pytest.raises(PluginError) as excinfo:
        dapo(pm, "Answer: 5", r"\frac{1}{2}", index=3)
    assert str(excinfo.value) == (
        "reward 'dapo': sample 3 has label '\\\\frac{1}{2}', which is not a number; dapo compares integer answers "
        "(the label is cast with int(float(label))). Use --rm-type math for non-integer answers."
    )


def test_dapo_batch_keeps_order(pm):
    samples = [Sample(response="Answer: 1", label=1), Sample(response="Answer: 3", label=2)]
    assert pm.get_plugin("dapo").reward(config=flag_defaults().replace(reward_key="score"), samples=samples) == [right("1"), wrong("3")]


def test_dapo_boxed_response(pm):
    module = pm.get_plugin("dapo")
    assert module.boxed_response("42") == "Answer: 42"
    assert dapo(pm, module.boxed_response("42"), 42) == right("42")
