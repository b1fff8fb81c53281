"""REINFORCE++ discounted token returns with a per-token KL penalty (Hu 2025, REINFORCE++)."""

from __future__ import annotations

from furlong.hooks import AdvantageOutput, PluginError, hookimpl

from ._group import check_batch, masked_kl, trajectory_rewards
from ._rules import require_whitening
from ._scan import reverse_discounted_sum


@hookimpl
def configure(args, report):
    """Requires ``--normalize-advantages``: the batch-wide whitening does the scaling."""
    require_whitening(args, report)


@hookimpl
def advantage(config, batch):
    """``A_t = R_t = G_t`` with ``G_t = rho_t + gamma * G_{t+1}``, ``G_T = 0``.

    Token rewards: ``rho_t = -beta * kl_t * m_t`` (``beta`` = ``--kl-coef``, ``kl`` the
    core's reward-shaping KL; masked tool/env tokens give no KL), plus the sample's raw
    reward ``r_i`` (not group-centered) at its last position with ``m_t = 1``. The sum
    runs over every position, masked ones included, in float64.

    Flags read: ``gamma``, ``kl_coef``.

    :returns: ``AdvantageOutput(advantages, returns)``: N float32 tensors [T_i] each, equal.
    :raises PluginError: a sample with no trained token (no position to put the reward
        on); ``--kl-coef`` != 0 without ``batch.kl``; a non-finite reward; siblings of
        one trajectory with different rewards.

    Reference: Hu 2025, "REINFORCE++: An efficient RLHF algorithm with robustness to both
    prompt and reward models", sec. 3 (token-level KL penalty, discounted return).
    """
    import torch

    check_batch(batch)
    trajectory_rewards(batch.rewards, batch.group_ids, batch.trajectory_ids)
    rewards = batch.rewards.reshape(-1).tolist()
    kl = masked_kl(batch, config.kl_coef)
    token_rewards = []
    for i, mask in enumerate(batch.loss_masks):
        trained = (mask.reshape(-1) > 0).nonzero()
        if trained.numel() == 0:
            raise PluginError(
                f"sample {i} of the rollout batch has no trained token (its loss mask is all 0), so REINFORCE++ "
                "has no position for its reward; drop such samples in a filter or use an estimator with a "
                "sequence-level advantage (grpo, reinforce_plus_plus_baseline)."
            )
        rho = torch.zeros(int(mask.numel()), dtype=torch.float64, device=mask.device)
        if kl is not None:
            rho = rho - config.kl_coef * kl[i]
        rho[int(trained[-1])] += rewards[i]
        token_rewards.append(rho)
    returns = [g.to(torch.float32) for g in reverse_discounted_sum(token_rewards, config.gamma)]
    return AdvantageOutput(advantages=[g.clone() for g in returns], returns=returns)
