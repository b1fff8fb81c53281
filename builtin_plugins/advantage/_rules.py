"""Flag rules shared by the built-in advantage estimators' ``configure`` hooks."""

from __future__ import annotations

__all__ = ["check_group_size", "require_whitening"]


def check_group_size(args, report) -> None:
    """Group-relative estimators (grpo, gspo) learn nothing from groups of one sample.

    With ``--n-samples-per-prompt 1`` given: a warning (``r - mean(r) = 0``). With one
    sample per prompt, given or not, group std normalization is turned off unless
    ``--disable-grpo-std-normalization`` was given (a one-sample group has no std).
    """
    if args.n_samples_per_prompt != 1:
        return
    if report.given(args, "n_samples_per_prompt"):
        report.warn(f"--advantage-estimator {report.plugin} with --n-samples-per-prompt 1: a group of one sample has "
                    "advantage r - mean(r) = 0, so nothing is learned; sample several responses per prompt.")
    if not args.disable_grpo_std_normalization and not report.given(args, "disable_grpo_std_normalization"):
        report.default(args, "disable_grpo_std_normalization", True)
        report.info("--n-samples-per-prompt 1: group std normalization is off (a one-sample group has no std).")


def require_whitening(args, report) -> None:
    """REINFORCE++ estimators leave the scaling to ``--normalize-advantages``: require it."""
    if not args.normalize_advantages:
        report.error(f"--advantage-estimator {report.plugin} requires --normalize-advantages (its advantages are "
                     "whitened over the rollout).")
