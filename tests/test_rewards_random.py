"""The ``random`` and ``deterministic_random`` rewards."""

import hashlib
import random

import pytest

from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import Sample

from .configs import flag_defaults


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def test_random_is_uniform_over_zero_and_one(pm):
    random.seed(1234)
    rewards = pm.get_plugin("random").reward(config=flag_defaults(), samples=[Sample() for _ in range(400)])
    assert set(rewards) == {0, 1}
    assert all(type(r) is int for r in rewards)
    # 400 fair coin flips: mean 200, sd 10; 140..260 is six standard deviations
    assert 140 <= sum(rewards) <= 260


def test_random_follows_the_global_seed(pm):
    samples = [Sample() for _ in range(32)]
    random.seed(7)
    first = pm.get_plugin("random").reward(config=flag_defaults(), samples=samples)
    random.seed(7)
    assert pm.get_plugin("random").reward(config=flag_defaults(), samples=samples) == first


@pytest.mark.parametrize(
    "tokens, response",
    [([1, 2, 3], "abc"), ([], ""), ([151644, 872], "héllo → ∞"), ([5], "\\boxed{5}")],
)
def test_deterministic_random_is_sha256_parity(pm, tokens, response):
    expected = hashlib.sha256((str(tokens) + response).encode("utf-8")).digest()[0] % 2
    reward = pm.get_plugin("deterministic_random").reward(config=flag_defaults(),
                                                          samples=[Sample(tokens=tokens, response=response)])
    assert reward == [expected]


def test_deterministic_random_known_values(pm):
    # sha256(b"[1, 2, 3]abc") starts with 0x00 -> 0; sha256(b"[]") with 0x4f = 79 -> 1;
    # sha256(b"[7]x") with 0x06 -> 0
    samples = [Sample(tokens=[1, 2, 3], response="abc"), Sample(tokens=[], response=""),
               Sample(tokens=[7], response="x")]
    assert pm.get_plugin("deterministic_random").reward(config=flag_defaults(), samples=samples) == [0, 1, 0]
