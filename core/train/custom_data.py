"""Miles' dotted-path functions on the rollout's train data: its conversion from samples
(``--custom-convert-samples-to-train-data-path``) and a look at it once log-probs and advantages are
known (``--rollout-data-postprocess-path``). Both run in the driver through their adapters
(:mod:`furlong.core.plugins.path_specs`)."""

from __future__ import annotations

import torch

from furlong.hooks import PluginError, RunConfig, Sample, TrainBatch

from ..plugins.manager import FurlongPluginManager
from .data import routed_experts

__all__ = ["CONVERT_FLAG", "POSTPROCESS_FLAG", "converted_batch", "postprocess_rollout_data"]

CONVERT_FLAG = "--custom-convert-samples-to-train-data-path"
POSTPROCESS_FLAG = "--rollout-data-postprocess-path"
_PER_SAMPLE = ("tokens", "response_lengths", "rewards", "loss_masks")


async def converted_batch(config: RunConfig, pm: FurlongPluginManager, chosen: tuple[str, str],
                          samples: list[Sample]) -> tuple[TrainBatch, list[float], list[float]]:
    """``(batch, raw rewards, rewards)`` from the user's ``fn(args, samples) -> dict`` (Miles' form).

    Keys read, one entry per sample in ``samples``' order: ``tokens`` (ids), ``response_lengths``,
    ``rewards`` (what the advantage estimator gets), ``loss_masks`` (``response_length`` 0/1 values);
    optional ``raw_reward`` (default: ``rewards``), ``truncated`` (default: the samples' status),
    ``sample_indices`` (default: the samples'), ``rollout_log_probs`` (``response_length`` floats each).

    :raises PluginError: a key is missing, a list has another length than ``samples``, or a mask or
        log-prob row another length than its response (the message names the flag, key and sample).
    """
    data = await pm.call_chosen("convert_samples_to_train_data", *chosen, config=config, samples=samples)
    n = len(samples)
    where = f"{CONVERT_FLAG} '{chosen[0]}'"
    missing = [key for key in _PER_SAMPLE if key not in data]
    if missing:
        raise PluginError(f"{where} returned no {', '.join(missing)}; the dict needs {', '.join(_PER_SAMPLE)}.")
    for key in (*_PER_SAMPLE, "raw_reward", "truncated", "sample_indices", "rollout_log_probs"):
        if data.get(key) is not None and len(data[key]) != n:
            raise PluginError(f"{where}: '{key}' has {len(data[key])} entries for {n} samples.")
    lengths = [int(t) for t in data["response_lengths"]]
    masks = [_row(data["loss_masks"][i], lengths[i], where, "loss_masks", i) for i in range(n)]
    rollout = data.get("rollout_log_probs")
    batch = TrainBatch(
        tokens=[[int(t) for t in tokens] for tokens in data["tokens"]],
        response_lengths=lengths,
        loss_masks=masks,
        rollout_log_probs=None if rollout is None else [_row(rollout[i], lengths[i], where, "rollout_log_probs", i)
                                                          for i in range(n)],
        sample_indices=[int(i) for i in data.get("sample_indices") or [s.index for s in samples]],
        routed_experts=routed_experts(samples) if config.use_rollout_routing_replay else None,
        temperature=float(config.rollout_temperature),
    )
    if data.get("truncated") is not None:
        batch.truncated = [bool(t) for t in data["truncated"]]
    rewards = [float(r) for r in data["rewards"]]
    raw = [float(r) for r in data.get("raw_reward") or rewards]
    return batch, raw, rewards


def _row(values, length: int, where: str, key: str, i: int) -> torch.Tensor:
    row = torch.as_tensor(values, dtype=torch.float32).reshape(-1)
    if row.numel() != length:
        raise PluginError(f"{where}: '{key}' of sample {i} has {row.numel()} values for a response of {length} tokens.")
    return row


async def postprocess_rollout_data(config: RunConfig, pm: FurlongPluginManager, chosen: tuple[str, str],
                                   batch: TrainBatch) -> None:
    """Call the user's function on the rollout's train data; a changed ``loss_masks`` entry goes into ``batch``.

    :raises PluginError: the function failed, or left a mask of another length than its response.
    """
    data = {"tokens": batch.tokens, "response_lengths": batch.response_lengths, "loss_masks": batch.loss_masks,
            "log_probs": batch.old_log_probs, "ref_log_probs": batch.ref_log_probs,
            "rollout_log_probs": batch.rollout_log_probs, "advantages": batch.advantages, "returns": batch.returns,
            "rewards": batch.rewards}
    await pm.call_chosen("rollout_data_postprocess", *chosen, config=config, rollout_data=data)
    where = f"{POSTPROCESS_FLAG} '{chosen[0]}'"
    masks = data["loss_masks"]
    if len(masks) != len(batch.tokens):
        raise PluginError(f"{where} left {len(masks)} loss masks for {len(batch.tokens)} samples.")
    batch.loss_masks = [_row(m, batch.response_lengths[i], where, "loss_masks", i) for i, m in enumerate(masks)]
