"""GSPO advantages: GRPO's group-relative rewards (Zheng et al. 2025, Group Sequence Policy Optimization)."""

from __future__ import annotations

from furlong.hooks import hookimpl

from ._group import group_relative_advantages
from ._rules import check_group_size


@hookimpl
def configure(args, report):
    """GSPO's sequence-level importance ratio by default, and grpo's one-sample rules.

    Flags derived: ``policy_ratio_level`` = ``sequence`` unless given;
    ``disable_grpo_std_normalization`` as grpo.

    Reference: Zheng et al. 2025, "Group Sequence Policy Optimization", sec. 4.1 (eq. 7).
    """
    report.default(args, "policy_ratio_level", "sequence")
    check_group_size(args, report)


@hookimpl
def advantage(config, batch):
    """Every token of sample ``i`` gets ``A = R = (r_i - mean_g) / (std_g + 1e-6)``, as GRPO.

    GSPO differs from GRPO in the loss, not the advantage: its sequence-level importance
    ratio is ``--policy-ratio-level sequence`` of ``policy_loss``, the default when this
    estimator is chosen. Statistics as in ``grpo`` (float64, Bessel std over the group's
    trajectories, no division for equal-reward or one-sample groups).

    Flags read: ``disable_rewards_normalization``, ``disable_grpo_std_normalization``.

    :returns: ``AdvantageOutput(advantages, returns)``: N float32 tensors [T_i] each.
    :raises PluginError: a non-finite reward, or siblings of one trajectory that disagree.

    Reference: Zheng et al. 2025, "Group Sequence Policy Optimization", sec. 4.1 (eq. 7).
    """
    return group_relative_advantages(config, batch)
