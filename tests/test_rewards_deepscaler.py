"""The ``deepscaler`` reward; with a repeated ``###Response`` marker the last segment is graded."""

import asyncio
import logging
import pytest

from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import Sample

from .configs import flag_defaults


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def score(pm, response, label):
    samples = [Sample(response=response, label=label)]
    return asyncio.run(pm.call_chosen("reward", "deepscaler", "--rm-type", config=flag_defaults(), samples=samples))[0]


def test_c017_last_response_marker_is_graded(pm):
    response = r"plan: x=\boxed{7} ###Response guess \boxed{8} ###Response final \boxed{15}"
    assert score(pm, response, "15") == 1


@pytest.mark.parametrize(
    "response, label, expected",
    [
        (r"<think>try \boxed{3}</think>The answer is \boxed{4}.", "4", 1),
        (r"<think>first</think> redo <think>again</think> so \boxed{\frac{2}{4}}", "0.5", 1),  # math-verify
        (r"<think>\boxed{4}</think>no box after thinking", "4", 0),  # box only inside the thinking
        (r"<think>a</think>\fbox{9}", "9", 1),
        (r"reasoning ###Response \boxed{1,000}", "1000", 1),
        (r"</think> \boxed{12}", 12, 1),  # numeric label stringified
        (r"</think> \boxed{0}", 0, 1),
        (r"</think> \boxed{12}", r"\boxed{12}", 1),  # boxed label unwrapped
        (r"</think> \boxed{12}", "", 0),
        (r"</think> \boxed{12}", None, 0),
        (r"<think>x</think> \boxed{12", "12", 0),  # truncated box
        (r"###Response \boxed{4}</think> no final box", "4", 0),  # </think> wins over ###Response
    ],
)
def test_deepscaler_grades_the_final_solution(pm, response, label, expected):
    assert score(pm, response, label) == expected


def test_without_markers_scores_zero_and_warns_once(pm, monkeypatch, caplog):
    module = pm.get_plugin("deepscaler")
    monkeypatch.setattr(module, "_warned_no_marker", False)
    with caplog.at_level(logging.WARNING, logger=module.__name__):
        assert score(pm, r"The answer is \boxed{5}.", "5") == 0
        assert score(pm, r"Again \boxed{5}.", "5") == 0
    messages = [r.getMessage() for r in caplog.records if r.name == module.__name__]
    assert messages == [
        "reward 'deepscaler': a response has neither '</think>' nor '###Response'; deepscaler grades only "
        "the text after one of them, so such responses always score 0. For a model that does not write these "
        "markers use --rm-type math (grades the last \\boxed{} of the whole response)."
    ]


def test_empty_response_scores_zero_without_warning(pm, monkeypatch, caplog):
    module = pm.get_plugin("deepscaler")
    monkeypatch.setattr(module, "_warned_no_marker", False)
    with caplog.at_level(logging.WARNING, logger=module.__name__):
        assert score(pm, "", "5") == 0
    assert [r for r in caplog.records if r.name == module.__name__] == []


def test_boxed_response_reaches_the_grader(pm):
    module = pm.get_plugin("deepscaler")
    assert module.boxed_response("15") == r"</think>\boxed{15}"
    assert score(pm, module.boxed_response("15"), "15") == 1


@pytest.mark.parametrize(
    "response, expected",
    [("a</think>b</think>c", "c"), ("a###Responseb###Responsec", "c"), ("x</think>y###Responsez", "y###Responsez"),
     ("plain", None)],
)
def test_solution_text(pm, response, expected):
    assert pm.get_plugin("deepscaler").solution_text(response) == expected
