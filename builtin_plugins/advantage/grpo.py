"""GRPO group-relative advantages (Shao et al. 2024, DeepSeekMath)."""

from __future__ import annotations

from furlong.hooks import hookimpl

from ._group import group_relative_advantages
from ._rules import check_group_size


@hookimpl
def configure(args, report):
    """With one sample per prompt: a warning when that was asked for, and no std division.

    Flags derived: ``disable_grpo_std_normalization`` (True with ``--n-samples-per-prompt 1``).
    """
    check_group_size(args, report)


@hookimpl
def advantage(config, batch):
    """Every token of sample ``i`` gets ``A = R = (r_i - mean_g) / (std_g + 1e-6)``.

    ``mean_g`` and the Bessel-corrected ``std_g`` run over the trajectories of the group
    (``batch.group_ids``) in float64; the division happens only when the group has two or
    more trajectories and ``std_g > 0``, so equal-reward and one-sample groups get 0.
    ``--kl-coef`` has no effect.

    Flags read: ``disable_rewards_normalization`` (no mean subtraction and no std
    division), ``disable_grpo_std_normalization`` (no std division).

    Shapes: ``rewards`` [N], ``group_ids`` [N], ``loss_masks`` N x [T_i].

    :returns: ``AdvantageOutput(advantages, returns)``: N float32 tensors [T_i] each, equal.
    :raises PluginError: a non-finite reward, or siblings of one trajectory with different
        rewards or groups.

    Reference: Shao et al. 2024, DeepSeekMath, sec. 4.1.2 (outcome supervision).
    """
    return group_relative_advantages(config, batch)
