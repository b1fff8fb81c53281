"""Built-in advantage estimators, each called through a real plugin manager."""

import pytest
import torch

from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import AdvantageInput, AdvantageOutput, PluginError

from .configs import flag_defaults

@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def run(pm, name, batch, **flags):
    out = pm.get_plugin(name).advantage(config=flag_defaults().replace(**flags), batch=batch)
    assert isinstance(out, AdvantageOutput)
    return out


def outcome_batch(rewards, group_ids, lengths=None, trajectory_ids=None, **extra):
    lengths = lengths or [3] * len(rewards)
    return AdvantageInput(
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_ids=torch.tensor(group_ids, dtype=torch.int64),
        loss_masks=[torch.ones(t) for t in lengths],
        trajectory_ids=None if trajectory_ids is None else torch.tensor(trajectory_ids, dtype=torch.int64),
        **extra,
    )


def first_tokens(out):
    return [float(a[0]) for a in out.advantages]


# --- grpo / gspo ------------------------------------------------------------------------

# Four uneven groups, one of a single sample: statistics per group, never over the whole
# batch; (r - mean) / (Bessel std + 1e-6) per group.
C002_REWARDS = [0, 1, 1, 2.5, 2.5, 0.5, 1, 0, 0, 0]
C002_GROUPS = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3]
# g0: mean 2/3, std sqrt(1/3) -> -0.6667/0.57735 = -1.1547, 0.3333/0.57735 = 0.5774
# g1: equal rewards -> 0; g2: one sample -> 0; g3: mean 0.25, std 0.5 -> 1.5, -0.5
C002_EXPECTED = [-1.1547, 0.5774, 0.5774, 0.0, 0.0, 0.0, 1.5, -0.5, -0.5, -0.5]


@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_c002_uneven_and_singleton_groups(pm, name):
    out = run(pm, name, outcome_batch(C002_REWARDS, C002_GROUPS))
    assert first_tokens(out) == pytest.approx(C002_EXPECTED, abs=1e-4)
    assert all(torch.isfinite(a).all() for a in out.advantages)
    # the whole-batch-as-one-group bug gives +1.6953 to g1 and -0.3596 to g2
    assert first_tokens(out)[3] != pytest.approx(1.6953, abs=1e-2)


def test_c002_order_follows_input_order(pm):
    perm = [9, 3, 0, 5, 7, 1, 4, 8, 2, 6]
    out = run(pm, "grpo", outcome_batch([C002_REWARDS[p] for p in perm], [C002_GROUPS[p] for p in perm]))
    assert first_tokens(out) == pytest.approx([C002_EXPECTED[p] for p in perm], abs=1e-4)


def test_grpo_tokens_of_a_sample_share_its_advantage_and_returns_equal_advantages(pm):
    out = run(pm, "grpo", outcome_batch([1.0, 0.0], [0, 0], lengths=[4, 2]))
    # mean 0.5, std sqrt(0.5) = 0.70711 -> +-0.5/0.70711 = +-0.70711
    assert out.advantages[0].tolist() == pytest.approx([0.70711] * 4, abs=1e-4)
    assert out.advantages[1].tolist() == pytest.approx([-0.70711] * 2, abs=1e-4)
    assert [a.dtype for a in out.advantages] == [torch.float32, torch.float32]
    for a, r in zip(out.advantages, out.returns):
        assert torch.equal(a, r)


def test_grpo_advantages_sum_to_zero_within_each_group(pm):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(12, generator=gen).tolist()
    groups = [0, 1, 2] * 4
    out = run(pm, "grpo", outcome_batch(rewards, groups))
    values = torch.tensor(first_tokens(out))
    for g in range(3):
        assert float(values[torch.tensor(groups) == g].sum()) == pytest.approx(0.0, abs=1e-5)


def test_grpo_group_statistics_are_float64(pm):
    # rewards 1e8 + {0, 1}: a float32 mean would lose the +-0.5 deviations (float32 spacing at 1e8 is 8)
    batch = AdvantageInput(
        rewards=torch.tensor([1e8, 1e8 + 1], dtype=torch.float64),
        group_ids=torch.tensor([0, 0]), loss_masks=[torch.ones(1), torch.ones(1)],
    )
    out = run(pm, "grpo", batch)
    # deviations -0.5, 0.5; std sqrt(0.5) -> -+0.70711
    assert first_tokens(out) == pytest.approx([-0.70711, 0.70711], abs=1e-4)


def test_grpo_equal_reward_group_of_non_representable_values_stays_finite(pm):
    out = run(pm, "grpo", outcome_batch([0.1, 0.1, 0.1], [0, 0, 0]))
    assert first_tokens(out) == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)


def test_grpo_without_std_normalization_only_centers(pm):
    out = run(pm, "grpo", outcome_batch([1, 0, 0, 0], [0] * 4), disable_grpo_std_normalization=True)
    assert first_tokens(out) == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_grpo_without_rewards_normalization_keeps_raw_rewards(pm):
    out = run(pm, "grpo", outcome_batch([1, 0, 0, 0], [0] * 4), disable_rewards_normalization=True)
    assert first_tokens(out) == pytest.approx([1.0, 0.0, 0.0, 0.0])


def test_grpo_ignores_kl_coef(pm):
    kl = [torch.full((3,), 0.5), torch.full((3,), 0.5)]
    out = run(pm, "grpo", outcome_batch([1.0, 0.0], [0, 0], kl=kl), kl_coef=0.3)
    assert first_tokens(out) == pytest.approx([0.70711, -0.70711], abs=1e-4)


def test_grpo_trajectory_siblings_count_once_and_share_the_value(pm):
    # trajectory 7 has three Samples with reward 1; trajectory 8 one Sample with reward 0.
    # Statistics over trajectories [1, 0]: mean 0.5, std 0.70711 -> +-0.70711.
    batch = outcome_batch([1, 1, 1, 0], [0, 0, 0, 0], trajectory_ids=[7, 7, 7, 8])
    out = run(pm, "grpo", batch)
    assert first_tokens(out) == pytest.approx([0.70711, 0.70711, 0.70711, -0.70711], abs=1e-4)


def test_grpo_trajectory_siblings_with_different_rewards_is_an_error(pm):
    batch = outcome_batch([1, 0, 1], [0, 0, 0], trajectory_ids=[4, 5, 5])
    with pytest.raises(PluginError) as excinfo:
        run(pm, "grpo", batch)
    assert str(excinfo.value) == (
        "samples 1 and 2 of the rollout batch share trajectory id 5 but have different rewards (0.0 vs 1.0); "
        "every Sample of one trajectory must carry the same reward and group_index."
    )


def test_grpo_non_finite_reward_is_an_error(pm):
    with pytest.raises(PluginError) as excinfo:
        run(pm, "grpo", outcome_batch([1.0, float("nan")], [0, 0]))
    assert str(excinfo.value) == (
        "sample 1 of the rollout batch has reward nan; every trained sample needs a finite reward "
        "(check the reward plugin, --reward-key, or --custom-reward-post-process-path)."
    )


# --- reinforce_plus_plus_baseline ------------------------------------------------------


def test_reinforce_plus_plus_baseline_centers_without_std_and_subtracts_kl(pm):
    kl = [torch.tensor([0.2, 0.4, 5.0]), torch.tensor([0.0, 0.1, 0.3])]
    batch = outcome_batch([1.0, 0.0], [0, 0], kl=kl)
    batch.loss_masks = [torch.tensor([1.0, 1.0, 0.0]), torch.ones(3)]
    out = run(pm, "reinforce_plus_plus_baseline", batch, kl_coef=0.1)
    # r - mean = +-0.5 (no std division); A_t = 0.5 - 0.1*kl_t, masked token's KL ignored
    assert out.advantages[0].tolist() == pytest.approx([0.48, 0.46, 0.5])
    assert out.advantages[1].tolist() == pytest.approx([-0.5, -0.51, -0.53])
    assert all(torch.equal(a, r) for a, r in zip(out.advantages, out.returns))


def test_reinforce_plus_plus_baseline_needs_kl_when_kl_coef_is_set(pm):
    with pytest.raises(PluginError) as excinfo:
        run(pm, "reinforce_plus_plus_baseline", outcome_batch([1.0], [0]), kl_coef=0.1)
    assert str(excinfo.value) == (
        "--kl-coef 0.1 needs AdvantageInput.kl, but the batch has none. The core fills it when --kl-coef != 0."
    )


# --- reinforce_plus_plus ---------------------------------------------------------------


def test_reinforce_plus_plus_discounted_returns_by_hand(pm):
    batch = outcome_batch([1.0, 2.0], [0, 0], kl=[torch.tensor([0.2, 0.4, 5.0]), torch.zeros(2)], lengths=[3, 2])
    batch.loss_masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0])]
    out = run(pm, "reinforce_plus_plus", batch, gamma=0.5, kl_coef=0.1)
    # sample 0: rho = [-0.02, -0.04 + 1 (last trained position), 0 (masked: no KL)]
    # G_2 = 0; G_1 = 0.96; G_0 = -0.02 + 0.5*0.96 = 0.46
    assert out.advantages[0].tolist() == pytest.approx([0.46, 0.96, 0.0])
    # sample 1: raw reward 2 (not group-centered) at position 1; G = [0.5*2, 2]
    assert out.advantages[1].tolist() == pytest.approx([1.0, 2.0])
    assert all(torch.equal(a, r) for a, r in zip(out.advantages, out.returns))


def test_reinforce_plus_plus_gamma_one_is_a_reverse_cumulative_sum(pm):
    batch = outcome_batch([3.0], [0], kl=[torch.tensor([1.0, 2.0, 3.0])])
    out = run(pm, "reinforce_plus_plus", batch, kl_coef=0.5)
    # rho = [-0.5, -1.0, -1.5 + 3] -> G = [0.0, 0.5, 1.5]
    assert out.advantages[0].tolist() == pytest.approx([0.0, 0.5, 1.5])


def test_reinforce_plus_plus_fully_masked_sample_is_an_error(pm):
    batch = outcome_batch([1.0, 0.0], [0, 0])
    batch.loss_masks = [torch.ones(3), torch.zeros(3)]
    with pytest.raises(PluginError) as excinfo:
        run(pm, "reinforce_plus_plus", batch)
    assert str(excinfo.value).startswith("sample 1 of the rollout batch has no trained token")


# --- ppo (GAE) -------------------------------------------------------------------------

# V = [0.5, 0.4, 0.2], r = 1, gamma 0.9, lambda 0.8:
# delta_3 = 1 - 0.2 = 0.8; delta_2 = 0.9*0.2 - 0.4 = -0.22; delta_1 = 0.9*0.4 - 0.5 = -0.14
# A_3 = 0.8; A_2 = -0.22 + 0.72*0.8 = 0.356; A_1 = -0.14 + 0.72*0.356 = 0.11632
# R = A + V = [0.61632, 0.756, 1.0]
GAE_A = [0.11632, 0.356, 0.8]
GAE_R = [0.61632, 0.756, 1.0]


def test_ppo_gae_by_hand(pm):
    batch = outcome_batch([1.0], [0], values=[torch.tensor([0.5, 0.4, 0.2])])
    out = run(pm, "ppo", batch, gamma=0.9, lambd=0.8)
    assert out.advantages[0].tolist() == pytest.approx(GAE_A)
    assert out.returns[0].tolist() == pytest.approx(GAE_R)


def test_ppo_skips_masked_positions_without_decay(pm):
    batch = outcome_batch([1.0, 1.0], [0, 0], lengths=[4, 2],
                          values=[torch.tensor([0.5, 9.0, 0.4, 0.2]), torch.tensor([3.0, 4.0])])
    batch.loss_masks = [torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.zeros(2)]
    out = run(pm, "ppo", batch, gamma=0.9, lambd=0.8)
    assert out.advantages[0].tolist() == pytest.approx([GAE_A[0], 0.0, GAE_A[1], GAE_A[2]])
    assert out.returns[0].tolist() == pytest.approx([GAE_R[0], 0.0, GAE_R[1], GAE_R[2]])
    assert out.advantages[1].tolist() == [0.0, 0.0] and out.returns[1].tolist() == [0.0, 0.0]


def test_ppo_needs_values(pm):
    with pytest.raises(PluginError) as excinfo:
        run(pm, "ppo", outcome_batch([1.0], [0]))
    assert str(excinfo.value) == (
        "GAE needs AdvantageInput.values, but the batch has none. "
        "Critic values exist only when the run trains a critic (--advantage-estimator ppo)."
    )


# --- on_policy_distillation ------------------------------------------------------------


def test_on_policy_distillation_is_teacher_minus_old_log_probs(pm):
    batch = outcome_batch([0.0], [0], log_probs=[torch.tensor([-1.0, -2.0, -0.5])],
                          teacher_log_probs=[torch.tensor([-0.5, -2.5, -0.5])])
    out = run(pm, "on_policy_distillation", batch)
    assert out.advantages[0].tolist() == pytest.approx([0.5, -0.5, 0.0])
    assert out.returns[0].tolist() == pytest.approx([0.5, -0.5, 0.0])


def test_on_policy_distillation_needs_teacher_log_probs(pm):
    batch = outcome_batch([0.0], [0], log_probs=[torch.zeros(3)])
    with pytest.raises(PluginError) as excinfo:
        run(pm, "on_policy_distillation", batch)
    assert str(excinfo.value) == (
        "on-policy distillation needs AdvantageInput.teacher_log_probs, but the batch has none. Teacher log-probs "
        "come from --use-opd with --opd-type sglang (teacher /generate) or megatron (--opd-teacher-load)."
    )


# --- shared properties -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "gspo", "reinforce_plus_plus_baseline", "reinforce_plus_plus", "ppo"])
def test_extra_masked_tokens_change_nothing_on_trained_tokens(pm, name):
    kl = [torch.tensor([0.1, 0.2]), torch.tensor([0.3, 0.05])]
    values = [torch.tensor([0.4, 0.3]), torch.tensor([0.1, 0.2])]
    base = outcome_batch([1.0, 0.0], [0, 0], lengths=[2, 2], kl=kl, values=values)
    padded = outcome_batch([1.0, 0.0], [0, 0], lengths=[4, 2],
                           kl=[torch.tensor([0.1, 0.2, 7.0, -3.0]), kl[1]],
                           values=[torch.tensor([0.4, 0.3, 5.0, 6.0]), values[1]])
    padded.loss_masks[0] = torch.tensor([1.0, 1.0, 0.0, 0.0])
    flags = dict(gamma=1.0, lambd=0.9, kl_coef=0.1 if name != "ppo" else 0.0)
    a = run(pm, name, base, **flags)
    b = run(pm, name, padded, **flags)
    assert b.advantages[0][:2].tolist() == pytest.approx(a.advantages[0].tolist())
    assert b.advantages[1].tolist() == pytest.approx(a.advantages[1].tolist())


def test_reverse_discounted_sum_by_hand():
    from furlong.builtin_plugins.advantage._scan import reverse_discounted_sum

    rows = [torch.tensor([1.0, 2.0, 3.0]), torch.zeros(0), torch.tensor([4.0])]
    out = reverse_discounted_sum(rows, 0.5)
    # y_2 = 3; y_1 = 2 + 0.5*3 = 3.5; y_0 = 1 + 0.5*3.5 = 2.75
    assert [r.tolist() for r in out] == [[2.75, 3.5, 3.0], [], [4.0]]
    assert [r.tolist() for r in reverse_discounted_sum(rows, 1.0)] == [[6.0, 5.0, 3.0], [], [4.0]]
    assert out[0].dtype == torch.float64
