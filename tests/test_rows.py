"""SplitRows: per-sample pieces of one tensor, read back without a copy; the loss path gives the same values."""

import asyncio

import torch

from furlong.core.config.launch_args import launch_config
from furlong.core.train.objective import StepObjective
from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import PluginError, TrainBatch
from furlong.hooks.contract import check_loss_output
from furlong.kit.masked import MaskedSum
from furlong.hooks.rows import SplitRows, concat_rows, detached_rows, row_lengths
from furlong.kit.trainer import rows_to_device
from furlong.hooks.types import LossOutput

LENGTHS = [3, 1, 4, 2]


def test_concat_of_intact_rows_is_the_tensor_they_were_split_from():
    flat = torch.arange(10.0)
    rows = SplitRows.of(flat, LENGTHS)
    assert isinstance(rows, list) and [r.tolist() for r in rows] == [[0, 1, 2], [3], [4, 5, 6, 7], [8, 9]]
    assert concat_rows(rows) is flat and row_lengths(rows) == LENGTHS


def test_lengths_that_do_not_add_up_are_refused():
    import pytest

    with pytest.raises(ValueError, match=r"SplitRows.of: 2 lengths adding up to 9 for a tensor of shape \[10\]"):
        SplitRows.of(torch.arange(10.0), [4, 5])
    with pytest.raises(ValueError, match=r"a tensor of shape \[2, 5\]"):
        SplitRows.of(torch.zeros(2, 5), [5, 5])


def test_a_changed_list_is_read_from_its_items():
    rows = SplitRows.of(torch.arange(10.0), LENGTHS)
    rows[1] = torch.tensor([-1.0, -2.0])
    assert concat_rows(rows).tolist() == [0, 1, 2, -1, -2, 4, 5, 6, 7, 8, 9]
    assert row_lengths(rows) == [3, 2, 4, 2]
    rows = SplitRows.of(torch.arange(10.0), LENGTHS)
    rows.pop()
    assert concat_rows(rows).tolist() == list(range(8)) and row_lengths(rows) == [3, 1, 4]
    plain = [torch.ones(2), torch.zeros(1)]
    assert concat_rows(plain).tolist() == [1, 1, 0] and row_lengths(plain) == [2, 1]


def test_detached_rows_keep_the_split_and_drop_the_graph():
    flat = torch.arange(10.0, requires_grad=True) * 2
    rows = detached_rows(SplitRows.of(flat, LENGTHS))
    assert isinstance(rows, SplitRows) and not concat_rows(rows).requires_grad
    assert torch.equal(concat_rows(rows), flat.detach())
    plain = detached_rows(list(flat.split(LENGTHS)))
    assert not isinstance(plain, SplitRows) and not any(r.requires_grad for r in plain)


def test_rows_moved_in_one_copy_come_back_split():
    here = [torch.ones(3), torch.zeros(2)]
    moved = rows_to_device(here, "cpu")  # already there: concatenated all the same
    assert isinstance(moved, SplitRows) and moved.lengths == [3, 2] and moved.flat.tolist() == [1, 1, 1, 0, 0]
    assert rows_to_device(moved, "cpu") is moved
    mixed = rows_to_device([torch.ones(2), torch.zeros(2, dtype=torch.int64)], "cpu")
    assert not isinstance(mixed, SplitRows) and [r.dtype for r in mixed] == [torch.float32, torch.int64]
    moved = rows_to_device([torch.ones(2, 2), torch.zeros(1, 2)], "meta")
    assert [tuple(r.shape) for r in moved] == [(2, 2), (1, 2)] and not isinstance(moved, SplitRows)
    moved = rows_to_device([torch.ones(3), torch.zeros(2)], "meta")
    assert isinstance(moved, SplitRows) and moved.lengths == [3, 2] and moved.flat.device.type == "meta"


def test_the_contract_check_still_blames_a_wrong_length():
    masks = SplitRows.of(torch.ones(10), LENGTHS)
    good = LossOutput(token_loss=SplitRows.of(torch.zeros(10), LENGTHS), token_metrics={})
    assert check_loss_output(good, masks, "--loss-type 'x'") is good
    bad = LossOutput(token_loss=SplitRows.of(torch.zeros(10), [3, 2, 3, 2]), token_metrics={})
    try:
        check_loss_output(bad, masks, "--loss-type 'x'")
    except PluginError as e:
        assert "token_loss[1] has 2 values but the sample has 1 response tokens" in str(e)
    else:
        raise AssertionError("a wrong length passed")


def test_masked_sum_is_the_same_for_split_and_plain_rows():
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(10, generator=gen)
    masks = (torch.rand(10, generator=gen) > 0.4).float()
    weights = [0.5, 2.0, 1.0, 0.25]
    split = MaskedSum(SplitRows.of(masks, LENGTHS), weights)(SplitRows.of(values, LENGTHS))
    plain = MaskedSum(list(masks.split(LENGTHS)), weights)(list(values.split(LENGTHS)))
    assert torch.equal(split, plain)


def _objective_on(rows_of):
    """Loss, metrics and the gradient of the policy loss through the core's objective, the inputs built by ``rows_of``."""
    gen = torch.Generator().manual_seed(11)
    lengths = [5, 3, 6, 2, 4]
    masks = [(torch.rand(t, generator=gen) > 0.2).float() for t in lengths]
    rows = lambda: [torch.randn(t, generator=gen) for t in lengths]  # noqa: E731
    batch = TrainBatch(tokens=[[0] * (t + 2) for t in lengths], response_lengths=lengths, loss_masks=masks,
                       steps=[[[0, 1, 2, 3, 4]]], advantages=rows(), rollout_log_probs=[-r.abs() for r in rows()])
    config = launch_config("--num-rollout", "1", "--rollout-batch-size", "5", "--eps-clip-high", "0.28",
                           "--entropy-coef", "0.01")
    objective = StepObjective(config, get_plugin_manager(), batch, "policy_loss", "--loss-type",
                              reuse_old_log_probs=True)
    flat = (-torch.rand(sum(lengths), generator=gen)).requires_grad_()
    entropy = torch.rand(sum(lengths), generator=gen).requires_grad_()
    loss, metrics = asyncio.run(objective([0, 1, 2, 3, 4], rows_of(flat, lengths), rows_of(entropy, lengths)))
    loss.backward()
    return loss, metrics, flat.grad, entropy.grad, objective.old_log_probs


def test_the_objective_gives_the_same_values_from_split_and_plain_rows():
    split = _objective_on(SplitRows.of)
    plain = _objective_on(lambda flat, lengths: list(flat.split(lengths)))
    assert torch.equal(split[0], plain[0])
    assert split[1].keys() == plain[1].keys() and all(torch.equal(split[1][k], plain[1][k]) for k in split[1])
    assert torch.equal(split[2], plain[2]) and torch.equal(split[3], plain[3])
    assert all(torch.equal(a, b) for a, b in zip(split[4], plain[4]))


def test_concatenated_ranges_are_each_span_one_after_another():
    from furlong.kit.trainer import concatenated_ranges

    starts, lengths = torch.tensor([5, 0, 10, 7]), torch.tensor([2, 3, 0, 1])
    assert concatenated_ranges(starts, lengths).tolist() == [5, 6, 0, 1, 2, 7]
