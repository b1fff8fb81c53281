"""PPO advantages by generalized advantage estimation (Schulman et al. 2016, GAE)."""

from __future__ import annotations

import os

from furlong.hooks import AdvantageOutput, hookimpl

from ._group import check_batch, masked_kl, require, trajectory_rewards
from ._scan import reverse_discounted_sum


@hookimpl
def configure(args, report):
    """PPO trains a critic; its requirements and the critic's defaults.

    Asks the core for a critic (``report.use_critic``): the chosen ``--train-backend`` must be
    able to build one (``fsdp`` can; the core refuses one that cannot, e.g. ``megatron``).
    Errors: ``furlong train-async`` without ``--use-rollout-logprobs``, ``--use-tis`` or
    ``--keep-old-actor`` (the old policy is gone when the batch trains).
    Flags derived, each unless given: ``critic_save`` = ``--save`` + ``_critic``;
    ``critic_load`` = the folder the critic of ``--load`` was saved to (``critic_save``
    when ``--load`` is ``--save``, else ``--load`` + ``_critic``); ``critic_lr`` = ``--lr``.
    """
    name = report.plugin
    report.use_critic(f"--advantage-estimator {name}")
    if args.train_mode == "async" and not (
            args.use_rollout_logprobs or args.use_tis or args.keep_old_actor):
        report.error(f"furlong train-async with --advantage-estimator {name} needs --use-rollout-logprobs, --use-tis "
                     "or --keep-old-actor (the old policy is gone by the time the batch trains).")
    save = report.default(args, "critic_save", f"{args.save.rstrip('/')}_critic" if args.save else None)
    same = bool(args.load and args.save) and os.path.realpath(args.load) == os.path.realpath(args.save)
    report.default(args, "critic_load", save if same else (f"{args.load.rstrip('/')}_critic" if args.load else None))
    report.default(args, "critic_lr", args.lr)


@hookimpl
def advantage(config, batch):
    """GAE over the trained positions of each sample, skipping masked ones.

    With the ``K`` positions where ``m = 1``, in order (masked positions are removed, so
    no decay crosses them): ``rho_k = -beta * kl_k``, ``rho_K += r`` (the raw reward);
    ``delta_k = rho_k + gamma * V_{k+1} - V_k`` with ``V_{K+1} = 0`` (also for truncated
    responses); ``A_k = delta_k + gamma * lambda * A_{k+1}``; ``R_k = A_k + V_k``. Masked
    positions get ``A = R = 0``; a sample with no trained token gets zeros. float64 inside.

    Flags read: ``gamma``, ``lambd``, ``kl_coef`` (the KL folded into the per-token rewards).

    :param batch: needs ``values`` (critic values, N x [T_i]); ``kl`` when ``--kl-coef`` != 0.
    :returns: ``AdvantageOutput(advantages, returns)``: N float32 tensors [T_i].
    :raises PluginError: ``values`` is missing; a non-finite reward.

    Reference: Schulman et al. 2016, "High-dimensional continuous control using
    generalized advantage estimation", eq. 16; Schulman et al. 2017, PPO, eq. 11-12.
    """
    import torch

    check_batch(batch)
    values = require(batch, "values", "GAE")
    trajectory_rewards(batch.rewards, batch.group_ids, batch.trajectory_ids)
    rewards = batch.rewards.reshape(-1).tolist()
    kl = masked_kl(batch, config.kl_coef)
    positions, deltas, kept_values = [], [], []
    for i, mask in enumerate(batch.loss_masks):
        idx = (mask.reshape(-1) > 0).nonzero().reshape(-1)
        v = values[i].reshape(-1).to(torch.float64)[idx]
        rho = torch.zeros(idx.numel(), dtype=torch.float64, device=v.device)
        if kl is not None:
            rho = rho - config.kl_coef * kl[i][idx]
        if idx.numel():
            rho[-1] += rewards[i]
        next_v = torch.cat([v[1:], v.new_zeros(1)]) if idx.numel() else v
        positions.append(idx)
        deltas.append(rho + config.gamma * next_v - v)
        kept_values.append(v)
    gae = reverse_discounted_sum(deltas, config.gamma * config.lambd)
    advantages, returns = [], []
    for mask, idx, a, v in zip(batch.loss_masks, positions, gae, kept_values):
        adv = torch.zeros(int(mask.numel()), dtype=torch.float32, device=a.device)
        ret = torch.zeros_like(adv)
        adv[idx] = a.to(torch.float32)
        ret[idx] = (a + v).to(torch.float32)
        advantages.append(adv)
        returns.append(ret)
    return AdvantageOutput(advantages=advantages, returns=returns)
