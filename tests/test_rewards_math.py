"""The ``math`` reward, its answer normalization and the math-verify grading worker."""

import asyncio
import hashlib
import time
import pytest

from furlong.builtin_plugins.rewards import _grading
from furlong.builtin_plugins.rewards._normalize import label_answer, normalize_final_answer, normalize_math_answer
from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import Sample

from .configs import flag_defaults


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def grade(pm, name, samples, **flags):
    config = flag_defaults().replace(**flags)
    return asyncio.run(pm.call_chosen("reward", name, "--rm-type", config=config, samples=samples))


def math_score(pm, response, label):
    return grade(pm, "math", [Sample(response=response, label=label)])[0]


def box(content):
    return "\\boxed{" + content + "}"


# (response, label, expected reward). 1 = the last complete box equals the label as mathematics.
MATH_CASES = [
    # fractions and LaTeX fraction commands
    pytest.param(box(r"\frac{1}{2}"), "1/2", 1, id="frac-vs-slash"),
    pytest.param(box("0.5"), r"\frac{1}{2}", 1, id="decimal-vs-frac"),
    pytest.param(box("1/2"), "0.5", 1, id="slash-vs-decimal"),
    pytest.param(box(r"\frac{2}{4}"), "0.5", 1, id="unreduced-frac"),
    pytest.param(box(r"\dfrac{3}{4}"), r"\frac{3}{4}", 1, id="dfrac"),
    pytest.param(box(r"\tfrac34"), "0.75", 1, id="tfrac-shorthand"),
    pytest.param(box(r"\frac{1}{3}"), "0.5", 0, id="wrong-frac"),
    pytest.param(box("0.333"), r"\frac{1}{3}", 0, id="rounded-third-is-not-a-third"),
    pytest.param(box(r"-\frac{1}{2}"), "-0.5", 1, id="negative-frac"),
    pytest.param(box(r"\frac{-1}{2}"), r"-\frac{1}{2}", 1, id="sign-inside-frac"),
    pytest.param(box(r"\frac{\pi}{4}"), r"\frac14\pi", 1, id="pi-over-four"),
    # decimals
    pytest.param(box("3.0"), "3", 1, id="trailing-zero"),
    pytest.param(box(".5"), "0.5", 1, id="leading-dot"),
    pytest.param(box("2.50"), "2.5", 1, id="trailing-zero-decimal"),
    pytest.param(box("2.51"), "2.5", 0, id="wrong-decimal"),
    pytest.param(box("0.1+0.2"), "0.3", 1, id="evaluated-sum"),
    # thousands separators
    pytest.param(box("1,000"), "1000", 1, id="comma-answer"),
    pytest.param(box("1000"), "1,000", 1, id="comma-label"),
    pytest.param(box("1{,}000"), "1000", 1, id="latex-braced-comma"),
    pytest.param(box("1,234,567"), "1234567", 1, id="two-commas"),
    # negative numbers
    pytest.param(box("-3"), "-3", 1, id="negative"),
    pytest.param(box("-3"), "3", 0, id="sign-wrong-answer"),
    pytest.param(box("3"), "-3", 0, id="sign-wrong-label"),
    # units
    pytest.param(box(r"5 \text{ cm}"), "5", 1, id="unit-in-answer"),
    pytest.param(box("5"), r"5\text{ cm}", 1, id="unit-in-label"),
    pytest.param(box(r"5\text{cm}"), "5", 1, id="unit-without-space"),
    pytest.param(box(r"12 \text{ apples}"), "12", 1, id="count-noun"),
    pytest.param(box(r"90^\circ"), "90", 1, id="degrees"),
    pytest.param(box(r"6 \text{ cm}"), "5", 0, id="wrong-number-with-unit"),
    # money
    pytest.param(box(r"\$5"), "5", 1, id="dollar-sign"),
    pytest.param(box(r"\$1,000"), "1000", 1, id="dollar-and-comma"),
    pytest.param(box(r"5 \text{ dollars}"), r"\$5", 1, id="dollars-word-vs-sign"),
    pytest.param(box(r"\$5.50"), "5.5", 1, id="cents"),
    # percent
    pytest.param(box(r"50\%"), "50", 1, id="percent-sign"),
    pytest.param(box("50%"), "50", 1, id="bare-percent"),
    pytest.param(box(r"50\%"), "0.5", 1, id="percent-as-fraction"),
    pytest.param(box(r"25\%"), "50", 0, id="wrong-percent"),
    # \text{} and letters
    pytest.param(box(r"\text{5}"), "5", 1, id="text-number"),
    pytest.param(box(r"\textbf{12}"), "12", 1, id="textbf-number"),
    pytest.param(box(r"\text{(B)}"), "B", 1, id="text-choice"),
    pytest.param(box(r"\text{yes}"), "yes", 1, id="text-word"),
    pytest.param(box("B"), "C", 0, id="wrong-letter"),
    # which box is graded
    pytest.param("first \\boxed{3}, corrected: \\boxed{4}", "4", 1, id="last-box-wins"),
    pytest.param("first \\boxed{4}, corrected: \\boxed{3}", "4", 0, id="earlier-box-ignored"),
    pytest.param("<think>maybe \\boxed{3}</think> final \\boxed{4}", "4", 1, id="box-after-thinking"),
    pytest.param("\\fbox{7}", "7", 1, id="fbox"),
    pytest.param("so the answer is \\boxed 5", "5", 1, id="boxed-space-token"),
    # no usable answer: scores 0, never raises
    pytest.param("The answer is 12.", "12", 1, id="no-box-stated-answer"),
    pytest.param("The total is 12.", "12", 0, id="no-box-no-answer-phrase"),
    pytest.param("The answer is 12, so \\boxed{1", "12", 0, id="stated-then-truncated-box"),
    pytest.param("", "12", 0, id="empty-response"),
    pytest.param("so \\boxed{12", "12", 0, id="truncated-box"),
    pytest.param("\\boxed{11} wait, \\boxed{12", "11", 1, id="truncated-last-box-falls-back-to-last-complete"),
    pytest.param(box(""), "0", 0, id="empty-box"),
    pytest.param(box("1/0"), "1", 0, id="division-by-zero"),
    # intervals, tuples, sets
    pytest.param(box("(1, 2)"), "(1,2)", 1, id="open-interval"),
    pytest.param(box("[1, 2)"), "[1,2)", 1, id="half-open-interval"),
    pytest.param(box("(1,2]"), "[1,2)", 0, id="wrong-interval-ends"),
    pytest.param(box(r"(-\infty, 3]"), r"(-\infty,3]", 1, id="infinite-interval"),
    pytest.param(box(r"\left( 1, 2 \right)"), "(1,2)", 1, id="left-right-parens"),
    pytest.param(box("(1, 2)"), "(2, 1)", 0, id="swapped-pair"),
    pytest.param(box(r"\{1,2,3\}"), r"\{3,2,1\}", 1, id="set-order"),
    # roots and pi
    pytest.param(box(r"2\sqrt{2}"), r"\sqrt{8}", 1, id="simplified-root"),
    pytest.param(box(r"3\sqrt{2}"), r"\sqrt{18}", 1, id="simplified-root-2"),
    pytest.param(box(r"\sqrt2"), r"\sqrt{2}", 1, id="sqrt-shorthand"),
    pytest.param(box(r"\frac{\sqrt{3}}{2}"), r"\frac{\sqrt3}{2}", 1, id="root-in-frac"),
    pytest.param(box(r"2\pi"), r"2 \pi", 1, id="pi"),
    pytest.param(box(r"\pi"), "3.14", 0, id="pi-is-not-3.14"),
    pytest.param(box(r"\sqrt{3}"), "1.732", 0, id="root-is-not-its-rounding"),
    pytest.param(box(r"\infty"), r"\infty", 1, id="infinity"),
    # equations and expressions
    pytest.param(box("x=5"), "5", 1, id="assignment-answer"),
    pytest.param(box("5"), "x = 5", 1, id="assignment-label"),
    pytest.param(box("x=5"), "6", 0, id="wrong-assignment"),
    pytest.param(box("y = 2x + 1"), "y=1+2x", 1, id="equation-reordered"),
    pytest.param(box("x^2+2x+1"), "(x+1)^2", 1, id="expanded-square"),
    pytest.param(box("x^2"), "x^3", 0, id="wrong-power"),
    pytest.param(box("10^{3}"), "1000", 1, id="power-of-ten"),
    pytest.param(box("2^{10}"), "1024", 1, id="power-of-two"),
    # label forms
    pytest.param(box("7"), r"\boxed{7}", 1, id="boxed-label"),
    pytest.param(box("7"), 7, 1, id="int-label"),
    pytest.param(box("2.5"), 2.5, 1, id="float-label"),
    pytest.param(box("7"), None, 0, id="no-label"),
    pytest.param(box("7"), "", 0, id="empty-label"),
    pytest.param(box("7"), "   ", 0, id="blank-label"),
]


@pytest.mark.parametrize("response, label, expected", MATH_CASES)
def test_math_grades_realistic_answers(pm, response, label, expected):
    assert math_score(pm, response, label) == expected


def test_math_case_table_is_large():
    assert len(MATH_CASES) >= 50


# Labels read from JSON may be numbers: stringified (after the emptiness check), never a crash.
@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("…so the total is \\boxed{12}", 12, 1),  # (a)
        ("…hence \\boxed{0}", 0, 1),  # (b) the integer 0 is an answer, not a missing label
        ("the total is 12", "12", 0),  # (c) no \boxed
        ("…hence \\boxed{0}", "0", 1),  # the string "0" grades the same way
    ],
)
def test_c018_numeric_labels(pm, response, label, expected):
    assert math_score(pm, response, label) == expected


def test_math_scores_a_batch_in_order(pm):
    samples = [
        Sample(response=box(r"\frac{2}{4}"), label="0.5"),  # needs math-verify: 1
        Sample(response="no answer", label="3"),  # 0
        Sample(response=box("4"), label="4"),  # exact: 1
        Sample(response=box("1,000"), label="999"),  # math-verify: 0
        Sample(response=box("3"), label=None),  # 0
    ]
    assert grade(pm, "math", samples) == [1, 0, 1, 0, 0]


def test_math_boxed_response_is_graded_by_math(pm):
    module = pm.get_plugin("math")
    assert module.boxed_response(r"\frac{1}{2}") == r"\boxed{\frac{1}{2}}"
    assert math_score(pm, module.boxed_response(r"\frac{1}{2}"), "0.5") == 1


def test_math_module_exposes_grading_stats(pm):
    stats = pm.get_plugin("math").grading_stats()
    assert set(stats) == {"timeouts", "math_verify_calls", "worker_restarts"}


# --- the grading worker ---------------------------------------------------------------------


def test_equivalent_fast_path_skips_math_verify():
    before = _grading.grading_stats()["math_verify_calls"]
    assert _grading.equivalent(r"\dfrac{1}{2}", "0.5") is True  # both normalize to \frac{1}{2}
    assert _grading.equivalent("", "0.5") is False
    assert _grading.grading_stats()["math_verify_calls"] == before


def test_integer_pairs_are_graded_without_math_verify_as_math_verify_grades_them():
    pairs = [("3", "5"), ("05", "5"), ("-0", "0"), ("+3", "3"), ("-7", "7"), ("123456789", "123456788"),
             ("10000000000000000", "10000000000000001")]
    before = _grading.grading_stats()["math_verify_calls"]
    fast = [_grading.equivalent(answer, label) for answer, label in pairs]
    assert _grading.grading_stats()["math_verify_calls"] == before
    assert fast == [False, True, True, True, False, False, False]
    assert fast == [_grading.run_in_worker(_grading._check_pair, pair, 60.0) == ("ok", True) for pair in pairs]


def test_equivalent_timeout_scores_false_and_is_counted():
    _grading.equivalent("1,000", "1000")  # make sure the worker is up before timing
    before = _grading.grading_stats()
    start = time.monotonic()
    # sympy spends minutes comparing 10^(10^10) with 5; the worker's alarm stops it.
    assert _grading.equivalent(r"10^{10^{10}}", "5", timeout_s=0.5) is False
    assert time.monotonic() - start < 0.5 + _grading._KILL_GRACE_S
    after = _grading.grading_stats()
    assert after["timeouts"] == before["timeouts"] + 1
    assert after["worker_restarts"] == before["worker_restarts"]  # interrupted, not killed
    assert _grading.equivalent(r"\frac{2}{4}", "0.5") is True


def test_worker_stuck_in_c_code_is_killed_and_restarted():
    _grading.equivalent("1,000", "1000")
    before = _grading.grading_stats()
    # PBKDF2 with 10^9 rounds runs in C for minutes: SIGALRM cannot interrupt it.
    status = _grading.run_in_worker(hashlib.pbkdf2_hmac, ("sha256", b"pw", b"salt", 10**9), 0.2, grace_s=0.3)
    assert status == ("timeout", None)
    after = _grading.grading_stats()
    assert after["timeouts"] == before["timeouts"] + 1
    assert after["worker_restarts"] == before["worker_restarts"] + 1
    assert _grading.equivalent("1,000", "1000") is True  # a fresh worker answers


def test_worker_reports_errors():
    # int("x") raises ValueError inside the worker; the worker survives.
    assert _grading.run_in_worker(int, ("x",), 5.0) == ("error", "ValueError: invalid literal for int() with base 10: 'x'")
    assert _grading.run_in_worker(int, ("12",), 5.0) == ("ok", 12)


def test_equivalent_many_async_keeps_order():
    pairs = [("1,000", "1000"), ("3", "4"), (r"\frac{2}{4}", "0.5"), ("", "1"), ("x=5", "5")]
    assert asyncio.run(_grading.equivalent_many_async(pairs)) == [True, False, True, False, True]


def test_first_grading_call_starts_the_worker_in_the_grading_thread_even_when_no_answer_needs_it(monkeypatch):
    with _grading._lock:
        _grading._drop_worker()
    monkeypatch.setattr(_grading, "_warmed_in", None)  # as in a process that has graded nothing yet
    before = _grading.grading_stats()["math_verify_calls"]
    assert asyncio.run(_grading.equivalent_many_async([("3", "3"), ("4", "5")])) == [True, False]
    _grading._grading_thread().submit(lambda: None).result(timeout=180)  # runs after the queued start
    worker = _grading._worker
    assert worker is not None and worker.proc.poll() is None
    assert _grading.grading_stats()["math_verify_calls"] == before  # started, not asked anything
    assert asyncio.run(_grading.equivalent_many_async([("x=5", "5")])) == [True]
    assert _grading._worker is worker  # one start per process


# --- normalization helpers ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\tfrac12", r"\frac{1}{2}"),
        (r"\frac1{2}", r"\frac{1}{2}"),
        ("0.5", r"\frac{1}{2}"),
        ("3/4", r"\frac{3}{4}"),
        (".25", "0.25"),
        (r"\left(1, 2\right)", "(1,2)"),
        (r"90^{\circ}", "90"),
        (r"\$5", "5"),
        (r"50\%", "50"),
        (r"5 \text{ cm}", "5"),
        ("x = 5", "5"),
        ("x+y=5", "x+y=5"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt{3}}{2}"),
        ("", ""),
    ],
)
def test_normalize_math_answer(text, expected):
    assert normalize_math_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("x = 12", "12"),
        (r"$\boxed{12}$", "12"),
        (r"\$1,000", "1000"),
        ("12 dollars", "12"),
        (r"12\text{ cm}", "12"),
        (r"90^\circ", "90"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\frac1{3}", r"\frac{1}{3}"),
        (r"\sqrt3", r"\sqrt{3}"),
        ("**42**.", "42"),
        ("1,2", "1,2"),
        (r"\text{\textbf{7}}", "7"),
        ("[INVALID]", "[INVALID]"),
    ],
)
def test_normalize_final_answer(text, expected):
    assert normalize_final_answer(text) == expected


@pytest.mark.parametrize(
    "label, expected",
    [(12, "12"), (0, "0"), (2.5, "2.5"), (r" \boxed{\frac{1}{2}} ", r"\frac{1}{2}"), ("7 ", "7")],
)
def test_label_answer(label, expected):
    assert label_answer(label) == expected


def test_concurrent_reward_calls_batched_to_the_grading_thread_get_their_own_verdicts_and_a_repeat_is_free():
    pairs = [(r"\frac{2}{4}", "0.5"), ("3", "4"), (r"\frac{3}{6}", "0.5"), ("x=5", "5")]
    expected = [True, False, True, True]

    async def each_alone():
        return await asyncio.gather(*(_grading.equivalent_many_async([pair]) for pair in pairs))

    assert [r[0] for r in asyncio.run(each_alone())] == expected
    before = _grading.grading_stats()["math_verify_calls"]
    assert [r[0] for r in asyncio.run(each_alone())] == expected  # the same pairs again: no new comparison
    assert _grading.grading_stats()["math_verify_calls"] == before
