"""On-policy distillation: the teacher's log-prob advantage over the student (Agarwal et al. 2024, GKD)."""

from __future__ import annotations

from furlong.hooks import AdvantageOutput, hookimpl

from ._group import check_batch, require


@hookimpl
def configure(args, report):
    """Reads pi_old before training: keeps the separate log-prob pass.

    Flags derived: ``reuse_train_log_probs`` = False. Errors: ``--reuse-train-log-probs`` given.
    """
    if report.default(args, "reuse_train_log_probs", False):
        report.error(f"--advantage-estimator {report.plugin} reads pi_old before training, so it cannot come from the "
                     "training forward; drop --reuse-train-log-probs.")


@hookimpl
def advantage(config, batch):
    """``A_t = R_t = logp_teacher_t - logp_old_t`` for every token (masked ones included).

    The per-token reverse-KL reward of on-policy distillation: minimizing the policy loss
    with this advantage lowers ``KL(pi_student || pi_teacher)`` on the student's samples.
    Reads no flag (``config`` is unused); rewards are ignored.

    :param batch: needs ``teacher_log_probs`` and ``log_probs`` (pi_old), N x [T_i].
    :returns: ``AdvantageOutput(advantages, returns)``: N float32 tensors [T_i] each.
    :raises PluginError: ``teacher_log_probs`` or ``log_probs`` is missing.

    Reference: Agarwal et al. 2024, "On-policy distillation of language models: learning
    from self-generated mistakes" (GKD); Thinking Machines Lab 2025, "On-policy distillation".
    """
    check_batch(batch)
    teacher = require(batch, "teacher_log_probs", "on-policy distillation")
    student = require(batch, "log_probs", "on-policy distillation")
    advantages = [(t.float() - s.float()) for t, s in zip(teacher, student)]
    return AdvantageOutput(advantages=advantages, returns=[a.clone() for a in advantages])
