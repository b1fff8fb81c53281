"""The policy_loss plugin: clipped surrogate, dual clip, GSPO ratio, OPSM, TIS, entropy, KL."""

import math

import pytest
import torch

from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import LossInput, LossOutput, PluginError

from .configs import flag_defaults

def make_config(**overrides):
    return flag_defaults().replace(**overrides)


@pytest.fixture(scope="module")
def policy_loss():
    return get_plugin_manager().get_plugin("policy_loss").loss


def one_sample(ratios, advantages, mask=None, **extra):
    """A one-sample LossInput whose current/old ratio per token is ``ratios`` (old log-probs 0)."""
    logp = torch.log(torch.tensor(ratios, dtype=torch.float32)).requires_grad_(True)
    n = len(ratios)
    inp = LossInput(
        log_probs=[logp], old_log_probs=[torch.zeros(n)], advantages=[torch.tensor(advantages, dtype=torch.float32)],
        loss_masks=[torch.tensor(mask if mask is not None else [1.0] * n)], **extra,
    )
    return inp, logp


def test_clipped_surrogate_by_hand(policy_loss):
    inp, _ = one_sample([1.5, 0.5, 0.5, 1.0], [1.0, 1.0, -1.0, 2.0])
    out = policy_loss(config=make_config(), batch=inp)
    assert isinstance(out, LossOutput)
    # rho 1.5, A 1: max(-1.5, -1.2) = -1.2 (clipped)
    # rho 0.5, A 1: max(-0.5, -0.8) = -0.5
    # rho 0.5, A -1: max(0.5, 0.8) = 0.8 (clipped)
    # rho 1, A 2: -2
    assert out.token_loss[0].tolist() == pytest.approx([-1.2, -0.5, 0.8, -2.0], abs=1e-6)
    assert out.token_metrics["pg_clipfrac"][0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out.token_metrics["ppo_kl"][0].tolist() == pytest.approx([-math.log(1.5), math.log(2), math.log(2), 0.0])
    assert out.token_metrics["pg_loss"][0].tolist() == pytest.approx([-1.2, -0.5, 0.8, -2.0], abs=1e-6)


def test_asymmetric_clip_higher(policy_loss):
    inp, _ = one_sample([1.5, 0.5], [1.0, -1.0])
    out = policy_loss(config=make_config(eps_clip=0.1, eps_clip_high=0.28), batch=inp)
    # A > 0 clipped at 1 + 0.28; A < 0 clipped at 1 - 0.1: max(0.5, 0.9) = 0.9
    assert out.token_loss[0].tolist() == pytest.approx([-1.28, 0.9], abs=1e-6)


def test_gradient_is_zero_where_the_clip_is_active(policy_loss):
    inp, logp = one_sample([1.5, 0.5, 0.5, 0.9], [1.0, -1.0, 1.0, -1.0])
    out = policy_loss(config=make_config(), batch=inp)
    out.token_loss[0].sum().backward()
    # clipped tokens 0 and 1 get no gradient; unclipped: d(-rho*A)/dlogp = -rho*A
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -0.5, 0.9], abs=1e-6)


def test_dual_clip_only_for_negative_advantages(policy_loss):
    inp, _ = one_sample([5.0, 0.1, 2.0], [-1.0, 1.0, -0.5])
    out = policy_loss(config=make_config(eps_clip_c=3.0), batch=inp)
    # rho 5, A -1: max(5, 1.2) = 5 -> min(5, 3) = 3
    # rho 0.1, A 1: max(-0.1, -0.8) = -0.1; dual clip must not apply (it would give -3)
    # rho 2, A -0.5: max(1.0, 0.6) = 1.0 -> min(1.0, 1.5) = 1.0
    assert out.token_loss[0].tolist() == pytest.approx([3.0, -0.1, 1.0], abs=1e-6)


def test_dual_clip_bound_must_exceed_one(policy_loss):
    inp, _ = one_sample([1.0], [1.0])
    with pytest.raises(PluginError) as excinfo:
        policy_loss(config=make_config(eps_clip_c=1.0), batch=inp)
    assert str(excinfo.value) == "--eps-clip-c 1.0: the dual-clip bound must be > 1; raise it or leave it unset."


def test_sequence_ratio_level_uses_the_masked_mean_log_ratio(policy_loss):
    logp = torch.tensor([0.05, 0.15, 9.0], requires_grad=True)
    inp = LossInput(log_probs=[logp], old_log_probs=[torch.zeros(3)], advantages=[torch.ones(3)],
                    loss_masks=[torch.tensor([1.0, 1.0, 0.0])])
    out = policy_loss(config=make_config(policy_ratio_level="sequence"), batch=inp)
    # delta = mean(0 - [0.05, 0.15]) = -0.1 for both trained tokens; rho = e^0.1 = 1.105171 < 1.2
    assert out.token_loss[0][:2].tolist() == pytest.approx([-1.105171, -1.105171], abs=1e-6)
    assert out.token_metrics["ppo_kl"][0].tolist() == pytest.approx([-0.1, -0.1, 0.0])
    (out.token_loss[0] * torch.tensor([1.0, 1.0, 0.0])).sum().backward()
    # d/dlogp_t of sum_t -rho*A with rho = exp(mean(logp)): -2 * rho / 2 = -rho for each trained token
    assert logp.grad.tolist() == pytest.approx([-1.105171, -1.105171, 0.0], abs=1e-6)


def test_opsm_drops_negative_advantage_tokens_of_far_off_policy_samples(policy_loss):
    logp = torch.tensor([[-0.3, -0.3], [0.0, 0.0]])
    inp = LossInput(
        log_probs=[logp[0], logp[1]], old_log_probs=[torch.zeros(2), torch.zeros(2)],
        advantages=[torch.tensor([-1.0, 1.0]), torch.tensor([-1.0, -1.0])], loss_masks=[torch.ones(2), torch.ones(2)],
    )
    out = policy_loss(config=make_config(use_opsm=True, opsm_delta=0.1), batch=inp)
    # sample 0: mean(old - logp) = 0.3 > 0.1 -> its A<0 token is dropped; rho = e^-0.3 = 0.740818, A = 1 -> -0.740818
    assert out.token_loss[0].tolist() == pytest.approx([0.0, -0.740818], abs=1e-6)
    # sample 1 is on-policy (0 <= 0.1): kept, -1*(-1) = 1
    assert out.token_loss[1].tolist() == pytest.approx([1.0, 1.0])
    assert out.token_metrics["opsm_clipfrac"][0].tolist() == [1.0, 0.0]


def test_tis_weights_are_clamped_detached_and_multiply_the_loss(policy_loss):
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    rollout = torch.tensor([-1.5, -0.2], requires_grad=True)
    inp = LossInput(log_probs=[logp], old_log_probs=[torch.tensor([-1.0, -1.0])], advantages=[torch.ones(2)],
                    loss_masks=[torch.ones(2)], rollout_log_probs=[rollout])
    out = policy_loss(config=make_config(use_tis=True, tis_clip=1.5, tis_clip_low=0.5), batch=inp)
    # raw ratio exp(old - rollout) = [e^0.5, e^-0.8] = [1.648721, 0.449329] -> w = [1.5, 0.5]
    assert out.token_loss[0].tolist() == pytest.approx([-1.5, -0.5])
    m = out.token_metrics
    assert m["tis"][0].tolist() == pytest.approx([1.648721, 0.449329], abs=1e-6)
    assert m["tis_clipfrac"][0].tolist() == [1.0, 1.0]
    assert m["tis_abs"][0].tolist() == pytest.approx([0.648721, 0.550671], abs=1e-6)
    assert m["ois"][0].tolist() == pytest.approx([1.0, 1.0])
    # ESS of w: (1.5 + 0.5)^2 / (2 * (2.25 + 0.25)) = 0.8, on every token of the sample
    assert m["ess_ratio"][0].tolist() == pytest.approx([0.8, 0.8])
    out.token_loss[0].sum().backward()
    # gradient = w * d(-rho*A)/dlogp = -w; nothing flows into the rollout log-probs
    assert logp.grad.tolist() == pytest.approx([-1.5, -0.5])
    assert rollout.grad is None


def test_tis_needs_rollout_log_probs(policy_loss):
    inp, _ = one_sample([1.0], [1.0])
    with pytest.raises(PluginError) as excinfo:
        policy_loss(config=make_config(use_tis=True), batch=inp)
    assert str(excinfo.value) == (
        "--use-tis: the batch has no rollout log-probs; the rollout engine must return per-token "
        "log-probs (Sample.rollout_log_probs) for truncated importance sampling."
    )


def test_train_rollout_mismatch_metrics(policy_loss):
    inp, _ = one_sample([1.0, 1.0], [1.0, 1.0], rollout_log_probs=[torch.tensor([-0.5, 0.25])])
    out = policy_loss(config=make_config(), batch=inp)
    # |old - rollout| = [0.5, 0.25]; low_var_kl(rollout, old): x = rollout - old, k3 = e^-x - 1 + x
    assert out.token_metrics["train_rollout_logprob_abs_diff"][0].tolist() == pytest.approx([0.5, 0.25])
    expected = [math.exp(0.5) - 1 - 0.5, math.exp(-0.25) - 1 + 0.25]
    assert out.token_metrics["train_rollout_kl"][0].tolist() == pytest.approx(expected, abs=1e-6)


def test_entropy_bonus_is_subtracted(policy_loss):
    inp, _ = one_sample([1.0, 1.0], [1.0, -1.0], entropy=[torch.tensor([0.7, 0.3], requires_grad=True)])
    out = policy_loss(config=make_config(entropy_coef=0.01), batch=inp)
    # l = [-1, 1]; token_loss = l - 0.01 * H
    assert out.token_loss[0].tolist() == pytest.approx([-1.007, 0.997])
    assert out.token_metrics["entropy_loss"][0].requires_grad


def test_entropy_is_reported_detached_when_its_coefficient_is_zero(policy_loss):
    inp, _ = one_sample([1.0], [1.0], entropy=[torch.tensor([0.7], requires_grad=True)])
    out = policy_loss(config=make_config(), batch=inp)
    assert out.token_loss[0].tolist() == pytest.approx([-1.0])
    assert out.token_metrics["entropy_loss"][0].tolist() == pytest.approx([0.7])
    assert not out.token_metrics["entropy_loss"][0].requires_grad


def test_kl_loss_is_added_with_a_positive_sign_c010(policy_loss):
    # the KL term is added, never subtracted:
    # pg 0.5 (rho 1, A -0.5), KL 0.2 (k1, logp - ref = 0.2), coef 0.1 -> 0.52
    ref = torch.tensor([-0.2], requires_grad=True)
    inp, _ = one_sample([1.0], [-0.5], ref_log_probs=[ref])
    out = policy_loss(config=make_config(use_kl_loss=True, kl_loss_coef=0.1), batch=inp)
    assert out.token_loss[0].tolist() == pytest.approx([0.52])
    assert out.token_metrics["kl_loss"][0].tolist() == pytest.approx([0.2])
    out.token_loss[0].sum().backward()
    # d(total)/d(KL) = +0.1; KL = logp - ref, so d(total)/d(ref) = -0.1 (the sign bug gives +0.1)
    assert ref.grad.tolist() == pytest.approx([-0.1])


def test_kl_loss_at_coefficient_zero_is_reported_but_not_added(policy_loss):
    inp, _ = one_sample([1.0], [-0.5], ref_log_probs=[torch.tensor([-0.2])])
    out = policy_loss(config=make_config(use_kl_loss=True, kl_loss_coef=0.0), batch=inp)
    assert out.token_loss[0].tolist() == pytest.approx([0.5])
    assert out.token_metrics["kl_loss"][0].tolist() == pytest.approx([0.2])


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
def test_identical_policy_and_reference_give_zero_kl(policy_loss, kl_type):
    inp, logp = one_sample([0.8, 1.3], [-0.5, 1.0])
    inp.ref_log_probs = [logp.detach().clone()]
    out = policy_loss(config=make_config(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type=kl_type), batch=inp)
    assert out.token_metrics["kl_loss"][0].tolist() == [0.0, 0.0]
    assert torch.equal(out.token_loss[0], out.token_metrics["pg_loss"][0])


def test_unbiased_kl_multiplies_by_the_current_over_old_ratio(policy_loss):
    inp, _ = one_sample([2.0], [0.0], ref_log_probs=[torch.tensor([math.log(2.0) - 0.2])])
    out = policy_loss(config=make_config(use_kl_loss=True, kl_loss_coef=1.0, use_unbiased_kl=True), batch=inp)
    # k1 = 0.2, times pi/pi_old = 2 -> 0.4
    assert out.token_metrics["kl_loss"][0].tolist() == pytest.approx([0.4])


def test_kl_loss_needs_reference_log_probs(policy_loss):
    inp, _ = one_sample([1.0], [1.0])
    with pytest.raises(PluginError) as excinfo:
        policy_loss(config=make_config(use_kl_loss=True), batch=inp)
    assert str(excinfo.value) == (
        "--use-kl-loss: the batch has no reference log-probs; set --ref-load so the reference is loaded."
    )


def test_masked_tokens_with_garbage_change_nothing(policy_loss):
    flags = dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", use_tis=True,
                 entropy_coef=0.01, use_opsm=True, eps_clip_c=3.0)

    def build(extra):
        logp = torch.tensor([-0.4, -1.1] + extra["logp"], requires_grad=True)
        return logp, LossInput(
            log_probs=[logp], old_log_probs=[torch.tensor([-0.5, -1.0] + extra["old"])],
            advantages=[torch.tensor([0.7, -0.3] + extra["adv"])],
            loss_masks=[torch.tensor([1.0, 1.0] + [0.0] * len(extra["logp"]))],
            ref_log_probs=[torch.tensor([-0.6, -0.9] + extra["ref"])],
            rollout_log_probs=[torch.tensor([-0.45, -1.2] + extra["roll"])],
            entropy=[torch.tensor([0.5, 0.8] + extra["ent"])],
        )

    nan, inf = float("nan"), float("inf")
    logp_a, plain = build(dict(logp=[], old=[], adv=[], ref=[], roll=[], ent=[]))
    logp_b, padded = build(dict(logp=[-3.0, 0.0], old=[nan, 50.0], adv=[inf, nan], ref=[-inf, 40.0],
                                roll=[nan, -60.0], ent=[2.0, 2.0]))
    for policy in ("token", "sequence"):
        config = make_config(**flags, policy_ratio_level=policy)
        a = policy_loss(config=config, batch=plain)
        b = policy_loss(config=config, batch=padded)
        assert b.token_loss[0][:2].tolist() == pytest.approx(a.token_loss[0].tolist(), abs=1e-7)
        for name, rows in a.token_metrics.items():
            assert b.token_metrics[name][0][:2].tolist() == pytest.approx(rows[0].tolist(), abs=1e-7), name
        mask = padded.loss_masks[0]
        logp_a.grad = logp_b.grad = None
        a.token_loss[0].sum().backward()
        torch.where(mask > 0, b.token_loss[0], 0.0).sum().backward()
        assert logp_b.grad[:2].tolist() == pytest.approx(logp_a.grad.tolist(), abs=1e-7)
        assert logp_b.grad[2:].tolist() == [0.0, 0.0]
