"""The fixed stages the core runs around the chosen ``advantage`` estimator.

Order, the same for every estimator, built-in or third-party:

1. reward post-processing: done by the caller on the samples
   (``--custom-reward-post-process-path``), so ``batch.rewards`` arrive as given; group
   normalization belongs to the estimators that use it (grpo, gspo,
   reinforce_plus_plus_baseline);
2. reward-shaping KL: when ``--kl-coef`` != 0, ``batch.kl = KL_est(pi_old, pi_ref)`` with
   ``--kl-loss-type``, 0 on masked tokens;
3. the chosen ``advantage`` plugin;
4. the OPD modifier (``--use-opd``): ``A <- A - opd_kl_coef * (logp_old - logp_teacher)``;
5. whitening (``--normalize-advantages``) over the trained tokens of the whole rollout.
"""

from __future__ import annotations

from typing import Any

import attrs

from furlong.hooks import AdvantageInput, AdvantageOutput, PluginError, RunConfig
from furlong.hooks.contract import check_advantage_output
from furlong.kit.kl import KL_TYPES, kl_estimate

__all__ = ["compute_advantages", "shaping_kl", "apply_opd", "whiten"]

WHITEN_EPS = 1e-8


async def compute_advantages(
    config: RunConfig, pm: Any, batch: AdvantageInput, estimator_name: str, estimator_flag: str
) -> AdvantageOutput:
    """Run stages 2-5 on one whole rollout batch (all data-parallel shards gathered).

    Flags read: ``kl_coef``, ``kl_loss_type``, ``use_opd``, ``opd_kl_coef``,
    ``normalize_advantages``; the estimator reads its own.

    :param config: the launch configuration.
    :param pm: the plugin manager.
    :param batch: ``AdvantageInput`` of N samples (not modified; the plugin gets a copy
        with ``kl`` filled when ``--kl-coef`` != 0).
    :param estimator_name: the chosen plugin (``--advantage-estimator``, or a dotted path
        registered by the core for ``--custom-advantage-function-path``).
    :param estimator_flag: the flag that chose it, for error messages.
    :returns: ``AdvantageOutput``: N float32 advantages [T_i] and the estimator's returns
        (float32, or None). OPD and whitening change the advantages only.
    :raises PluginError: a stage lacks the log-probs it needs, the estimator returns the
        wrong shapes, or whitening finds no trained token.
    """
    if config.kl_coef != 0:
        for field in ("log_probs", "ref_log_probs"):
            if getattr(batch, field) is None:
                raise PluginError(
                    f"--kl-coef {config.kl_coef}: reward-shaping KL needs AdvantageInput.{field}, but the batch has "
                    "none; the reference model is loaded when --kl-coef != 0 (set --ref-load)."
                )
        batch = attrs.evolve(
            batch, kl=shaping_kl(batch.log_probs, batch.ref_log_probs, batch.loss_masks, config.kl_loss_type)
        )
    out = await pm.call_chosen("advantage", estimator_name, estimator_flag, config=config, batch=batch)
    advantages, returns = _checked_output(out, batch, estimator_name, estimator_flag)
    if config.use_opd:
        for field in ("teacher_log_probs", "log_probs"):
            if getattr(batch, field) is None:
                raise PluginError(
                    f"--use-opd: the OPD modifier needs AdvantageInput.{field}, but the batch has none; teacher "
                    "log-probs come from --opd-type sglang (teacher /generate) or megatron (--opd-teacher-load)."
                )
        advantages = apply_opd(advantages, batch.log_probs, batch.teacher_log_probs, config.opd_kl_coef)
    if config.normalize_advantages:
        advantages = whiten(advantages, batch.loss_masks)
    return AdvantageOutput(advantages=advantages, returns=returns)


def shaping_kl(log_probs: list, ref_log_probs: list, loss_masks: list, kl_type: str) -> list:
    """Per-token reward-shaping KL ``KL_est(pi_old, pi_ref)``, 0 on masked tokens.

    Same estimators as the ``policy_loss`` KL term (float32, ``x = logp_old - logp_ref``):
    ``k1 = x``, ``k2 = x**2/2``, ``k3 = exp(-x) - 1 + x``, ``low_var_kl`` = k3 with ``-x``
    sanitized (NaN -> 0, +-inf -> +-20) and clamped to [-20, 20], result clamped to
    [-10, 10]. Non-finite values on trained tokens become 0.

    :returns: N float32 tensors [T_i].
    :raises PluginError: unknown ``--kl-loss-type``.

    Reference: Schulman 2020, "Approximating KL divergence"; Ouyang et al. 2022 (per-token
    KL penalty folded into the reward).
    """
    import torch

    if kl_type not in KL_TYPES:
        raise PluginError(f"--kl-loss-type {kl_type!r}: unknown KL estimator; choose one of {', '.join(KL_TYPES)}.")
    out = []
    for lp, ref, mask in zip(log_probs, ref_log_probs, loss_masks):
        active = mask.reshape(-1).to(lp.device) > 0
        lp = lp.detach().reshape(-1).float()
        ref = torch.where(active, ref.detach().reshape(-1).to(lp.device).float(), lp)
        kl = kl_estimate(lp, ref, kl_type)
        out.append(torch.where(active, torch.nan_to_num(kl, nan=0.0, posinf=0.0, neginf=0.0), 0.0))
    return out


def apply_opd(advantages: list, log_probs: list, teacher_log_probs: list, coef: float) -> list:
    """``A_t <- A_t - coef * (logp_old_t - logp_teacher_t)`` on every token (float32).

    Reference: on-policy distillation as a reverse-KL penalty (Agarwal et al. 2024, GKD;
    Miles ``--use-opd``).
    """
    return [
        (a.float() - coef * (s.to(a.device).float() - t.to(a.device).float()))
        for a, s, t in zip(advantages, log_probs, teacher_log_probs)
    ]


def whiten(advantages: list, loss_masks: list) -> list:
    """Whiten advantages with the statistics of the trained tokens of the whole batch.

    ``mu = sum(A*m)/N``, ``var = (sum(A**2*m)/N - mu**2) * N/(N-1)`` (the Bessel factor only
    when ``N >= 2``), ``A <- (A - mu) / sqrt(var + 1e-8)`` at every position (masked ones
    included); statistics in float64, values on masked tokens never enter them.

    :param advantages: N tensors [T_i]; :param loss_masks: N tensors [T_i].
    :returns: N float32 tensors [T_i].
    :raises PluginError: no token has ``m = 1``.

    Reference: Miles ``distributed_masked_whiten``.
    """
    import torch

    if not advantages:
        raise PluginError("--normalize-advantages: the rollout batch is empty; there is nothing to whiten.")
    device = advantages[0].device
    flat = torch.cat([a.reshape(-1).to(device=device, dtype=torch.float64) for a in advantages])
    active = torch.cat([m.reshape(-1).to(device) for m in loss_masks]) > 0
    count = int(active.sum())
    if count == 0:
        raise PluginError(
            "--normalize-advantages: no token of the rollout batch is trained (every loss mask is 0), so there are "
            "no statistics to whiten with; check the loss masks, or drop --normalize-advantages."
        )
    kept = torch.where(active, flat, 0.0)
    mean = kept.sum() / count
    var = ((kept * kept).sum() / count - mean * mean).clamp_min(0.0)
    if count >= 2:
        var = var * count / (count - 1)
    out = ((flat - mean) / torch.sqrt(var + WHITEN_EPS)).to(torch.float32)
    return list(torch.split(out, [int(a.numel()) for a in advantages]))


def _checked_output(out: Any, batch: AdvantageInput, name: str, flag: str) -> tuple[list, list | None]:
    check_advantage_output(out, batch.loss_masks, f"{flag} '{name}'")
    advantages = [a.reshape(-1).float() for a in out.advantages]
    returns = [r.reshape(-1).float() for r in out.returns] if out.returns is not None else None
    return advantages, returns
