"""Group statistics shared by the built-in advantage estimators."""

from __future__ import annotations

from furlong.hooks import PluginError

STD_EPS = 1e-6


def check_batch(batch) -> None:
    """Check that the per-sample fields of an ``AdvantageInput`` agree in length.

    :raises ValueError: ``rewards``, ``group_ids``, ``trajectory_ids`` or ``loss_masks``
        disagree on the number of samples, or an optional per-token list has the wrong
        number of samples or a tensor of the wrong length.
    """
    n = len(batch.loss_masks)
    sizes = {"rewards": int(batch.rewards.numel()), "group_ids": int(batch.group_ids.numel())}
    if batch.trajectory_ids is not None:
        sizes["trajectory_ids"] = int(batch.trajectory_ids.numel())
    for name, size in sizes.items():
        if size != n:
            raise ValueError(f"AdvantageInput.{name} has {size} entries but loss_masks has {n} samples")
    for name in ("log_probs", "ref_log_probs", "kl", "values", "teacher_log_probs"):
        rows = getattr(batch, name)
        if rows is None:
            continue
        if len(rows) != n:
            raise ValueError(f"AdvantageInput.{name} has {len(rows)} samples but loss_masks has {n}")
        for i, (row, mask) in enumerate(zip(rows, batch.loss_masks)):
            if row.numel() != mask.numel():
                raise ValueError(
                    f"AdvantageInput.{name}[{i}] has {row.numel()} tokens but loss_masks[{i}] has {mask.numel()}"
                )


def require(batch, field: str, why: str) -> list:
    """``batch.<field>``, or a PluginError saying what needs it (``why``) when it is None."""
    rows = getattr(batch, field)
    if rows is None:
        raise PluginError(f"{why} needs AdvantageInput.{field}, but the batch has none. {_FIELD_HINTS[field]}")
    return rows


_FIELD_HINTS = {
    "values": "Critic values exist only when the run trains a critic (--advantage-estimator ppo).",
    "log_probs": "Old-policy log-probs come from the training forward, after the advantages, under "
    "--reuse-train-log-probs (the default with one step per rollout): an estimator that reads them sets "
    "reuse_train_log_probs = False in its configure hook (report.default).",
    "teacher_log_probs": "Teacher log-probs come from --use-opd with --opd-type sglang (teacher /generate) "
    "or megatron (--opd-teacher-load).",
    "kl": "The core fills it when --kl-coef != 0.",
}


def trajectory_rewards(rewards, group_ids, trajectory_ids):
    """One reward and one group per trajectory, checking that siblings agree.

    :param rewards: float [N]; :param group_ids: int64 [N]; :param trajectory_ids: int64
        [N] or None (every sample is its own trajectory).
    :returns: ``(traj_rewards float64 [K], traj_groups int64 [K], inverse int64 [N])`` where
        ``inverse[i]`` is the trajectory of sample ``i``.
    :raises PluginError: a reward is not finite; two samples of one trajectory carry
        different rewards or different group ids (the message names both samples).
    """
    import torch

    r = rewards.detach().reshape(-1).to(torch.float64)
    bad = (~torch.isfinite(r)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise PluginError(
            f"sample {i} of the rollout batch has reward {float(r[i])}; every trained sample needs a finite reward "
            "(check the reward plugin, --reward-key, or --custom-reward-post-process-path)."
        )
    groups = group_ids.reshape(-1).to(device=r.device, dtype=torch.int64)
    if trajectory_ids is None:
        return r, groups, torch.arange(r.numel(), device=r.device)
    traj = trajectory_ids.reshape(-1).to(device=r.device, dtype=torch.int64)
    unique, inverse = torch.unique(traj, return_inverse=True)
    k = unique.numel()
    r_max = torch.full((k,), float("-inf"), dtype=torch.float64, device=r.device)
    r_max = r_max.scatter_reduce(0, inverse, r, "amax", include_self=False)
    r_min = r_max.clone().scatter_reduce(0, inverse, r, "amin", include_self=False)
    g_max = torch.zeros(k, dtype=torch.int64, device=r.device)
    g_max = g_max.scatter_reduce(0, inverse, groups, "amax", include_self=False)
    g_min = g_max.clone().scatter_reduce(0, inverse, groups, "amin", include_self=False)
    for values, per_traj, what in ((r, r_max != r_min, "rewards"), (groups, g_max != g_min, "group ids")):
        if per_traj.any():
            t = int(per_traj.nonzero()[0])
            members = (inverse == t).nonzero().reshape(-1).tolist()
            first = members[0]
            other = next(j for j in members if values[j] != values[first])
            raise PluginError(
                f"samples {first} and {other} of the rollout batch share trajectory id {int(unique[t])} but have "
                f"different {what} ({values[first].item()} vs {values[other].item()}); every Sample of one "
                "trajectory must carry the same reward and group_index."
            )
    return r_max, g_max, inverse


def group_normalized_rewards(rewards, group_ids, trajectory_ids, *, subtract_mean: bool, divide_std: bool):
    """Group-relative rewards: ``r - mean_g``, then ``/ (std_g + 1e-6)`` when ``std_g > 0``.

    Statistics run over the trajectories of each group (a trajectory counts once, whatever
    its number of Samples), in float64; ``std_g`` is the Bessel-corrected (N-1) standard
    deviation, taken only for groups of two or more trajectories. A group of equal rewards
    gets 0 (no division); a one-trajectory group gets ``r - r = 0``. Siblings of one
    trajectory get the trajectory's value.

    :param rewards: float [N]; :param group_ids: int64 [N]; :param trajectory_ids: int64
        [N] or None.
    :param subtract_mean: subtract the group mean (off: ``--disable-rewards-normalization``).
    :param divide_std: divide by the group std (ignored unless ``subtract_mean``).
    :returns: float32 [N] in input order.
    :raises PluginError: see :func:`trajectory_rewards`.

    Reference: Shao et al. 2024, DeepSeekMath, sec. 4.1.2 (outcome supervision).
    """
    import torch

    traj_r, traj_g, inverse = trajectory_rewards(rewards, group_ids, trajectory_ids)
    out = traj_r
    if subtract_mean:
        _, g_inv = torch.unique(traj_g, return_inverse=True)
        n_groups = int(g_inv.max()) + 1 if g_inv.numel() else 0
        count = torch.bincount(g_inv, minlength=n_groups).to(torch.float64)
        mean = torch.zeros(n_groups, dtype=torch.float64, device=traj_r.device).index_add(0, g_inv, traj_r) / count
        out = traj_r - mean[g_inv]
        if divide_std:
            sq = torch.zeros_like(mean).index_add(0, g_inv, out * out)
            std = torch.where(count > 1, torch.sqrt(sq / (count - 1).clamp_min(1.0)), torch.zeros_like(sq))[g_inv]
            out = torch.where(std > 0, out / (std + STD_EPS), out)
    return out[inverse].to(torch.float32)


def broadcast_to_tokens(values, loss_masks) -> list:
    """Sample values [N] as constant float32 tensors [T_i], one per sample (masked tokens included)."""
    import torch

    return [
        torch.full((int(m.numel()),), float(v), dtype=torch.float32, device=m.device)
        for v, m in zip(values.tolist(), loss_masks)
    ]


def masked_kl(batch, kl_coef: float) -> list | None:
    """``batch.kl`` with masked tokens zeroed, or None when ``kl_coef`` is 0.

    :raises PluginError: ``kl_coef`` != 0 and the batch carries no ``kl``.
    """
    import torch

    if kl_coef == 0:
        return None
    rows = require(batch, "kl", f"--kl-coef {kl_coef}")
    return [
        torch.where(m.to(k.device) > 0, torch.nan_to_num(k.to(torch.float64), nan=0.0), 0.0)
        for k, m in zip(rows, batch.loss_masks)
    ]


def group_relative_advantages(config, batch):
    """GRPO/GSPO outcome advantages: each trajectory's group-normalized reward on every token.

    Flags read: ``disable_rewards_normalization``, ``disable_grpo_std_normalization``.

    :returns: ``AdvantageOutput(advantages, returns)``, N float32 tensors [T_i], equal.
    """
    from furlong.hooks import AdvantageOutput

    check_batch(batch)
    normalize = not config.disable_rewards_normalization
    scores = group_normalized_rewards(
        batch.rewards, batch.group_ids, batch.trajectory_ids,
        subtract_mean=normalize, divide_std=normalize and not config.disable_grpo_std_normalization,
    )
    advantages = broadcast_to_tokens(scores, batch.loss_masks)
    return AdvantageOutput(advantages=advantages, returns=[a.clone() for a in advantages])
