"""User functions a Miles launch script names by dotted path, for tests/test_miles_training_flags.py.

The tests put this folder on ``sys.path`` and name them ``miles_user_functions.NAME``.
"""

import torch

CALLS: list = []


def vanilla_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
                **kwargs):
    """Truncated importance sampling written as a Miles user would: the built-in --use-tis, by hand."""
    CALLS.append(("vanilla_tis", [len(t) for t in train_log_probs], list(total_lengths), list(response_lengths),
                  sorted(kwargs)))
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weights = ratio.clamp(args.tis_clip_low, args.tis_clip)
    metrics = {"tis": ratio, "tis_clipfrac": (weights != ratio).float(), "tis_abs": (ratio - 1).abs()}
    return pg_loss * weights, loss_masks, metrics


def reject_first_token(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """Unit weights; every sample's first response token rejected (its mask 0)."""
    masks = [m.clone() for m in loss_masks]
    for m in masks:
        m[:1] = 0
    return pg_loss, masks, {"seen_ratio": torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))}
