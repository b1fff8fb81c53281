"""The core's advantage stages: shaping KL, the chosen estimator, OPD, whitening."""

import asyncio
import functools

import pytest
import torch

from furlong.core.config.launch_args import launch_config
from furlong.core.train.advantage_stages import apply_opd, compute_advantages, shaping_kl, whiten
from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import AdvantageInput, AdvantageOutput, PluginError, hookimpl

DEFAULTS = dict(
    disable_grpo_std_normalization=False, disable_rewards_normalization=False,
    gamma=1.0, lambd=1.0, kl_coef=0.0, kl_loss_type="k1",
    normalize_advantages=False, use_opd=False, opd_kl_coef=1.0,
)
FLAG = "--advantage-estimator"


@functools.cache
def _base_config():
    return launch_config(**DEFAULTS)


def make_config(**overrides):
    return _base_config().replace(**overrides)


@pytest.fixture
def pm():
    return get_plugin_manager()


def stages(pm, name, batch, **flags):
    return asyncio.run(compute_advantages(make_config(**flags), pm, batch, name, FLAG))


def batch_of(rewards, masks, **extra):
    return AdvantageInput(
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_ids=torch.zeros(len(rewards), dtype=torch.int64),
        loss_masks=[torch.tensor(m, dtype=torch.float32) for m in masks],
        **extra,
    )


def test_without_extra_stages_the_estimator_output_is_returned():
    pm = get_plugin_manager()
    out = stages(pm, "grpo", batch_of([1.0, 0.0], [[1, 1], [1, 0]]))
    assert [a.tolist() for a in out.advantages] == [pytest.approx([0.70711] * 2, abs=1e-4),
                                                    pytest.approx([-0.70711] * 2, abs=1e-4)]
    assert [r.tolist() for r in out.returns] == [a.tolist() for a in out.advantages]


def test_shaping_kl_reaches_the_estimator_and_masked_tokens_give_zero(pm):
    # logp_old - logp_ref = [0.2, -0.5, 3.0 (masked)]; k1 -> [0.2, -0.5, 0]
    batch = batch_of([1.0], [[1, 1, 0]], log_probs=[torch.tensor([-1.0, -1.0, -1.0])],
                     ref_log_probs=[torch.tensor([-1.2, -0.5, -4.0])])
    out = stages(pm, "reinforce_plus_plus", batch, kl_coef=0.1)
    # rho = [-0.02, 0.05 + 1, 0] -> G = [1.03, 1.05, 0]
    assert out.advantages[0].tolist() == pytest.approx([1.03, 1.05, 0.0])
    assert batch.kl is None  # the caller's batch is not modified


def test_shaping_kl_uses_kl_loss_type():
    kl = shaping_kl([torch.tensor([-1.0, -1.0])], [torch.tensor([-0.5, float("nan")])], [torch.ones(2)], "low_var_kl")
    # x = -0.5 -> e^0.5 - 1 - 0.5 = 0.148721; x = NaN -> -x sanitized to 0 -> 0
    assert kl[0].tolist() == pytest.approx([0.148721, 0.0], abs=1e-6)


def test_shaping_kl_needs_reference_log_probs(pm):
    with pytest.raises(PluginError) as excinfo:
        stages(pm, "reinforce_plus_plus", batch_of([1.0], [[1]], log_probs=[torch.zeros(1)]), kl_coef=0.1)
    assert str(excinfo.value) == (
        "--kl-coef 0.1: reward-shaping KL needs AdvantageInput.ref_log_probs, but the batch has none; "
        "the reference model is loaded when --kl-coef != 0 (set --ref-load)."
    )


def test_opd_modifier_after_the_estimator(pm):
    batch = batch_of([1.0, 0.0], [[1], [1]], log_probs=[torch.tensor([-1.0]), torch.tensor([-0.3])],
                     teacher_log_probs=[torch.tensor([-0.2]), torch.tensor([-0.3])])
    out = stages(pm, "grpo", batch, use_opd=True, opd_kl_coef=0.5)
    # grpo: +-0.70711; OPD: A - 0.5*(logp_old - logp_teacher) = 0.70711 - 0.5*(-0.8) = 1.10711; -0.70711 - 0
    assert [float(a) for a in out.advantages] == pytest.approx([1.10711, -0.70711], abs=1e-4)
    # returns are the estimator's
    assert [float(r) for r in out.returns] == pytest.approx([0.70711, -0.70711], abs=1e-4)


def test_opd_needs_teacher_log_probs(pm):
    with pytest.raises(PluginError) as excinfo:
        stages(pm, "grpo", batch_of([1.0], [[1]], log_probs=[torch.zeros(1)]), use_opd=True)
    assert str(excinfo.value).startswith("--use-opd: the OPD modifier needs AdvantageInput.teacher_log_probs")


def test_apply_opd_by_hand():
    out = apply_opd([torch.tensor([0.5, 0.0])], [torch.tensor([-1.0, -2.0])], [torch.tensor([-0.2, -1.0])], 0.5)
    # 0.5 - 0.5*(-0.8) = 0.9; 0 - 0.5*(-1.0) = 0.5
    assert out[0].tolist() == pytest.approx([0.9, 0.5])


def test_whiten_by_hand_ignores_masked_values():
    # trained values 1, 2, 3: mu = 2, E[A^2] = 14/3, var = (14/3 - 4) * 3/2 = 1
    # masked 100 never enters the statistics but is shifted and scaled too: (100 - 2)/1 = 98
    out = whiten([torch.tensor([1.0, 2.0, 100.0]), torch.tensor([3.0])],
                 [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0])])
    assert out[0].tolist() == pytest.approx([-1.0, 0.0, 98.0], abs=1e-6)
    assert out[1].tolist() == pytest.approx([1.0], abs=1e-6)


def test_whiten_single_token_has_no_bessel_correction():
    # N = 1: mu = 5, var = 0 -> (5 - 5)/sqrt(1e-8) = 0
    assert whiten([torch.tensor([5.0])], [torch.tensor([1.0])])[0].tolist() == [0.0]


def test_whitening_through_the_stages(pm):
    batch = batch_of([2.0, 0.0], [[1, 1], [1, 0]])
    out = stages(pm, "grpo", batch, disable_rewards_normalization=True, normalize_advantages=True)
    # trained advantages [2, 2, 0]: mu = 4/3, E[A^2] = 8/3, var = (8/3 - 16/9)*3/2 = 4/3
    sd = (4 / 3 + 1e-8) ** 0.5
    expected = [(2 - 4 / 3) / sd, (2 - 4 / 3) / sd, (0 - 4 / 3) / sd, (0 - 4 / 3) / sd]
    assert torch.cat(out.advantages).tolist() == pytest.approx(expected, abs=1e-6)


def test_whitening_with_no_trained_token_is_an_error(pm):
    with pytest.raises(PluginError) as excinfo:
        stages(pm, "grpo", batch_of([1.0, 0.0], [[0, 0], [0]]), normalize_advantages=True)
    assert str(excinfo.value) == (
        "--normalize-advantages: no token of the rollout batch is trained (every loss mask is 0), so there are "
        "no statistics to whiten with; check the loss masks, or drop --normalize-advantages."
    )


class WrongLength:
    @hookimpl
    def advantage(self, batch):
        return AdvantageOutput(advantages=[torch.zeros(1) for _ in batch.loss_masks])


def test_estimator_returning_the_wrong_shape_is_an_error(pm):
    pm.register(WrongLength(), name="wrong_length")
    with pytest.raises(PluginError) as excinfo:
        stages(pm, "wrong_length", batch_of([1.0], [[1, 1]]))
    assert str(excinfo.value) == (
        "--advantage-estimator 'wrong_length': advantages[0] has 1 values but sample 0 has 2 response tokens."
    )
