"""GRPO group-relative advantages (Shao et al. 2024, DeepSeekMath)."""

from __future__ import annotations

from furlong.hooks import AdvantageOutput, hookimpl

from ._group import broadcast_to_tokens, check_batch, group_normalized_rewards


@hookimpl
def advantage(args, batch):
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
    check_batch(batch)
    normalize = not args.disable_rewards_normalization
    scores = group_normalized_rewards(
        batch.rewards, batch.group_ids, batch.trajectory_ids,
        subtract_mean=normalize, divide_std=normalize and not args.disable_grpo_std_normalization,
    )
    advantages = broadcast_to_tokens(scores, batch.loss_masks)
    return AdvantageOutput(advantages=advantages, returns=[a.clone() for a in advantages])
