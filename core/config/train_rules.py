"""Facts of the train step that follow from the flags alone, read by the flag rules, the loop and the train group:
optimizer steps per rollout, whether pi_old needs a forward pass of its own, and whether zero-advantage samples
may be skipped."""

from __future__ import annotations

from typing import Any

from .flag_access import flag_value

__all__ = ["pi_old_needs_own_pass", "steps_per_rollout", "zero_advantage_skip_blocked"]


def steps_per_rollout(flags: Any) -> int:
    """Optimizer steps per rollout: 1 under ``--use-dynamic-global-batch-size``, else ``--num-steps-per-rollout``.

    ``flags``: the launch flags, parsed (the set-up Namespace) or frozen (the RunConfig).
    """
    return 1 if flags.use_dynamic_global_batch_size else int(flags.num_steps_per_rollout)


def pi_old_needs_own_pass(flags: Any) -> str | None:
    """Why the flags alone need pi_old from a forward-only pass of its own, or None.

    pi_old may come from the training forward (``--reuse-train-log-probs``) only when the
    rollout trains in one optimizer step and nothing reads pi_old before training; a
    backend can still refuse at start (``train_forward_gives_old_log_probs``).
    """
    if flags.use_rollout_logprobs:
        return "--use-rollout-logprobs (pi_old is the engine's log-probs)"
    # num_steps_per_rollout None: the batch knobs did not resolve (reported elsewhere)
    if flags.num_steps_per_rollout is not None and steps_per_rollout(flags) != 1:
        return f"--num-steps-per-rollout {flags.num_steps_per_rollout} (pi_old must stay fixed over the steps)"
    if flags.use_kl_loss or flags.kl_coef:
        return "a reference model is loaded (--use-kl-loss or --kl-coef)"
    if flags.use_opd:
        return "--use-opd reads pi_old before training"
    if flags.custom_advantage_function_path:
        return "--custom-advantage-function-path may read pi_old before training"
    if flags.keep_old_actor:
        return "--keep-old-actor (pi_old comes from the weights the engines generated with)"
    if flags.rollout_data_postprocess_path:
        return "--rollout-data-postprocess-path may read pi_old before training"
    return None


def zero_advantage_skip_blocked(flags: Any) -> str | None:
    """Why the flags alone make skipping zero-advantage samples inexact, or None.

    ``--skip-zero-advantage-samples`` leaves out of the forward and backward passes the
    samples whose advantage is 0 on every trained token. That is exact only when such a
    sample's loss is identically 0, so that its gradient is 0: the ``policy_loss`` plugin,
    not replaced by ``--custom-loss-function-path`` (every term of its policy-gradient loss is a multiple of the advantage) without an
    entropy or KL term, reduced by the core (a ``loss_reducer`` plugin sees the samples of
    each micro-batch, which the skip changes). The advantages are tested after every
    advantage stage (estimator, OPD, whitening), so any estimator qualifies.
    """
    if flags.custom_loss_function_path:
        return (f"--custom-loss-function-path {flags.custom_loss_function_path}: only policy_loss is known to vanish "
                "at zero advantage")
    if flags.loss_type != "policy_loss":
        return f"--loss-type {flags.loss_type}: only policy_loss is known to vanish at zero advantage"
    if flags.entropy_coef:
        return f"--entropy-coef {flags.entropy_coef}: the entropy bonus does not vanish at zero advantage"
    if flags.use_kl_loss:
        return ("--use-kl-loss: the KL term does not vanish at zero advantage" if flags.kl_loss_coef else
                "--use-kl-loss with --kl-loss-coef 0: the KL it logs is over every sample")
    for flag in ("loss_reducer", "custom_pg_loss_reducer_function_path"):
        if flag_value(flags, flag):
            return f"--{flag.replace('_', '-')}: a loss reducer sees each micro-batch's samples"
    return None
