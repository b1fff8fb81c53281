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


def convert_by_hand(args, samples):
    """Miles' default conversion written by hand (rewards: the raw scalars, as furlong's estimator normalizes)."""
    CALLS.append(("convert_by_hand", [s.index for s in samples]))
    return {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [float(s.reward) for s in samples],
        "raw_reward": [float(s.reward) for s in samples],
        "truncated": [1 if s.status.value == "truncated" else 0 for s in samples],
        "sample_indices": [s.index for s in samples],
        "loss_masks": [s.loss_mask or [1] * s.response_length for s in samples],
    }


def convert_with_unit_rewards(args, samples):
    data = convert_by_hand(args, samples)
    data["rewards"] = [1.0] * len(samples)
    return data


def postprocess_miles_form(args):
    CALLS.append(("postprocess_miles_form", args.rollout_batch_size))


def mask_everything(args, rollout_data):
    """Sees the log-probs and advantages; turns every token's loss off."""
    CALLS.append(("mask_everything", len(rollout_data["log_probs"]), len(rollout_data["advantages"])))
    for mask in rollout_data["loss_masks"]:
        mask.zero_()
