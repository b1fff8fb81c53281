"""The group filters ``check_reward_nonzero_std`` and ``no_aborted``."""

import asyncio
import math

import pytest

from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import FilterResult, PluginError, Sample, Status

from .configs import flag_defaults


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def group(*rewards, statuses=None):
    statuses = statuses or [Status.COMPLETED] * len(rewards)
    return [Sample(index=i, reward=r, status=s) for i, (r, s) in enumerate(zip(rewards, statuses))]


def run(pm, names, samples, reward_key=None):
    config = flag_defaults().replace(reward_key=reward_key)
    return asyncio.run(pm.run_filters(names, "--dynamic-sampling-filter", config=config, samples=samples,
                                      rollout_id=0))


@pytest.mark.parametrize(
    "rewards, expected",
    [
        ([1, 0, 1, 1], FilterResult(True)),
        ([0.0, 0.0, 0.0, 0.0], FilterResult(False, "zero_std_0.0")),
        ([1, 1, 1], FilterResult(False, "zero_std_1.0")),
        ([-1.0, -1.0], FilterResult(False, "zero_std_-1.0")),
        ([0.25, 0.25], FilterResult(False, "zero_std_0.2")),  # round(0.25, 1) == 0.2
        ([0.67, 0.67, 0.67], FilterResult(False, "zero_std_0.7")),
        ([1.0], FilterResult(False, "zero_std_1.0")),  # one sample: NaN std, dropped
        # std of [0, 2e-8] = 2e-8 / sqrt(2) = 1.41e-8 > 1e-8: kept
        ([0.0, 2e-8], FilterResult(True)),
        # std of [0, 1e-8] = 7.07e-9 <= 1e-8: dropped
        ([0.0, 1e-8], FilterResult(False, "zero_std_0.0")),
    ],
)
def test_nonzero_std(pm, rewards, expected):
    assert run(pm, ["check_reward_nonzero_std"], group(*rewards)) == expected


def test_nonzero_std_reads_dict_rewards_with_reward_key(pm):
    samples = group({"score": 1.0, "acc": True}, {"score": 1.0, "acc": True})
    assert run(pm, ["check_reward_nonzero_std"], samples, reward_key="score") == FilterResult(False, "zero_std_1.0")
    samples = group({"score": 1.0, "acc": True}, {"score": -1.0, "acc": False})
    assert run(pm, ["check_reward_nonzero_std"], samples, reward_key="score") == FilterResult(True)


def test_nonzero_std_dict_without_reward_key(pm):
    with pytest.raises(PluginError) as excinfo:
        run(pm, ["check_reward_nonzero_std"], group({"score": 1.0, "acc": True}, {"score": 0.0, "acc": False}))
    assert str(excinfo.value) == (
        "filter 'check_reward_nonzero_std': sample 0: the reward is a dict with keys ['acc', 'score']; pass "
        "--reward-key naming the scalar to train on (the evaluation reads it too, unless --eval-reward-key names "
        "another)."
    )


def test_nonzero_std_missing_reward(pm):
    with pytest.raises(PluginError) as excinfo:
        run(pm, ["check_reward_nonzero_std"], group(1.0, None, statuses=[Status.COMPLETED, Status.ABORTED]))
    assert str(excinfo.value) == (
        "filter 'check_reward_nonzero_std': sample 1 (status aborted) has no reward; "
        "the filter needs scored groups."
    )


@pytest.mark.parametrize(
    "rewards, expected",
    [
        ([1.0, 0.0], math.sqrt(0.5)),  # mean 0.5; (0.25 + 0.25) / (2 - 1) = 0.5
        ([1, 0, 1, 1], 0.5),  # mean 0.75; (3 * 0.0625 + 0.5625) / 3 = 0.25
        ([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0], math.sqrt(32 / 7)),  # sum of squares 32, N - 1 = 7
    ],
)
def test_reward_std_is_bessel_corrected(pm, rewards, expected):
    assert pm.get_plugin("check_reward_nonzero_std").reward_std(rewards) == pytest.approx(expected, rel=1e-15)


def test_reward_std_of_one_reward_is_nan(pm):
    assert math.isnan(pm.get_plugin("check_reward_nonzero_std").reward_std([3.0]))


def test_no_aborted(pm):
    done = group(1.0, 0.0)
    assert run(pm, ["no_aborted"], done) == FilterResult(True)
    mixed = group(1.0, None, statuses=[Status.COMPLETED, Status.ABORTED])
    assert run(pm, ["no_aborted"], mixed) == FilterResult(False, "group_has_aborted")
    truncated = group(1.0, 0.0, statuses=[Status.TRUNCATED, Status.FAILED])
    assert run(pm, ["no_aborted"], truncated) == FilterResult(True)


def test_first_rejecting_filter_gives_the_reason(pm):
    # no_aborted first: its reason wins and nonzero_std never sees the None reward
    mixed = group(1.0, None, statuses=[Status.COMPLETED, Status.ABORTED])
    assert run(pm, ["no_aborted", "check_reward_nonzero_std"], mixed) == FilterResult(False, "group_has_aborted")
    same = group(0.0, 0.0)
    assert run(pm, ["no_aborted", "check_reward_nonzero_std"], same) == FilterResult(False, "zero_std_0.0")
