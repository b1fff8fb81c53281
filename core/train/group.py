"""The driver's train group: the loop's handle on the train workers, whatever executor placed them.

``await group.train(rollout_id, groups)`` does the driver's part of training and
hands each worker only plain data (docs/architecture.md, "One rollout's training, split"):
it turns the groups into the train batch, plans each data-parallel rank's micro-batches,
collects the workers' old and reference log-probs, runs the advantage stages, computes the
whole step's denominators, and sends each rank its
:class:`~furlong.core.train.worker.WorkerShare`. Workers run forward,
backward and optimizer steps (:class:`~furlong.core.train.worker.TrainWorker`).
Tensor/pipeline/context-parallel peers (ranks sharing a ``dp_rank`` in their backend's
:class:`~furlong.hooks.ParallelLayout`) receive the same share; only ranks that return
outputs are read. Methods return the list of per-rank results, as Miles' group does.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from furlong.hooks import ParallelLayout, PluginError, RunConfig, Sample, TrainBatch, WorkerGroup

from .advantage_stages import compute_advantages
from ..config.train_rules import pi_old_needs_own_pass, steps_per_rollout, zero_advantage_skip_blocked
from .batching import dynamic_global_batch, plan_steps, split_steps
from .custom_data import converted_batch, postprocess_rollout_data
from ..plugins.manager import FurlongPluginManager
from .reduction import effective_loss_masks, excluded_samples, sample_denominators, step_denominators
from ..plugins.selection import Selection
from .data import (advantage_input, flatten, post_process_rewards, to_train_batch, trajectory_ids,
                         truncated_flags, zero_advantage)
from .train_dump import dump_train_data
from .worker import WorkerShare

__all__ = ["TrainGroup"]

log = logging.getLogger("furlong.train")

# the per-token fields each role's workers receive for training
PER_TOKEN_FIELDS = {"actor": ("loss_masks", "old_log_probs", "ref_log_probs", "rollout_log_probs", "advantages",
                              "returns"),
                    "critic": ("loss_masks", "advantages", "returns", "values")}


class TrainGroup:
    """The train workers of one model behind Miles' async group API.

    The actor's group drives a rollout's training (:meth:`train`); a run that trains a critic
    (``config.use_critic``) has a second group of the same class, role ``critic``, which the
    actor's group asks for values (:meth:`values`) and has train on the same batch (:meth:`fit`).

    :param workers: the :class:`~furlong.hooks.WorkerGroup` the executor started.
    :param role: ``"actor"`` or ``"critic"`` (the workers' role, :class:`~furlong.core.train.worker.TrainWorker`).
    """

    def __init__(self, config: RunConfig, pm: FurlongPluginManager, selection: Selection, workers: WorkerGroup,
                 role: str = "actor"):
        self.config, self.pm, self.selection, self.workers = config, pm, selection, workers
        self.role = role
        self.layouts: list[ParallelLayout] = []
        self.reuse_old_log_probs = False  # decided in init (see _keeps_log_prob_pass)
        self.skip_zero_advantage = False  # decided in init (--skip-zero-advantage-samples)
        self.whole_groups = False  # decided in init: token-packed micro-batches keep prompt groups whole
        self.synced_versions: list[int] = []  # --keep-old-actor: the last two weight versions synced
        # held by every operation on the workers (train, save, load, offload, onload, a whole
        # weight sync): a sync started by an engine's recovery (train-async) waits for the
        # training or save in flight, so the ranks' collectives never interleave
        self.busy = asyncio.Lock()

    @property
    def dp_size(self) -> int:
        return self.layouts[0].dp_size if self.layouts else 1

    async def init(self) -> list[int]:
        """Initialize every worker's backend; return the start rollout ids (one per rank).

        :raises PluginError: the backends report inconsistent layouts (data-parallel
            sizes that differ, a data-parallel rank nobody returns outputs for).
        """
        results = await self._call("init", [()] * self.workers.size)
        self.layouts = [layout for _, layout in results]
        sizes = {layout.dp_size for layout in self.layouts}
        returning = {layout.dp_rank for layout in self.layouts if layout.returns_outputs}
        if len(sizes) != 1 or returning != set(range(sizes.pop())):
            raise PluginError(f"--train-backend {self.config.train_backend} ({self.role}): inconsistent parallel layouts "
                              f"{self.layouts}; "
                              "every rank must report the same dp_size and each data-parallel rank needs one rank "
                              "with returns_outputs.")
        if self.dp_size != self.config.data_parallel_size:
            raise PluginError(f"--train-backend {self.config.train_backend} ({self.role}): the backend runs "
                              f"{self.dp_size} data-parallel ranks but the flags give {self.config.data_parallel_size}.")
        if self.role == "critic":
            return [start for start, _ in results]
        reason = self._keeps_log_prob_pass() or (
            None if all(await self._all("train_forward_gives_old_log_probs")) else
            f"--train-backend {self.config.train_backend}'s training forward differs from its log-prob pass "
            "(dropout) or it does not say that it does not")
        self.reuse_old_log_probs = reason is None
        if self.reuse_old_log_probs:
            log.info("pi_old comes from the training forward (one optimizer step per rollout, nothing reads it "
                     "before training): the separate log-prob pass is skipped; --no-reuse-train-log-probs keeps it.")
        elif self.config.use_rollout_logprobs:
            log.info("pi_old is the rollout engine's log-probs (--use-rollout-logprobs).")
        else:
            log.info("a separate forward pass computes pi_old: %s.", reason)
        blocked = zero_advantage_skip_blocked(self.config)
        self.skip_zero_advantage = bool(self.config.skip_zero_advantage_samples) and blocked is None
        if blocked is not None:
            log.info("every sample is trained, zero advantage or not (--skip-zero-advantage-samples is off: %s).",
                     blocked)
        elif self.skip_zero_advantage:
            log.info("samples with zero advantage on every trained token are left out of the forward and backward "
                     "passes (their loss is 0; the loss denominators still count them); metrics other than loss "
                     "and pg_loss are means over the trained samples; --no-skip-zero-advantage-samples trains them.")
        self.whole_groups = bool(self.config.use_dynamic_batch_size) and all(lay.shares_prompts for lay in self.layouts)
        if self.whole_groups:
            log.info("--train-backend %s runs a prompt its samples share once per micro-batch: micro-batches packed "
                     "by tokens take each prompt group as one item while it fits (whole on one rank).",
                     self.config.train_backend)
        packed = self.config.packed_by_default
        if packed:
            log.info("no --micro-batch-size or --use-dynamic-batch-size: micro-batches are packed by tokens, at most "
                     "%d tokens each (%s); pass --micro-batch-size N for fixed micro-batches.",
                     self.config.max_tokens_per_gpu, packed)
        return [start for start, _ in results]

    async def _call(self, method: str, args_per_rank: list) -> list:
        return await self.workers.call(method, args_per_rank)

    def needs_ref(self) -> bool:
        return bool(self.config.use_kl_loss or self.config.kl_coef)

    def _keeps_log_prob_pass(self) -> str | None:
        """Why pi_old needs a separate forward-only pass, or None when the training forward of the
        rollout's single optimizer step may give it (``--reuse-train-log-probs``)."""
        reason = pi_old_needs_own_pass(self.config)
        if reason is None and not self.config.reuse_train_log_probs:
            reason = "--no-reuse-train-log-probs"
        return reason

    async def train(self, rollout_id: int, groups: list[list[Sample]], critic: "TrainGroup | None" = None,
                    concurrent: bool = False) -> list[dict]:
        """Train on one rollout; returns ``[metrics]`` with ``rollout/*``, ``perf/*`` and ``train/steps``.

        With ``critic`` (the critic's group): the critic's values come in the phase of the old
        log-probs and go into the advantage stages (``AdvantageInput.values``); then the critic
        trains on the returns while the actor trains (the actor waits for the first
        ``--num-critic-only-steps`` rollouts). ``concurrent``: both groups' calls are in flight at
        once (their workers run in processes of their own), else they take turns, critic first.
        The metrics then add ``critic/steps`` (the critic's per-step metrics) and
        ``critic/explained_variance``.
        """
        async with self.busy:
            return await self._train(rollout_id, groups, critic, concurrent)

    async def _train(self, rollout_id: int, groups: list[list[Sample]], critic: "TrainGroup | None",
                     concurrent: bool) -> list[dict]:
        config = self.config
        gbs, num_steps = config.global_batch_size, steps_per_rollout(config)
        if config.use_dynamic_global_batch_size:
            kept = dynamic_global_batch([len(g) for g in groups], self.dp_size)
            if kept < len(groups):
                log.info("--use-dynamic-global-batch-size: training on %d of %d groups (a multiple of the "
                         "data-parallel size %d samples).", kept, len(groups), self.dp_size)
            groups = groups[:kept]
            gbs = len(set(trajectory_ids(flatten(groups))))
        samples = flatten(groups)
        paths = self.selection.paths
        if "convert_samples_to_train_data" in paths:
            batch, raw, rewards = await converted_batch(config, self.pm, paths["convert_samples_to_train_data"],
                                                        samples)
        else:
            raw, rewards = await post_process_rewards(config, samples, self.pm, self.selection)
            batch = to_train_batch(config, samples)
        batch.rewards = rewards
        if batch.truncated is None:
            batch.truncated = truncated_flags(samples)
        tids = trajectory_ids(samples)
        prompts = [g for g, group in enumerate(groups) for _ in group] if self.whole_groups else None
        plans = self._plans(batch, gbs, num_steps, tids, prompts=prompts)
        shares = [_share(batch, plan) for plan in plans]
        pass_shares = self._log_prob_shares(batch, gbs, num_steps, tids, shares, prompts)
        metrics: dict = {}
        start = time.perf_counter()
        if self.needs_ref():
            batch.ref_log_probs = (await self._log_probs(pass_shares, len(samples), "ref"))[0]
        metrics["perf/ref_log_probs_time"] = time.perf_counter() - start
        start = time.perf_counter()
        reuse = self.reuse_old_log_probs and all(len(plan) == 1 for plan in plans)

        async def old_log_probs():
            if config.use_rollout_logprobs and batch.rollout_log_probs is not None:
                return batch.rollout_log_probs, None
            if reuse:  # the training forward gives pi_old; the advantage stages see none
                return None, None
            return await self._log_probs(pass_shares, len(samples), self._pi_old_model(rollout_id, samples))

        if critic is None:
            batch.old_log_probs, entropy = await old_log_probs()
        else:
            (batch.old_log_probs, entropy), batch.values = await _both(
                old_log_probs(), critic.values(batch, gbs, num_steps, tids), concurrent)
        trainer_log_probs = None
        if config.get_mismatch_metrics and config.use_rollout_logprobs and batch.rollout_log_probs is not None:
            # pi_old is the engine's; one more pass gives the trainer's, for the mismatch metrics (as Miles does)
            trainer_log_probs = (await self._log_probs(pass_shares, len(samples), "actor"))[0]
        metrics["perf/log_probs_time"] = 0.0 if reuse and critic is None else time.perf_counter() - start
        if config.disable_compute_advantages_and_returns:  # the loss reads neither (supervised fine-tuning)
            batch.advantages = batch.returns = None
        else:
            name, flag = self.selection.chosen["advantage"]
            adv = await compute_advantages(config, self.pm, advantage_input(samples, rewards, batch), name, flag)
            batch.advantages, batch.returns = adv.advantages, adv.returns
        if critic is not None:
            metrics["critic/explained_variance"] = explained_variance(batch.values, batch.returns, batch.loss_masks)
        if "rollout_data_postprocess" in paths:  # it may change the loss masks: the shares take them again
            await postprocess_rollout_data(config, self.pm, paths["rollout_data_postprocess"], batch)
            shares = [_share(batch, plan) for plan in plans]
        trained = None
        if self.skip_zero_advantage:
            trained = self._plans(batch, gbs, num_steps, tids, zero_advantage(batch.advantages, batch.loss_masks),
                                  prompts=prompts)
            shares = [_share(batch, plan) for plan in trained]
            metrics["perf/skipped_samples"] = float(len(samples) - sum(len(share.sample_ids) for share in shares))
        denominators = _global_denominators(config, batch, tids, gbs, num_steps, trained)
        for share in shares:
            _fill(share, batch, tids, denominators, PER_TOKEN_FIELDS["actor"])
            share.reuse_old_log_probs = reuse
            share.trainer_log_probs = _pick(trainer_log_probs, share.sample_ids)
        if config.dump_details:
            dump_train_data(config.dump_details, rollout_id, shares)

        async def actor_fit():
            begin = time.perf_counter()
            results = await self._call("train", self._per_rank(lambda s: (rollout_id, s), shares))
            metrics["perf/actor_train_time"] = time.perf_counter() - begin
            return self._outputs(results)

        async def critic_fit():
            begin = time.perf_counter()
            steps = await critic.fit(rollout_id, batch, gbs, num_steps, tids)
            metrics["perf/critic_train_time"] = time.perf_counter() - begin
            return steps

        actor_trains = critic is None or rollout_id >= config.num_critic_only_steps
        if critic is None:
            metrics["train/steps"] = await actor_fit()
        else:
            metrics["critic/steps"], metrics["train/steps"] = await _both(
                critic_fit(), actor_fit() if actor_trains else _nothing([]), concurrent)
        if reuse and actor_trains:  # samples left out of training have none (None)
            batch.old_log_probs, entropy = await self._train_log_probs(shares, len(samples))
        if actor_trains and ref_update_due(config, rollout_id):
            begin = time.perf_counter()
            await self._all("update_ref_model")
            metrics["perf/ref_update_time"] = time.perf_counter() - begin
            log.info("rollout %d: the reference model takes the actor's weights (--ref-update-interval %d).",
                     rollout_id, config.ref_update_interval)
        metrics.update(_token_means(batch, entropy))
        metrics["rollout/rewards"] = float(torch.tensor(rewards).mean()) if rewards else 0.0
        metrics["rollout/raw_reward"] = float(torch.tensor(raw).mean()) if raw else 0.0
        return [metrics]

    def _outputs(self, results: list):
        """The result of the first rank that returns outputs."""
        return next(r for r, lay in zip(results, self.layouts) if lay.returns_outputs)

    # --- the critic's side (role "critic"), driven by the actor's group ----------------------

    async def values(self, batch: TrainBatch, gbs: int, num_steps: int, tids: list[int]) -> list:
        """The critic's values of every sample of ``batch`` (float32 [T_i], batch order), forward only."""
        async with self.busy:
            shares = [_share(batch, plan) for plan in self._plans(batch, gbs, num_steps, tids)]
            results = await self._call("values", self._per_rank(lambda s: (s,), shares))
            return self._merge(results, shares, len(batch.tokens), "values()")[0]

    async def fit(self, rollout_id: int, batch: TrainBatch, gbs: int, num_steps: int, tids: list[int]) -> list[dict]:
        """Train the critic on ``batch`` (``values`` at scoring time, ``returns``): per-step metrics."""
        async with self.busy:
            shares = [_share(batch, plan) for plan in self._plans(batch, gbs, num_steps, tids)]
            denominators = _global_denominators(self.config, batch, tids, gbs, num_steps)
            for share in shares:
                _fill(share, batch, tids, denominators, PER_TOKEN_FIELDS["critic"])
            return self._outputs(await self._call("train", self._per_rank(lambda s: (rollout_id, s), shares)))

    def _log_prob_shares(self, batch: TrainBatch, gbs: int, num_steps: int, tids: list[int],
                         shares: list[WorkerShare], prompts: list[int] | None = None) -> list[WorkerShare]:
        """The shares the forward-only passes (reference and pi_old) run: micro-batches packed under
        ``--log-probs-max-tokens-per-gpu`` when the run packs by tokens and that budget differs from
        ``--max-tokens-per-gpu`` (a pass keeps no activations for backward, so it may take more), else the
        training ``shares``. Each sample's log-probs are the same under any packing; only speed and memory
        change."""
        config = self.config
        cap = config.log_probs_max_tokens_per_gpu
        if not config.use_dynamic_batch_size or not cap or cap == config.max_tokens_per_gpu:
            return shares
        return [_share(batch, plan) for plan in self._plans(batch, gbs, num_steps, tids, max_tokens=cap,
                                                            prompts=prompts)]

    def _plans(self, batch: TrainBatch, gbs: int, num_steps: int, tids: list[int], skip: list[bool] | None = None,
               max_tokens: int | None = None, prompts: list[int] | None = None):
        """Every data-parallel rank's micro-batches (:func:`~furlong.core.train.batching.plan_steps`), packed
        under ``max_tokens`` (default ``--max-tokens-per-gpu``) when the run packs by tokens; ``prompts``: each
        sample's prompt group, kept whole in a micro-batch where it fits (a backend that shares prompts)."""
        config = self.config
        return [plan_steps(
            lengths=[len(t) for t in batch.tokens], global_batch_size=gbs,
            num_steps=num_steps, dp_size=self.dp_size, rank=r,
            micro_batch_size=config.micro_batch_size, max_tokens_per_gpu=max_tokens or config.max_tokens_per_gpu,
            dynamic=config.use_dynamic_batch_size, balance=config.balance_data, trajectory_ids=tids, skip=skip,
            groups=prompts,
        ) for r in range(self.dp_size)]

    async def _log_probs(self, shares: list[WorkerShare], n: int, model: str) -> tuple[list, list | None]:
        """Every sample's log-probs and entropy (float32 [T_i]) in batch order, from the workers' shares."""
        results = await self._call("log_probs", self._per_rank(lambda s: (s, model), shares))
        return self._merge(results, shares, n, f"log_probs(model={model!r})")

    async def _train_log_probs(self, shares: list[WorkerShare], n: int) -> tuple[list, list | None]:
        """pi_old and entropy of every sample as the last training forward gave them, in batch order."""
        results = await self._call("train_log_probs", self._per_rank(lambda s: (s,), shares))
        return self._merge(results, shares, n, "train_log_probs()", every=False)

    def _merge(self, results: list, shares: list[WorkerShare], n: int, what: str,
               every: bool = True) -> tuple[list, list | None]:
        """Per-rank outputs in batch order; ``every``: each of the ``n`` samples must have one (else the
        samples no share holds stay None)."""
        log_probs, entropy = [None] * n, [None] * n
        for result, layout in zip(results, self.layouts):
            if not layout.returns_outputs:
                continue
            share = shares[layout.dp_rank]
            ent = result.get("entropy") or [None] * len(share.sample_ids)
            for local, i in enumerate(share.sample_ids):
                log_probs[i], entropy[i] = result["log_probs"][local], ent[local]
        held = {i for share in shares for i in share.sample_ids}
        missing = [i for i, row in enumerate(log_probs) if row is None and (every or i in held)]
        if missing:
            raise PluginError(f"--train-backend {self.config.train_backend} ({self.role}): {what} returned "
                              f"nothing for samples {missing[:8]}.")
        complete = all(e is not None for e, lp in zip(entropy, log_probs) if lp is not None)
        return log_probs, (entropy if complete else None)

    def _per_rank(self, make, shares: list[WorkerShare]) -> list[tuple]:
        """Arguments for every rank: its data-parallel rank's share (peers get the same)."""
        return [make(shares[layout.dp_rank]) for layout in self.layouts]

    async def _all(self, method: str, *args) -> list:
        return await self._call(method, [args] * self.workers.size)

    async def _all_exclusive(self, method: str, *args) -> list:
        async with self.busy:
            return await self._all(method, *args)

    async def save_model(self, path: str) -> list:
        """Every rank writes its part of the checkpoint into ``path``."""
        return await self._all_exclusive("save", path)

    async def save_hf(self, path: str) -> list:
        """Every rank takes part in writing a Hugging Face export of the weights to ``path`` (``--save-hf``)."""
        return await self._all_exclusive("save_hf", path)

    async def load_model(self, path: str) -> list:
        return await self._all_exclusive("load", path)

    async def offload(self) -> list:
        """Trainer memory to the host while the engines generate (``--offload-train``)."""
        return await self._all_exclusive("offload")

    async def onload(self) -> list:
        return await self._all_exclusive("onload")

    async def clear_memory(self) -> list:
        return await self._all_exclusive("clear_memory")

    async def keep_synced_weights(self, version: int) -> list:
        """After weight sync ``version`` (``--keep-old-actor``): every rank keeps a copy of the weights just sent,
        the copy of the sync before becoming the old actor (:meth:`_pi_old_model`)."""
        self.synced_versions = [*self.synced_versions[-1:], int(version)]
        return await self._all_exclusive("keep_synced_weights")

    def _pi_old_model(self, rollout_id: int, samples: list[Sample]) -> str:
        """The model pi_old comes from: ``"actor"``, or under ``--keep-old-actor`` the weights the engines generated
        the rollout with. Weights sync right after training, so the last sync's are the actor's own; a rollout
        generated one sync behind (train-async) gets ``"old_actor"``, the copy kept at the sync before."""
        if not self.config.keep_old_actor or len(self.synced_versions) < 2:
            return "actor"
        versions = [v for v in (s.oldest_weight_version for s in samples) if v is not None]
        oldest = min(versions) if versions else self.synced_versions[-1]
        if oldest >= self.synced_versions[-1]:
            return "actor"
        if oldest < self.synced_versions[0]:
            log.warning("--keep-old-actor: rollout %d has samples of weight version %d, older than the two kept "
                        "(%s); pi_old comes from the older of them.", rollout_id, oldest, self.synced_versions)
        return "old_actor"

    # --- weight stream, driven by :mod:`furlong.core.run.weight_sync`, which holds ``busy`` -------

    async def begin_weights(self) -> None:
        await self._all("begin_weights")

    async def next_weight_bucket(self, max_bytes: int, with_tensors: bool):
        """Rank 0's next bucket (every rank takes part: gathering full tensors may be a collective)."""
        return (await self._all("next_weight_bucket", max_bytes, with_tensors))[0]

    async def call_rank0(self, method: str, *args):
        """``method`` on train rank 0 alone (the weight-update group's rank 0)."""
        return (await self._call(method, [args] + [None] * (self.workers.size - 1)))[0]


def ref_update_due(config: RunConfig, rollout_id: int) -> bool:
    """Whether the reference model takes the actor's weights after training rollout ``rollout_id``:
    ``(rollout_id + 1) % --ref-update-interval == 0`` (never without the flag), as Miles' actors decide."""
    interval = config.ref_update_interval
    return bool(interval) and (rollout_id + 1) % interval == 0


def _share(batch: TrainBatch, plan: list[list[list[int]]]) -> WorkerShare:
    """The samples of one rank's plan as a batch of their own, micro-batches in local indices."""
    ids = [i for step in plan for mb in step for i in mb]
    local = {i: k for k, i in enumerate(ids)}
    sub = TrainBatch(
        tokens=[batch.tokens[i] for i in ids],
        response_lengths=[batch.response_lengths[i] for i in ids],
        loss_masks=[batch.loss_masks[i] for i in ids],
        steps=[[[local[i] for i in mb] for mb in step] for step in plan],
        truncated=[batch.truncated[i] for i in ids] if batch.truncated is not None else None,
        sample_indices=[batch.sample_indices[i] for i in ids] if batch.sample_indices is not None else None,
        rollout_log_probs=_pick(batch.rollout_log_probs, ids),
        routed_experts=_pick(batch.routed_experts, ids),
        temperature=batch.temperature,
    )
    return WorkerShare(batch=sub, sample_ids=ids)


def _fill(share: WorkerShare, batch: TrainBatch, tids: list[int], denominators: dict, fields: tuple[str, ...]) -> None:
    """Add what training needs once the driver has it: the per-token ``fields`` and the denominators."""
    ids = share.sample_ids
    for field in fields:
        setattr(share.batch, field, _pick(getattr(batch, field), ids))
    share.batch.rewards = [batch.rewards[i] for i in ids] if batch.rewards is not None else None
    share.step_denominators = denominators["step_denominators"]
    share.metric_step_denominators = denominators.get("metric_step_denominators") or []
    share.sample_denominators = [denominators["sample_denominators"][i] for i in ids]
    share.trajectory_ids = [tids[i] for i in ids]


async def _both(first, second, concurrent: bool) -> tuple:
    """The results of two awaitables: in flight at once (``concurrent``), else ``first`` then ``second``."""
    if concurrent:
        return tuple(await asyncio.gather(first, second))
    return await first, await second


async def _nothing(value):
    return value


def explained_variance(values: list, returns: list, loss_masks: list) -> float:
    """``1 - Var(R - V) / Var(R)`` over the trained tokens (mask > 0) of the whole rollout, float64.

    1: the values predict the returns exactly; 0: no better than their mean; below 0: worse.
    0.0 when fewer than two tokens are trained or the returns do not vary.

    :param values: N float tensors [T_i] (the critic's values the advantages used);
        :param returns: N float tensors [T_i]; :param loss_masks: N tensors [T_i].
    """
    live = torch.cat([m.reshape(-1) for m in loss_masks]) > 0 if loss_masks else torch.zeros(0, dtype=torch.bool)
    if int(live.sum()) < 2:
        return 0.0
    ret = torch.cat([r.reshape(-1).double() for r in returns])[live]
    val = torch.cat([v.reshape(-1).double() for v in values])[live]
    spread = float(ret.var(unbiased=False))
    return 0.0 if spread == 0 else 1.0 - float((ret - val).var(unbiased=False)) / spread


def _pick(rows: list | None, ids: list[int]) -> list | None:
    return None if rows is None else [rows[i] for i in ids]


def _global_denominators(config: RunConfig, batch, tids: list[int], gbs: int, num_steps: int,
                         trained: list | None = None) -> dict:
    """Step and sample denominators over the whole rollout batch (every rank's samples).

    ``trained``: every rank's plan when some samples are not trained; then also
    ``metric_step_denominators``, the step denominators over the trained samples.
    """
    masks = effective_loss_masks(batch.loss_masks, batch.truncated, config.mask_truncated_samples)
    steps = split_steps(len(masks), gbs, num_steps, tids)
    excluded = excluded_samples(batch.truncated, config.mask_truncated_samples, len(masks))
    out = {"step_denominators": step_denominators(masks, steps, tids, excluded),
           "sample_denominators": sample_denominators(masks, tids)}
    if trained is not None:
        ran = [sorted(i for plan in trained for mb in plan[s] for i in mb) for s in range(len(steps))]
        out["metric_step_denominators"] = step_denominators(masks, ran, tids, excluded)
    return out


def _token_means(batch, entropy) -> dict:
    """Sample-mean over loss masks of the per-token rollout tensors; a field's samples
    without a value (None: left out of training, for pi_old from the training forward) are left out."""
    fields = {"rollout/log_probs": batch.old_log_probs, "rollout/ref_log_probs": batch.ref_log_probs,
              "rollout/rollout_log_probs": batch.rollout_log_probs, "rollout/advantages": batch.advantages,
              "rollout/returns": batch.returns, "rollout/entropy": entropy}
    masks = torch.cat([m.reshape(-1).float() for m in batch.loss_masks]) if batch.loss_masks else torch.zeros(0)
    sample = torch.repeat_interleave(torch.arange(len(batch.loss_masks)),
                                     torch.tensor([m.numel() for m in batch.loss_masks], dtype=torch.long))
    counts = torch.zeros(len(batch.loss_masks)).index_add_(0, sample, masks)
    counted = counts > 0
    out = {}
    for name, values in fields.items():
        if values is None:
            continue
        use = counted & torch.tensor([v is not None for v in values], dtype=torch.bool)
        if not bool(use.any()):
            continue
        rows = [v.reshape(-1).float() if v is not None else torch.zeros(m.numel())
                for v, m in zip(values, batch.loss_masks)]
        sums = torch.zeros(len(values)).index_add_(0, sample, torch.cat(rows) * masks)
        out[name] = float((sums[use] / counts[use]).mean())
    return out
