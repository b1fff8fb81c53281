"""Per-token KL estimators k1, k2, k3 and low_var_kl (Schulman 2020, "Approximating KL divergence").

Part of the contract because two sides share them: the core's reward-shaping KL
(``--kl-coef``) and loss plugins' KL term (``--use-kl-loss``), both chosen by
``--kl-loss-type``. Third-party loss plugins use the same estimators from here.
"""

from __future__ import annotations

__all__ = ["KL_TYPES", "kl_estimate", "rollout_mismatch"]

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")

_LOG_RATIO_LIMIT = 20.0
_LOW_VAR_KL_LIMIT = 10.0


def kl_estimate(log_probs, base_log_probs, kl_type: str):
    """Per-token estimate of ``KL(p || base)`` from the log-probs of the sampled tokens.

    With ``x = log_probs - base_log_probs`` computed in float32:
    ``k1 = x``; ``k2 = x**2 / 2``; ``k3 = exp(-x) - 1 + x``; ``low_var_kl`` is k3 with
    ``-x`` first sanitized (NaN -> 0, +-inf -> +-20) and clamped to [-20, 20], and the
    result clamped to [-10, 10]. k3 has no clamp. Gradients flow through both inputs.

    Shapes: any shape; both inputs broadcast together.

    :param log_probs: log-probs under ``p`` (e.g. the current policy), natural log.
    :param base_log_probs: log-probs under the base distribution (e.g. the reference).
    :param kl_type: one of ``k1``, ``k2``, ``k3``, ``low_var_kl`` (``--kl-loss-type``).
    :returns: float32 tensor of per-token estimates, the shape of ``x``.
    :raises ValueError: unknown ``kl_type`` (the config rejects it before a run starts).

    Reference: J. Schulman, "Approximating KL divergence", 2020
    (http://joschu.net/blog/kl-approx.html); the clamps follow Miles' ``low_var_kl``.
    """
    import torch

    x = log_probs.float() - base_log_probs.float()
    if kl_type == "k1":
        return x
    if kl_type == "k2":
        return x * x / 2.0
    if kl_type == "k3":
        return torch.exp(-x) - 1.0 + x
    if kl_type == "low_var_kl":
        neg = torch.nan_to_num(-x, nan=0.0, posinf=_LOG_RATIO_LIMIT, neginf=-_LOG_RATIO_LIMIT)
        neg = neg.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        return (torch.exp(neg) - 1.0 - neg).clamp(-_LOW_VAR_KL_LIMIT, _LOW_VAR_KL_LIMIT)
    raise ValueError(f"--kl-loss-type {kl_type!r}: unknown KL estimator; choose one of {', '.join(KL_TYPES)}")


def rollout_mismatch(trainer_log_probs, rollout_log_probs, active) -> dict:
    """Per-token train/rollout mismatch metrics: how far the trainer's log-probs of the sampled tokens are
    from the rollout engine's.

    ``train_rollout_logprob_abs_diff = |lp_train - lp_rollout|`` and ``train_rollout_kl =
    low_var_kl(lp_rollout, lp_train)`` (k3 of ``KL(rollout || train)``, clamped as :func:`kl_estimate`),
    both 0 where ``active`` is False and where a value is not finite. Float32, detached inputs expected.

    Shapes: ``trainer_log_probs``, ``rollout_log_probs`` float ``[T]``; ``active`` bool ``[T]`` (the trained
    tokens); returns ``{name: float32 [T]}`` for the core to reduce like any loss metric.

    Reference: the metrics Miles logs as ``train_rollout_logprob_abs_diff`` and ``train_rollout_kl``
    (radixark/miles, ``miles/backends/training_utils/loss_hub/losses.py``).
    """
    import torch

    rollout = torch.where(active, rollout_log_probs.float(), trainer_log_probs.float())
    out = {"train_rollout_logprob_abs_diff": (trainer_log_probs.float() - rollout).abs(),
           "train_rollout_kl": kl_estimate(rollout, trainer_log_probs, "low_var_kl")}
    return {k: torch.where(active, torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0), 0.0) for k, v in out.items()}
