"""PPO clipped policy loss (Schulman et al. 2017) with DAPO clip-higher, dual clip, GSPO ratio, KL, TIS and OPSM."""

from __future__ import annotations

from furlong.hooks import LossOutput, PluginError, hookimpl

from furlong.kit.kl import KL_TYPES, kl_estimate, rollout_mismatch
from furlong.hooks.rows import SplitRows, concat_rows, row_lengths
from furlong.kit.trainer import to_device

_LOG_RATIO_LIMIT = 20.0
_RATIO_LEVELS = ("token", "sequence")


@hookimpl
def configure(args, report):
    """The policy gradient needs advantages: ``--disable-compute-advantages-and-returns`` leaves none."""
    if args.disable_compute_advantages_and_returns:
        report.error("--disable-compute-advantages-and-returns leaves no advantages, which --loss-type policy_loss "
                     "needs; use it with --loss-type sft_loss (supervised fine-tuning) or drop it.")


@hookimpl
def loss(config, batch):
    """Per-token clipped surrogate plus the entropy bonus and the KL penalty.

    Shapes: ``N`` samples, ``T_i`` response tokens of sample ``i``; every input and output
    is a list of ``N`` tensors [T_i]; outputs are float32.

    With ``m`` the loss mask and ``delta = logp_old - logp`` (per token, or with
    ``--policy-ratio-level sequence`` the masked mean of sample ``i`` broadcast to its
    tokens), masked positions getting ``delta = A = 0``:
    ``rho = exp(clamp(-delta, -20, 20))``; ``l1 = -rho*A``;
    ``l2 = -clip(rho, 1 - eps_clip, 1 + eps_clip_high)*A``; ``l = max(l1, l2)``; for
    ``A < 0`` with ``--eps-clip-c c``: ``l = min(l, -c*A)``. OPSM zeroes ``l`` on tokens with
    ``A < 0`` of samples whose masked mean of ``logp_old - logp`` exceeds ``--opsm-delta``.
    TIS multiplies ``l`` by ``w = clamp(exp(logp_old - logp_rollout), tis_clip_low,
    tis_clip)`` (no gradient); with ``--custom-tis-function-path`` the core applies that function
    to ``pg_loss`` instead. The returned ``token_loss`` is the combined objective
    ``l - entropy_coef*H + kl_loss_coef*kl`` (each term only when its coefficient is non-zero
    and, for kl, ``--use-kl-loss`` is on), where ``kl = KL_est(logp, logp_ref)`` with
    ``--kl-loss-type``, times ``exp(logp - logp_old)`` under ``--use-unbiased-kl``.

    Flags read: ``eps_clip``, ``eps_clip_high``, ``eps_clip_c``, ``policy_ratio_level``,
    ``use_opsm``, ``opsm_delta``, ``use_tis``, ``tis_clip``, ``tis_clip_low``,
    ``entropy_coef``, ``use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type``,
    ``use_unbiased_kl``.

    :param batch: ``LossInput``: ``log_probs`` (grad), ``old_log_probs``, ``advantages``,
        ``loss_masks``; ``ref_log_probs`` with ``--use-kl-loss``; ``rollout_log_probs``
        with ``--use-tis`` (and for the train/rollout mismatch metrics when present);
        ``entropy`` with ``--entropy-coef`` != 0 (``entropy_loss`` is reported whenever it
        is given, detached when the coefficient is 0).
    :returns: ``LossOutput(token_loss, token_metrics)``. Metrics (per token, the core
        reduces them): ``pg_loss`` (``l`` after OPSM and TIS; carries grad, which a custom
        pg reducer needs), ``pg_clipfrac``, ``ppo_kl`` (``delta``); ``entropy_loss``;
        ``kl_loss`` (with ``--use-kl-loss``, also at coefficient 0); ``tis``,
        ``tis_clipfrac``, ``tis_abs``, ``ois``, ``ess_ratio`` (with ``--use-tis``);
        ``opsm_clipfrac`` (with ``--use-opsm``); ``train_rollout_logprob_abs_diff`` and
        ``train_rollout_kl`` (low_var_kl of rollout vs old, when rollout log-probs exist).
    :raises PluginError: a flag value out of range, or a field a flag needs is missing.

    Reference: Schulman et al. 2017, PPO, eq. 7; Yu et al. 2025, DAPO (clip-higher);
    Ye et al. 2020, "Mastering complex control in MOBA games with deep RL" (dual clip);
    Zheng et al. 2025, GSPO (sequence ratio); Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training" (TIS); Schulman 2020 (KL estimators).
    """
    import torch

    _check_args(config, batch)
    n = len(batch.log_probs)
    if n == 0:
        return LossOutput(token_loss=[], token_metrics={})
    lengths = row_lengths(batch.log_probs)
    logp = concat_rows(batch.log_probs).float()
    device = logp.device
    # the segment ids are built on the host and copied without blocking (on a GPU, repeat_interleave waits for it)
    seg = to_device(torch.repeat_interleave(torch.arange(n), torch.tensor(lengths)), device)
    active = concat_rows(batch.loss_masks).to(device) > 0
    counts = _segment_sum(active.float(), seg, n).clamp_min(1.0)
    old = _cat(batch.old_log_probs, device)
    adv = torch.where(active, torch.nan_to_num(_cat(batch.advantages, device), nan=0.0, posinf=0.0, neginf=0.0), 0.0)

    token_delta = torch.where(active, torch.nan_to_num(old - logp, nan=0.0, posinf=0.0, neginf=0.0), 0.0)
    if config.policy_ratio_level == "sequence":
        seq_delta = _segment_sum(token_delta, seg, n) / counts
        delta = torch.where(active, seq_delta[seg], 0.0)
    else:
        delta = token_delta
    ratio = torch.exp(torch.nan_to_num(-delta, nan=0.0).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
    pg, clipped = clipped_surrogate(ratio, adv, config.eps_clip, config.eps_clip_high, config.eps_clip_c)
    metrics = {"pg_clipfrac": clipped.float(), "ppo_kl": delta.detach()}

    if config.use_opsm:
        seq_kl = _segment_sum(token_delta.detach(), seg, n) / counts
        dropped = active & (adv < 0) & (seq_kl[seg] > config.opsm_delta)
        pg = torch.where(dropped, 0.0, pg)
        metrics["opsm_clipfrac"] = dropped.float()
    if config.use_tis and not config.custom_tis_function_path:  # a custom function: the core applies it
        pg = pg * _tis_terms(config, old, _cat(batch.rollout_log_probs, device), active, seg, n, counts, ratio, metrics)
    if batch.rollout_log_probs is not None:
        metrics.update(rollout_mismatch(old, _cat(batch.rollout_log_probs, device), active))
    metrics["pg_loss"] = pg
    total = pg

    if batch.entropy is not None:
        entropy = _cat(batch.entropy, device)
        if config.entropy_coef != 0:
            total = total - config.entropy_coef * entropy
        else:
            entropy = entropy.detach()
        metrics["entropy_loss"] = entropy
    if config.use_kl_loss:
        ref_safe = torch.where(active, _cat(batch.ref_log_probs, device), logp.detach())
        kl = kl_estimate(logp, ref_safe, config.kl_loss_type)
        if config.use_unbiased_kl:
            old_safe = torch.where(active, old, logp.detach())
            kl = kl * torch.exp(logp - old_safe)
        kl = _masked_finite(kl, active)
        metrics["kl_loss"] = kl
        if config.kl_loss_coef != 0:
            total = total + config.kl_loss_coef * kl

    return LossOutput(
        token_loss=SplitRows.of(total, lengths),
        token_metrics={name: SplitRows.of(value, lengths) for name, value in metrics.items()},
    )


def clipped_surrogate(ratio, advantages, eps_low: float, eps_high: float, eps_c: float | None):
    """PPO clipped surrogate per token, with asymmetric clip and the optional dual clip.

    ``l1 = -ratio*A``, ``l2 = -clip(ratio, 1 - eps_low, 1 + eps_high)*A``,
    ``l = max(l1, l2)``; when ``eps_c`` is given, ``l = min(l, -eps_c*A)`` where ``A < 0``.

    :param ratio: float32 ``pi_theta / pi_old`` per token (any shape).
    :param advantages: float32, same shape.
    :returns: ``(l, clipped)``: the per-token loss and the bool indicator ``l2 > l1``.

    Reference: Schulman et al. 2017 (PPO, eq. 7); Yu et al. 2025 (DAPO clip-higher);
    Ye et al. 2020 (dual clip, for negative advantages only).
    """
    import torch

    loss1 = -ratio * advantages
    loss2 = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    out = torch.maximum(loss1, loss2)
    if eps_c is not None:
        out = torch.where(advantages < 0, torch.minimum(out, -eps_c * advantages), out)
    return out, loss2 > loss1


def _tis_terms(config, old, rollout, active, seg, n, counts, ratio, metrics):
    """TIS weights ``clamp(exp(logp_old - logp_rollout), low, high)`` (detached); fills the TIS metrics."""
    import torch

    log_w = torch.where(active, torch.nan_to_num(old - rollout, nan=0.0), 0.0).detach()
    raw = torch.exp(log_w)
    weights = raw.clamp(config.tis_clip_low, config.tis_clip)
    masked_w = torch.where(active, weights, 0.0)
    sum_w = _segment_sum(masked_w, seg, n)
    sum_w2 = _segment_sum(masked_w * masked_w, seg, n)
    ess = sum_w * sum_w / (counts * sum_w2.clamp_min(1e-8))
    metrics.update(
        tis=raw, tis_clipfrac=(weights != raw).float(), tis_abs=(raw - 1.0).abs(),
        ois=ratio.detach(), ess_ratio=ess[seg],
    )
    return weights


def _check_args(config, batch) -> None:
    if config.eps_clip_c is not None and config.eps_clip_c <= 1.0:
        raise PluginError(
            f"--eps-clip-c {config.eps_clip_c}: the dual-clip bound must be > 1; raise it or leave it unset."
        )
    if config.policy_ratio_level not in _RATIO_LEVELS:
        raise PluginError(
            f"--policy-ratio-level {config.policy_ratio_level!r}: unknown ratio level; choose token or sequence."
        )
    if config.use_kl_loss and config.kl_loss_type not in KL_TYPES:
        raise PluginError(
            f"--kl-loss-type {config.kl_loss_type!r}: unknown KL estimator; choose one of {', '.join(KL_TYPES)}."
        )
    if batch.old_log_probs is None:
        raise PluginError("the policy loss needs old log-probs (pi_old) but the batch has none; it cannot run "
                          "with --disable-compute-advantages-and-returns.")
    if batch.advantages is None:
        raise PluginError("the policy loss needs advantages but the batch has none; it cannot run "
                          "with --disable-compute-advantages-and-returns.")
    if config.use_kl_loss and batch.ref_log_probs is None:
        raise PluginError(
            "--use-kl-loss: the batch has no reference log-probs; set --ref-load so the reference is loaded."
        )
    if config.use_tis and batch.rollout_log_probs is None:
        raise PluginError("--use-tis: the batch has no rollout log-probs; the rollout engine must return per-token "
                          "log-probs (Sample.rollout_log_probs) for truncated importance sampling.")
    if config.entropy_coef != 0 and batch.entropy is None:
        raise PluginError(f"--entropy-coef {config.entropy_coef}: the train backend passed no entropy to the loss.")


def _cat(tensors, device):
    import torch

    return concat_rows(tensors).to(device=device, dtype=torch.float32)


def _segment_sum(values, seg, n: int):
    import torch

    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, seg, values)


def _masked_finite(values, active):
    import torch

    return torch.where(active, torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0), 0.0)
