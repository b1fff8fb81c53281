"""REINFORCE++-baseline: group-mean baseline minus the reward-shaping KL (Hu 2025, REINFORCE++)."""

from __future__ import annotations

from furlong.hooks import AdvantageOutput, hookimpl

from ._group import check_batch, group_normalized_rewards, masked_kl
from ._rules import require_whitening


@hookimpl
def configure(args, report):
    """Requires ``--normalize-advantages``: the batch-wide whitening does the scaling."""
    require_whitening(args, report)


@hookimpl
def advantage(config, batch):
    """``A_t = R_t = (r_i - mean_g) - beta * kl_t * m_t`` for every token of sample ``i``.

    ``mean_g`` runs over the trajectories of the group in float64 (no std division; the
    batch-wide whitening of ``--normalize-advantages``, required with this estimator, does
    the scaling). ``beta`` is ``--kl-coef``; ``kl`` is the core's reward-shaping KL
    (``batch.kl``), zeroed on masked tokens.

    Flags read: ``disable_rewards_normalization`` (no mean subtraction), ``kl_coef``.

    :returns: ``AdvantageOutput(advantages, returns)``: N float32 tensors [T_i] each.
    :raises PluginError: ``--kl-coef`` != 0 without ``batch.kl``; a non-finite reward;
        siblings of one trajectory that disagree.

    Reference: Hu 2025, "REINFORCE++: An efficient RLHF algorithm with robustness to both
    prompt and reward models", sec. 3 (group baseline variant).
    """
    import torch

    check_batch(batch)
    centered = group_normalized_rewards(
        batch.rewards, batch.group_ids, batch.trajectory_ids,
        subtract_mean=not config.disable_rewards_normalization, divide_std=False,
    ).tolist()
    kl = masked_kl(batch, config.kl_coef)
    advantages = []
    for i, mask in enumerate(batch.loss_masks):
        adv = torch.full((int(mask.numel()),), centered[i], dtype=torch.float64, device=mask.device)
        if kl is not None:
            adv = adv - config.kl_coef * kl[i]
        advantages.append(adv.to(torch.float32))
    return AdvantageOutput(advantages=advantages, returns=[a.clone() for a in advantages])
