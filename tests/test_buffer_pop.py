"""The ``pop_first`` buffer policy."""

import asyncio

import pytest

from furlong.core.config.launch_args import launch_config
from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import Sample


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def groups(n):
    return [[Sample(group_index=g, index=2 * g), Sample(group_index=g, index=2 * g + 1)] for g in range(n)]


def pop(pm, buffer, k):
    return asyncio.run(pm.call_chosen("buffer_pop", "pop_first", "--buffer-filter", config=launch_config(configure=False),
                                      rollout_id=3, buffer=buffer, num_samples=k))


@pytest.mark.parametrize(
    "size, k, popped, left",
    [
        (5, 2, [0, 1], [2, 3, 4]),  # j = min(5, 2) = 2
        (3, 3, [0, 1, 2], []),
        (2, 4, [0, 1], []),  # never more than exist: the other 2 come from the dataset
        (3, 0, [], [0, 1, 2]),
        (0, 4, [], []),
    ],
)
def test_pop_first_is_fifo_and_in_place(pm, size, k, popped, left):
    buffer = groups(size)
    originals = list(buffer)
    out = pop(pm, buffer, k)
    assert [g[0].group_index for g in out] == popped
    assert [g[0].group_index for g in buffer] == left
    assert all(a is b for a, b in zip(out, originals))  # the same group objects, not copies


def test_pop_first_twice_continues_in_order(pm):
    buffer = groups(4)
    assert [g[0].group_index for g in pop(pm, buffer, 1)] == [0]
    assert [g[0].group_index for g in pop(pm, buffer, 2)] == [1, 2]
    assert [g[0].group_index for g in buffer] == [3]
