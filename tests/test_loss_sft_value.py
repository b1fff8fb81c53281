"""The sft_loss and value_loss plugins."""

import pytest
import torch

from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import LossInput, PluginError

from .configs import flag_defaults


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def test_sft_loss_is_the_negative_log_likelihood(pm):
    logp = torch.tensor([-0.5, -2.0], requires_grad=True)
    batch = LossInput(log_probs=[logp], old_log_probs=None, advantages=None, loss_masks=[torch.ones(2)])
    out = pm.get_plugin("sft_loss").loss(config=flag_defaults(), batch=batch)
    assert out.token_loss[0].tolist() == [0.5, 2.0]
    out.token_loss[0].sum().backward()
    assert logp.grad.tolist() == [-1.0, -1.0]


def value_batch(values, old, returns, mask):
    v = torch.tensor(values, requires_grad=True)
    return v, LossInput(log_probs=[torch.zeros(len(values))], old_log_probs=None, advantages=None,
                        loss_masks=[torch.tensor(mask)], values=[v], old_values=[torch.tensor(old)],
                        returns=[torch.tensor(returns)])


def test_value_loss_by_hand(pm):
    v, batch = value_batch([1.0, 0.5, 0.0], [0.5, 0.4, 0.0], [0.0, 1.0, 0.3], [1.0, 1.0, 1.0])
    out = pm.get_plugin("value_loss").loss(config=flag_defaults().replace(value_clip=0.2), batch=batch)
    # token 0: v_clip = 0.5 + 0.2 = 0.7; max(0.7^2, 1.0^2) = 1.0 (unclipped wins); |v - v_old| = 0.5 > 0.2
    # token 1: v_clip = 0.5; max((0.5-1)^2, (0.5-1)^2) = 0.25; |0.1| <= 0.2
    # token 2: v_clip = 0; max(0.09, 0.09) = 0.09
    assert out.token_loss[0].tolist() == pytest.approx([1.0, 0.25, 0.09])
    assert out.token_metrics["vf_clipfrac"][0].tolist() == [1.0, 0.0, 0.0]
    out.token_loss[0].sum().backward()
    # d/dv (v - R)^2 = 2(v - R) on the unclipped branch: [2, -1, -0.6]
    assert v.grad.tolist() == pytest.approx([2.0, -1.0, -0.6])


def test_value_loss_clipped_branch_has_no_gradient(pm):
    v, batch = value_batch([1.0], [0.5], [2.0], [1.0])
    out = pm.get_plugin("value_loss").loss(config=flag_defaults().replace(value_clip=0.2), batch=batch)
    # v_clip = 0.7: (0.7-2)^2 = 1.69 > (1-2)^2 = 1 -> the clipped term wins, constant in v
    assert out.token_loss[0].tolist() == pytest.approx([1.69])
    out.token_loss[0].sum().backward()
    assert v.grad.tolist() == [0.0]


def test_value_clip_inf_is_the_unclipped_squared_error(pm):
    """--value-clip inf (accepted: no clipping): the loss is (v - R)^2 with its gradient, no token clipped."""
    v, batch = value_batch([1.0, 0.5], [0.5, 0.4], [2.0, 0.0], [1.0, 1.0])
    out = pm.get_plugin("value_loss").loss(config=flag_defaults().replace(value_clip=float("inf")), batch=batch)
    assert out.token_loss[0].tolist() == pytest.approx([1.0, 0.25])
    assert out.token_metrics["vf_clipfrac"][0].tolist() == [0.0, 0.0]
    out.token_loss[0].sum().backward()
    assert v.grad.tolist() == pytest.approx([-2.0, 1.0])


def test_value_loss_masked_tokens_give_zero_and_no_gradient(pm):
    v, batch = value_batch([1.0, 2.0], [0.5, float("nan")], [0.0, float("inf")], [1.0, 0.0])
    out = pm.get_plugin("value_loss").loss(config=flag_defaults().replace(value_clip=0.2), batch=batch)
    assert out.token_loss[0].tolist() == [1.0, 0.0]
    out.token_loss[0].sum().backward()
    assert v.grad.tolist() == [2.0, 0.0]


def test_value_loss_needs_returns(pm):
    v, batch = value_batch([1.0], [0.5], [2.0], [1.0])
    batch.returns = None
    with pytest.raises(PluginError) as excinfo:
        pm.get_plugin("value_loss").loss(config=flag_defaults().replace(value_clip=0.2), batch=batch)
    assert str(excinfo.value) == (
        "the clipped value loss needs LossInput.returns but the batch has none; it trains the critic of "
        "--advantage-estimator ppo, whose train backend must pass values, old values and returns."
    )
