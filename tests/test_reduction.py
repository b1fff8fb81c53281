"""The core's loss reducer: masks, step denominators, truncation."""

import pytest
import torch

from furlong.core.train import reduction
from furlong.core.train.reduction import StepDenominators
from furlong.kit.masked import masked_sum


def reduce_step(values, masks, per_token, trajectory_ids=None, truncated=None, mask_truncated=False):
    """Reduce one step holding every sample, through the module's public pieces."""
    eff = reduction.effective_loss_masks(masks, truncated, mask_truncated)
    excluded = reduction.excluded_samples(truncated, mask_truncated, len(masks))
    (step,) = reduction.step_denominators(eff, [list(range(len(masks)))], trajectory_ids, excluded)
    denoms = reduction.sample_denominators(eff, trajectory_ids)
    weights = reduction.sample_weights(list(range(len(masks))), denoms, step, per_token)
    return masked_sum(values, eff, weights)


# Per-token loss divides by the trained tokens, not by every response token:
# A has 10 tokens, mask 6 ones then 4 zeros, loss 1.0; B has 4 trained tokens, loss 2.0.
C007_MASKS = [torch.tensor([1.0] * 6 + [0.0] * 4), torch.ones(4)]
C007_VALUES = [torch.ones(10), torch.full((4,), 2.0)]


def test_c007_per_token_divides_by_trained_tokens():
    # (6*1.0 + 4*2.0) / (6 + 4) = 1.4; dividing by all 14 response tokens would give 1.0
    assert reduce_step(C007_VALUES, C007_MASKS, per_token=True).item() == pytest.approx(1.4)


def test_c007_per_sample_mean_of_sample_means():
    # mean(6/6, 8/4) = 1.5
    assert reduce_step(C007_VALUES, C007_MASKS, per_token=False).item() == pytest.approx(1.5)


# Masked truncated samples leave the denominator as well as the numerator:
# A 8 tokens loss 0.5, B 12 tokens loss 1.0 (both EOS), C 20 tokens truncated.
C009_MASKS = [torch.ones(8), torch.ones(12), torch.ones(20)]
C009_VALUES = [torch.full((8,), 0.5), torch.ones(12), torch.full((20,), 3.0)]


def test_c009_truncated_samples_leave_the_token_denominator():
    out = reduce_step(C009_VALUES, C009_MASKS, per_token=True, truncated=[False, False, True], mask_truncated=True)
    # (8*0.5 + 12*1.0) / (8 + 12) = 0.8; keeping C's 20 tokens in the denominator would give 16/40 = 0.4
    assert out.item() == pytest.approx(0.8)


def test_c009_truncated_samples_leave_the_sample_denominator():
    out = reduce_step(C009_VALUES, C009_MASKS, per_token=False, truncated=[False, False, True], mask_truncated=True)
    # mean over the two kept samples: (0.5 + 1.0) / 2
    assert out.item() == pytest.approx(0.75)


def test_c009_without_masking_truncated_samples_are_trained():
    out = reduce_step(C009_VALUES, C009_MASKS, per_token=True, truncated=[False, False, True], mask_truncated=False)
    # (4 + 12 + 60) / 40
    assert out.item() == pytest.approx(1.9)


@pytest.mark.parametrize("per_token", [True, False])
def test_c009_all_truncated_gives_zero_not_nan(per_token):
    values = [v.clone().requires_grad_(True) for v in C009_VALUES]
    out = reduce_step(values, C009_MASKS, per_token=per_token, truncated=[True] * 3, mask_truncated=True)
    assert out.item() == 0.0
    out.backward()
    assert all(torch.equal(v.grad, torch.zeros_like(v)) for v in values)


def test_effective_masks_do_not_modify_the_inputs():
    masks = [torch.ones(2), torch.ones(3)]
    eff = reduction.effective_loss_masks(masks, [False, True], True)
    assert [m.tolist() for m in eff] == [[1.0, 1.0], [0.0, 0.0, 0.0]]
    assert masks[1].tolist() == [1.0, 1.0, 1.0]


def test_trajectory_siblings_share_one_denominator_and_count_once():
    masks = [torch.ones(2), torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.ones(1)]
    assert reduction.sample_denominators(masks, [5, 5, 6]) == [5.0, 5.0, 1.0]
    (step,) = reduction.step_denominators(masks, [[[0, 1], [2]]], [5, 5, 6])
    assert step == StepDenominators(samples=2, tokens=6.0)
    values = [torch.full((2,), 1.0), torch.full((4,), 4.0), torch.full((1,), 3.0)]
    # trajectory 5: (2*1 + 3*4)/5 = 2.8; trajectory 6: 3; mean over 2 trajectories = 2.9
    assert reduce_step(values, masks, per_token=False, trajectory_ids=[5, 5, 6]).item() == pytest.approx(2.9)


def test_removed_samples_still_count_in_the_sample_denominator():
    masks = [torch.ones(2), torch.zeros(3)]
    (step,) = reduction.step_denominators(masks, [[0, 1]])
    assert step == StepDenominators(samples=2, tokens=2.0)
    # (2*1.5/2 + 0) / 2 samples
    assert reduce_step([torch.full((2,), 1.5), torch.ones(3)], masks, per_token=False).item() == pytest.approx(0.75)


def test_steps_get_their_own_denominators():
    masks = [torch.ones(2), torch.ones(3), torch.ones(5)]
    steps = reduction.step_denominators(masks, [[[0], [1]], [[2]]])
    assert steps == [StepDenominators(samples=2, tokens=5.0), StepDenominators(samples=1, tokens=5.0)]


def test_masked_nan_and_inf_change_neither_value_nor_gradient():
    x = torch.tensor([1.0, float("nan"), float("inf")], requires_grad=True)
    out = masked_sum([x], [torch.tensor([1.0, 0.0, 0.0])], [0.5])
    assert out.item() == 0.5
    out.backward()
    assert x.grad.tolist() == [0.5, 0.0, 0.0]


def test_sample_weights_by_mode():
    step = StepDenominators(samples=4, tokens=20.0)
    assert reduction.sample_weights([0, 1], [5.0, 0.0], step, per_token=False) == [1 / 20, 1 / 4]
    assert reduction.sample_weights([0, 1], [5.0, 0.0], step, per_token=True) == [1 / 20, 1 / 20]
