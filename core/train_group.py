"""The local executor's train group: one in-process train backend behind the async group API.

``await group.train(rollout_id, groups)``: old/reference log-probs once per rollout, the
advantage stages, then ``--num-steps-per-rollout`` optimizer steps through the backend
with the core's objective. ``await group.update_weights(...)`` pushes the new weights to the
rollout engine. Every method returns the list of per-rank results (one rank here).
"""

from __future__ import annotations

import logging
import time
from argparse import Namespace

import torch

from furlong.hooks import RolloutEngine, Sample, TrainBackend

from .advantage_stages import compute_advantages
from .batching import plan_steps
from .objective import StepObjective
from .plugins import FurlongPluginManager
from .selection import Selection
from .train_data import (advantage_input, flatten, post_process_rewards, to_train_batch, trajectory_ids,
                         truncated_flags)

__all__ = ["LocalTrainGroup"]

log = logging.getLogger("furlong.train")


class LocalTrainGroup:
    """One train backend in this process (``--executor local``)."""

    def __init__(self, args: Namespace, pm: FurlongPluginManager, selection: Selection, backend: TrainBackend):
        self.args = args
        self.pm = pm
        self.selection = selection
        self.backend = backend
        self.weight_version = 0

    async def init(self) -> list[int]:
        return [await self.backend.init(self.args)]

    def needs_ref(self) -> bool:
        return bool(self.args.use_kl_loss or self.args.kl_coef)

    async def train(self, rollout_id: int, groups: list[list[Sample]]) -> list[dict]:
        """Train on one rollout; returns ``[metrics]`` with ``rollout/*``, ``perf/*`` and per-step ``train/*``."""
        args = self.args
        samples = flatten(groups)
        raw, rewards = post_process_rewards(args, samples)
        batch = to_train_batch(args, samples)
        batch.rewards = rewards
        batch.steps = plan_steps(
            lengths=[len(t) for t in batch.tokens], global_batch_size=args.global_batch_size,
            num_steps=args.num_steps_per_rollout, dp_size=1, rank=0, micro_batch_size=args.micro_batch_size,
            max_tokens_per_gpu=args.max_tokens_per_gpu, dynamic=args.use_dynamic_batch_size,
            balance=args.balance_data,
        )
        metrics: dict = {}
        start = time.perf_counter()
        if self.needs_ref():
            batch.ref_log_probs = (await self.backend.log_probs(batch, model="ref"))["log_probs"]
        metrics["perf/ref_log_probs_time"] = time.perf_counter() - start
        start = time.perf_counter()
        if args.use_rollout_logprobs and batch.rollout_log_probs is not None:
            batch.old_log_probs = batch.rollout_log_probs
            entropy = None
        else:
            out = await self.backend.log_probs(batch, model="actor")
            batch.old_log_probs, entropy = out["log_probs"], out.get("entropy")
        metrics["perf/log_probs_time"] = time.perf_counter() - start
        name, flag = self.selection.chosen["advantage"]
        adv = await compute_advantages(args, self.pm, advantage_input(samples, rewards, batch), name, flag)
        batch.advantages, batch.returns = adv.advantages, adv.returns
        batch.truncated = truncated_flags(samples)
        loss_name, loss_flag = self.selection.chosen["loss"]
        batch.objective = StepObjective(args, self.pm, batch, loss_name, loss_flag,
                                        trajectory_ids=trajectory_ids(samples))
        start = time.perf_counter()
        step_metrics = await self.backend.train(rollout_id, batch)
        metrics["perf/actor_train_time"] = time.perf_counter() - start
        metrics.update(_token_means(batch, entropy))
        metrics["rollout/rewards"] = float(torch.tensor(rewards).mean()) if rewards else 0.0
        metrics["rollout/raw_reward"] = float(torch.tensor(raw).mean()) if raw else 0.0
        metrics["train/steps"] = step_metrics
        return [metrics]

    async def update_weights(self, engine: RolloutEngine) -> int:
        """Push the trainer's weights to ``engine`` with the next weight version; return it."""
        self.weight_version += 1
        named = await self.backend.named_weights()
        await engine.update_weights(named, self.weight_version)
        return self.weight_version

    async def save_model(self, path: str) -> None:
        await self.backend.save(path)

    async def load_model(self, path: str) -> None:
        await self.backend.load(path)


def _token_means(batch, entropy) -> dict:
    """Sample-mean over loss masks of the per-token rollout tensors (SPEC.md 10)."""
    fields = {"rollout/log_probs": batch.old_log_probs, "rollout/ref_log_probs": batch.ref_log_probs,
              "rollout/rollout_log_probs": batch.rollout_log_probs, "rollout/advantages": batch.advantages,
              "rollout/returns": batch.returns, "rollout/entropy": entropy}
    out = {}
    for name, values in fields.items():
        if values is None:
            continue
        means = [float((v * m).sum() / m.sum()) for v, m in zip(values, batch.loss_masks) if m.sum() > 0]
        if means:
            out[name] = sum(means) / len(means)
    return out
