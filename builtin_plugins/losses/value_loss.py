"""Clipped value (critic) loss of PPO (Schulman et al. 2017)."""

from __future__ import annotations

from furlong.hooks import LossOutput, PluginError, hookimpl


@hookimpl
def loss(config, batch):
    """Per-token clipped squared error of the critic's values against the returns.

    ``v_clip = v_old + clip(v - v_old, -value_clip, value_clip)``;
    ``l = max((v_clip - R)**2, (v - R)**2)``; metrics ``value_loss`` (= ``l``), ``vf_clipfrac =
    1[|v - v_old| > value_clip]`` and ``vpred_mean`` (= ``v``, detached: its reduction is the mean
    value). Flags read: ``value_clip``.

    Shapes: lists of ``N`` float32 tensors [T_i].

    :param batch: ``LossInput`` with ``values`` (current critic, carries grad),
        ``old_values`` (the critic's values when the rollout was scored), ``returns`` and
        ``loss_masks`` (masked positions give loss 0 and no gradient).
    :returns: ``LossOutput(token_loss=[l_i], token_metrics={"value_loss", "vf_clipfrac", "vpred_mean"})``.
    :raises PluginError: ``values``, ``old_values`` or ``returns`` is missing.

    Reference: Schulman et al. 2017, PPO; value clipping as in Miles ``value_loss_function``.
    """
    import torch

    for field in ("values", "old_values", "returns"):
        if getattr(batch, field) is None:
            raise PluginError(
                f"the clipped value loss needs LossInput.{field} but the batch has none; it trains the critic of "
                "--advantage-estimator ppo, whose train backend must pass values, old values and returns."
            )
    token_loss, losses, clipfracs, vpreds = [], [], [], []
    for v, v_old, ret, mask in zip(batch.values, batch.old_values, batch.returns, batch.loss_masks):
        v = v.float()
        active = mask.to(v.device) > 0
        # masked positions get v_old = R = v, so their loss and gradient are exactly 0
        v_old = torch.where(active, v_old.to(v.device).float(), v.detach())
        ret = torch.where(active, ret.to(v.device).float(), v.detach())
        v_clip = v_old + (v - v_old).clamp(-config.value_clip, config.value_clip)
        value = torch.maximum((v_clip - ret) ** 2, (v - ret) ** 2)
        token_loss.append(value)
        losses.append(value)
        clipfracs.append(((v - v_old).abs() > config.value_clip).float())
        vpreds.append(v.detach())
    return LossOutput(token_loss=token_loss,
                      token_metrics={"value_loss": losses, "vf_clipfrac": clipfracs, "vpred_mean": vpreds})
