"""KL estimators of the loss and of the core's reward shaping."""

import math

import pytest
import torch

from furlong.kit.kl import kl_estimate
from furlong.core.train.advantage_stages import shaping_kl

# One token with logp - logp_ref = -0.5: each estimator's value, sign included
# k1 = -0.5; k2 = 0.25/2 = 0.125; k3 = low_var_kl = e^0.5 - 1 - 0.5 = 0.148721
C010 = {"k1": -0.5, "k2": 0.125, "k3": 0.148721, "low_var_kl": 0.148721}


@pytest.mark.parametrize("kl_type", sorted(C010))
def test_c010_single_token_values(kl_type):
    value = kl_estimate(torch.tensor([-1.5]), torch.tensor([-1.0]), kl_type)
    assert value.dtype == torch.float32
    assert value.tolist() == pytest.approx([C010[kl_type]], abs=1e-6)


@pytest.mark.parametrize("kl_type", sorted(C010))
def test_identical_distributions_give_zero(kl_type):
    lp = torch.tensor([-0.1, -2.0, -7.5])
    assert kl_estimate(lp, lp.clone(), kl_type).tolist() == [0.0, 0.0, 0.0]


def test_low_var_kl_is_clamped_and_k3_is_not():
    # x = -30: k3 = e^30 - 1 - 30; low_var_kl clamps -x to 20, then the result to 10
    lp, ref = torch.tensor([-30.0]), torch.tensor([0.0])
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(math.exp(30) - 31, rel=1e-5)
    assert kl_estimate(lp, ref, "low_var_kl").tolist() == [10.0]


def test_low_var_kl_sanitizes_non_finite_log_ratios():
    # -x = NaN -> 0 -> 0; -x = +inf -> 20 -> clamp 10; -x = -inf -> -20 -> e^-20 - 1 + 20 = clamp 10
    lp = torch.tensor([float("nan"), float("-inf"), float("inf")])
    out = kl_estimate(lp, torch.zeros(3), "low_var_kl")
    assert out.tolist() == [0.0, 10.0, 10.0]


def test_kl_gradients_flow_through_the_policy_log_probs():
    lp = torch.tensor([-1.5], requires_grad=True)
    kl_estimate(lp, torch.tensor([-1.0]), "k3").sum().backward()
    # d/dx (e^-x - 1 + x) = 1 - e^-x at x = -0.5: 1 - e^0.5 = -0.648721
    assert lp.grad.tolist() == pytest.approx([-0.648721], abs=1e-6)


def test_unknown_type_is_rejected():
    with pytest.raises(ValueError) as excinfo:
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")
    assert str(excinfo.value) == "--kl-loss-type 'k4': unknown KL estimator; choose one of k1, k2, k3, low_var_kl"


@pytest.mark.parametrize("kl_type", sorted(C010))
def test_core_shaping_kl_matches_the_loss_estimators(kl_type):
    gen = torch.Generator().manual_seed(1)
    lp, ref = -torch.rand(7, generator=gen) * 4, -torch.rand(7, generator=gen) * 4
    mask = torch.tensor([1.0, 1, 0, 1, 1, 0, 1])
    core = shaping_kl([lp], [ref], [mask], kl_type)[0]
    plugin = torch.where(mask > 0, kl_estimate(lp, ref, kl_type), 0.0)
    assert torch.equal(core, plugin)
