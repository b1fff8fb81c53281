"""The local executor's train group: this process's train backend behind the async group API.

``await group.train(rollout_id, groups)``: old/reference log-probs once per rollout, the
advantage stages, then ``--num-steps-per-rollout`` optimizer steps through the backend
with the core's objective. ``await group.update_weights(...)`` pushes the new weights to the
rollout engine. Every method returns the list of this process's results (one rank).

Under ``torchrun`` (:mod:`furlong.core.ranks`) every trainer rank holds one group: rank 0
passes the rollout's groups and the others None; each rank plans its own micro-batches
of every step, computes log-probs of its samples (merged so every rank sees all), and
reduces its loss with denominators of the whole step over all ranks.
"""

from __future__ import annotations

import logging
import time
from argparse import Namespace

import torch

from furlong.hooks import RolloutEngine, Sample, TrainBackend

from .advantage_stages import compute_advantages
from .batching import plan_steps, split_steps
from .objective import StepObjective
from .plugins import FurlongPluginManager
from .ranks import Ranks
from .reduction import effective_loss_masks, excluded_samples, sample_denominators, step_denominators
from .selection import Selection
from .train_data import (advantage_input, flatten, post_process_rewards, to_train_batch, trajectory_ids,
                         truncated_flags)

__all__ = ["LocalTrainGroup"]

log = logging.getLogger("furlong.train")


class LocalTrainGroup:
    """One train backend in this process (``--executor local``)."""

    def __init__(self, args: Namespace, pm: FurlongPluginManager, selection: Selection, backend: TrainBackend,
                 ranks: Ranks | None = None):
        self.args = args
        self.pm = pm
        self.selection = selection
        self.backend = backend
        self.ranks = ranks or Ranks()
        self.weight_version = 0

    async def init(self) -> list[int]:
        return [await self.backend.init(self.args)]

    def needs_ref(self) -> bool:
        return bool(self.args.use_kl_loss or self.args.kl_coef)

    async def train(self, rollout_id: int, groups: list[list[Sample]] | None) -> list[dict]:
        """Train on one rollout; returns ``[metrics]`` with ``rollout/*``, ``perf/*`` and per-step ``train/*``.

        :param groups: the rollout's groups on rank 0; None on the other ranks, which
            receive rank 0's.
        """
        args, ranks = self.args, self.ranks
        groups = await ranks.broadcast(groups)
        samples = flatten(groups)
        raw, rewards = post_process_rewards(args, samples)
        batch = to_train_batch(args, samples)
        batch.rewards = rewards
        batch.truncated = truncated_flags(samples)
        tids = trajectory_ids(samples)
        batch.steps = plan_steps(
            lengths=[len(t) for t in batch.tokens], global_batch_size=args.global_batch_size,
            num_steps=args.num_steps_per_rollout, dp_size=ranks.world, rank=ranks.rank,
            micro_batch_size=args.micro_batch_size, max_tokens_per_gpu=args.max_tokens_per_gpu,
            dynamic=args.use_dynamic_batch_size, balance=args.balance_data, trajectory_ids=tids,
        )
        metrics: dict = {}
        start = time.perf_counter()
        if self.needs_ref():
            batch.ref_log_probs = await ranks.merge((await self.backend.log_probs(batch, model="ref"))["log_probs"])
        metrics["perf/ref_log_probs_time"] = time.perf_counter() - start
        start = time.perf_counter()
        if args.use_rollout_logprobs and batch.rollout_log_probs is not None:
            batch.old_log_probs = batch.rollout_log_probs
            entropy = None
        else:
            out = await self.backend.log_probs(batch, model="actor")
            batch.old_log_probs = await ranks.merge(out["log_probs"])
            entropy = await ranks.merge(out["entropy"]) if out.get("entropy") is not None else None
        metrics["perf/log_probs_time"] = time.perf_counter() - start
        name, flag = self.selection.chosen["advantage"]
        adv = await compute_advantages(args, self.pm, advantage_input(samples, rewards, batch), name, flag)
        batch.advantages, batch.returns = adv.advantages, adv.returns
        loss_name, loss_flag = self.selection.chosen["loss"]
        batch.objective = StepObjective(args, self.pm, batch, loss_name, loss_flag, ranks.world, trajectory_ids=tids,
                                        **_global_denominators(args, batch, tids))
        start = time.perf_counter()
        step_metrics = await self.backend.train(rollout_id, batch)
        metrics["perf/actor_train_time"] = time.perf_counter() - start
        metrics.update(_token_means(batch, entropy))
        metrics["rollout/rewards"] = float(torch.tensor(rewards).mean()) if rewards else 0.0
        metrics["rollout/raw_reward"] = float(torch.tensor(raw).mean()) if raw else 0.0
        metrics["train/steps"] = step_metrics
        return [metrics]

    async def update_weights(self, engine: RolloutEngine | None) -> int:
        """Push the trainer's weights to ``engine`` with the next weight version; return it.

        Every rank calls it (gathering full weights is a collective); ranks without an
        engine (None) only take part in the gather. The ranks meet first in the object
        group, whose time-out is long: in train-async rank 0 arrives only after the
        rollout in flight finished, which may take longer than the trainer's collective
        time-out (``--distributed-timeout-minutes``).
        """
        await self.ranks.barrier()
        self.weight_version += 1
        named = await self.backend.named_weights()
        if engine is not None:
            await engine.update_weights(named, self.weight_version)
        return self.weight_version

    async def save_model(self, path: str) -> None:
        await self.backend.save(path)

    async def load_model(self, path: str) -> None:
        await self.backend.load(path)


def _global_denominators(args: Namespace, batch, tids: list[int]) -> dict:
    """Step and sample denominators over the whole rollout batch (every rank's samples), SPEC.md 6.3."""
    masks = effective_loss_masks(batch.loss_masks, batch.truncated, args.mask_truncated_samples)
    steps = split_steps(len(masks), args.global_batch_size, args.num_steps_per_rollout, tids)
    excluded = excluded_samples(batch.truncated, args.mask_truncated_samples, len(masks))
    return {"step_denominators": step_denominators(masks, steps, tids, excluded),
            "sample_denominators": sample_denominators(masks, tids)}


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
