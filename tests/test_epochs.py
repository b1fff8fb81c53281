"""``furlong.kit.epochs.EpochOrder``: the row order data sources share."""

import random

import pytest

from furlong.kit.epochs import EpochOrder


def test_plain_order_rolls_over_epochs():
    order = EpochOrder(3)
    assert order.take(2) == [0, 1] and order.take(4) == [2, 0, 1, 2]
    assert order.state() == {"epoch": 1, "offset": 3, "seed": 0, "shuffle": False}


def test_shuffled_epochs_use_seed_plus_epoch_and_resume():
    order = EpochOrder(5, shuffle=True, seed=7)
    first, second = order.take(5), order.take(5)
    expected = [list(range(5)), list(range(5))]
    random.Random(7).shuffle(expected[0])
    random.Random(8).shuffle(expected[1])
    assert [first, second] == expected
    saved = order.state()
    after = order.take(3)
    resumed = EpochOrder(5, shuffle=True, seed=7)
    resumed.load_state(saved)
    assert resumed.take(3) == after


def test_no_rows_is_an_error_only_when_rows_are_asked_for():
    assert EpochOrder(0).take(0) == []
    with pytest.raises(ValueError, match="no rows"):
        EpochOrder(0).take(1)
