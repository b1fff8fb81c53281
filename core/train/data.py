"""Turning a rollout's groups into the trainer's batch."""

from __future__ import annotations

import logging

import torch

from furlong.hooks import AdvantageInput, PluginError, RunConfig, Sample, Status, TrainBatch
from furlong.kit.rewards import reward_scalar

from ..plugins.manager import FurlongPluginManager
from ..plugins.selection import Selection

log = logging.getLogger("furlong.train")

__all__ = ["advantage_input", "flatten", "post_process_rewards", "routed_experts", "to_train_batch",
           "zero_advantage"]


def flatten(groups: list[list[Sample]]) -> list[Sample]:
    """Samples of every group, sorted by sample index (the rollout order)."""
    return sorted((s for g in groups for s in g), key=lambda s: s.index)


async def post_process_rewards(config: RunConfig, samples: list[Sample], pm: FurlongPluginManager,
                               selection: Selection) -> tuple[list[float], list[float]]:
    """``(raw, rewards)``: scalar rewards, through ``--custom-reward-post-process-path`` when given
    (its adapter, called by the plugin manager).

    :raises PluginError: the custom function failed or returned lists of the wrong length.
    """
    if "reward_post_process" in selection.paths:
        return await pm.call_chosen("reward_post_process", *selection.paths["reward_post_process"], config=config,
                                    samples=samples)
    raw = [reward_scalar(s.reward, config.reward_key, f"sample {s.index}") or 0.0 for s in samples]
    return raw, list(raw)


def loss_masks(samples: list[Sample]) -> list[torch.Tensor]:
    """Float32 [T_i] masks: the sample's mask (None = all ones), zeros for ``remove_sample``."""
    masks = []
    for s in samples:
        mask = torch.ones(s.response_length) if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        masks.append(torch.zeros_like(mask) if s.remove_sample else mask)
    return masks


def to_train_batch(config: RunConfig, samples: list[Sample]) -> TrainBatch:
    """The trainer's view of the samples: tokens, response lengths, masks, rollout log-probs and, under
    ``--use-rollout-routing-replay``, the engine's routing (:func:`routed_experts`)."""
    rollout_lp = None
    if all(s.rollout_log_probs is not None and len(s.rollout_log_probs) == s.response_length for s in samples):
        rollout_lp = [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]
    return TrainBatch(
        tokens=[list(s.tokens) for s in samples],
        response_lengths=[s.response_length for s in samples],
        loss_masks=loss_masks(samples),
        rollout_log_probs=rollout_lp,
        sample_indices=[s.index for s in samples],
        routed_experts=routed_experts(samples) if config.use_rollout_routing_replay else None,
        temperature=float(config.rollout_temperature),
    )


def routed_experts(samples: list[Sample]) -> list[torch.Tensor | None]:
    """Each sample's ``rollout_routed_experts`` as int64 ``[len(tokens) - 1, num_moe_layers, topk]``, or None for
    a sample without one (tokens the engine did not route, such as those inserted between turns: the train
    backend routes the micro-batches holding such a sample by its own routers; logged once per rollout).

    :raises PluginError: a record of another shape (the message names the sample and the flag).
    """
    out: list[torch.Tensor | None] = []
    for s in samples:
        if s.rollout_routed_experts is None:
            out.append(None)
            continue
        routed = torch.as_tensor(s.rollout_routed_experts, dtype=torch.int64)
        if routed.dim() != 3 or routed.shape[0] != len(s.tokens) - 1:
            raise PluginError(f"--use-rollout-routing-replay: sample {s.index}'s rollout_routed_experts has shape "
                              f"{tuple(routed.shape)}; it must be [len(tokens) - 1 = {len(s.tokens) - 1}, "
                              "num_moe_layers, topk].")
        out.append(routed)
    missing = sum(r is None for r in out)
    if missing:
        log.warning("--use-rollout-routing-replay: %d of %d samples have no rollout_routed_experts (the engine did "
                    "not route all their tokens, or cannot record routing); micro-batches holding them are routed by "
                    "the trainer's own routers.", missing, len(out))
    return out


def trajectory_ids(samples: list[Sample]) -> list[int]:
    """Each sample's trajectory id: ``trajectory_id``, else its ``index``, else its position."""
    return [s.trajectory_id if s.trajectory_id is not None else (s.index if s.index is not None else -1 - i)
            for i, s in enumerate(samples)]


def truncated_flags(samples: list[Sample]) -> list[bool]:
    return [s.status == Status.TRUNCATED for s in samples]


def advantage_input(samples: list[Sample], rewards: list[float], batch: TrainBatch) -> AdvantageInput:
    """The ``advantage`` hook's input; trajectory siblings must share one reward."""
    trajectory = trajectory_ids(samples)
    seen: dict[int, float] = {}
    for tid, reward, s in zip(trajectory, rewards, samples):
        if tid in seen and seen[tid] != reward:
            raise PluginError(f"samples of trajectory {tid} have different rewards ({seen[tid]} and {reward}, "
                              f"sample {s.index}); samples of one trajectory must share one reward.")
        seen[tid] = reward
    teacher = None
    if all(s.teacher_log_probs is not None for s in samples):
        teacher = [torch.tensor(s.teacher_log_probs, dtype=torch.float32) for s in samples]
    return AdvantageInput(
        teacher_log_probs=teacher,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_ids=torch.tensor([s.group_index for s in samples], dtype=torch.long),
        trajectory_ids=torch.tensor(trajectory, dtype=torch.long),
        loss_masks=batch.loss_masks,
        log_probs=batch.old_log_probs,
        ref_log_probs=batch.ref_log_probs,
        values=batch.values,
    )


def zero_advantage(advantages: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> list[bool]:
    """Per sample, True when its advantage is exactly 0 on every trained token (mask > 0).

    A sample with no trained token counts as zero. NaN or inf is not zero.

    :param advantages: N float tensors [T_i]; :param loss_masks: N tensors [T_i].
    """
    if not advantages:
        return []
    lengths = [int(m.numel()) for m in loss_masks]
    adv = torch.cat([a.reshape(-1).float() for a in advantages])
    live = torch.cat([m.reshape(-1) for m in loss_masks]) > 0
    nonzero = (live & (adv != 0)).float()
    per_sample = torch.zeros(len(lengths)).index_add_(
        0, torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)), nonzero)
    return (per_sample == 0).tolist()
