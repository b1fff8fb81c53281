"""The step objective a train backend calls once per micro-batch (``furlong.hooks.StepObjective``).

It builds the ``LossInput`` of the micro-batch, calls the chosen ``loss`` plugin, and
reduces the plugin's per-token ``token_loss`` and every metric with the denominators of
the whole optimizer step (:mod:`furlong.core.train.reduction`). Summing the returned losses and
metrics over a step's micro-batches gives the step objective and metrics exactly.

The loss plugin returns the *combined* per-token objective in ``token_loss`` (for
``policy_loss``: ``l - entropy_coef*H + kl_loss_coef*kl``); the core reduces
it once, so ``loss = pg_loss - entropy_coef*entropy_loss + kl_loss_coef*kl_loss`` holds for
the reduced values because the reducer is linear. With a ``loss_reducer`` plugin
(``--loss-reducer NAME`` or ``--custom-pg-loss-reducer-function-path``) the
policy-gradient term (``token_metrics["pg_loss"]``, which must carry grad) is reduced by
that plugin and the rest (``token_loss - pg_loss``) by the core's.

Data parallelism: each rank builds its own objective over its share of the samples. The
denominators must then be global: compute them on the whole rollout batch before the
split with :func:`~furlong.core.train.reduction.effective_loss_masks`,
:func:`~furlong.core.train.reduction.sample_denominators` and
:func:`~furlong.core.train.reduction.step_denominators`, and pass ``step_denominators`` (one per
step) and ``sample_denominators`` (this rank's samples, in ``TrainBatch`` order). The
returned loss already carries the global denominators, so a train backend must SUM
gradients over data-parallel ranks, never average them (the fsdp backend sets FSDP2's
gradient divide factor to 1); summing metrics over micro-batches and ranks likewise
gives the step's value.
"""

from __future__ import annotations

from typing import Any, Sequence

from furlong.hooks import LossInput, LossOutput, PluginError, RunConfig, TrainBatch
from furlong.hooks.contract import check_loss_output, check_loss_reducer_output
from furlong.kit.kl import rollout_mismatch
from furlong.kit.masked import MaskedSum
from furlong.hooks.rows import SplitRows, concat_rows, detached_rows, row_lengths
from furlong.kit.trainer import rows_to_device

from . import reduction

from ..plugins.selection import chosen_reducer, register_path

__all__ = ["LOSS_METRICS", "StepObjective"]

# metrics reduced with the step's denominators even when some samples are not trained: the
# policy-gradient term, which then equals the loss whichever samples were trained (the other metrics
# describe the trained samples)
LOSS_METRICS = frozenset({"pg_loss"})
TIS_FLAG = "--custom-tis-function-path"


class StepObjective:
    """Loss of one micro-batch, reduced with whole-step denominators.

    Implements the :class:`furlong.hooks.StepObjective` protocol; the core stores it in
    ``TrainBatch.objective``.

    Flags read: ``calculate_per_token_loss``, ``mask_truncated_samples``,
    ``loss_reducer``, ``custom_pg_loss_reducer_function_path``, ``use_rollout_logprobs`` (pi_old is then the
    engine's log-probs, ``batch.rollout_log_probs``), ``custom_tis_function_path`` with ``use_tis`` or
    ``get_mismatch_metrics`` (:meth:`_mismatch`); the loss plugin reads its own.

    :param config: the run configuration.
    :param pm: the plugin manager (``furlong.core.plugins.manager.FurlongPluginManager``).
    :param batch: this rank's ``TrainBatch``; ``batch.steps[s][m]`` lists the sample ids
        of micro-batch ``m`` of step ``s``.
    :param loss_name: the chosen loss plugin (``--loss-type``, e.g. ``policy_loss``).
    :param loss_flag: the flag that chose it, for error messages (``--loss-type``).
    :param dp_world_size: data-parallel ranks; above 1 the global denominators are required (see module doc).
    :param trajectory_ids: N trajectory ids (siblings share ``D_i`` and count once in
        ``n_s``), or None (each sample its own trajectory).
    :param truncated: N bools, True for samples with finish reason ``length``; used with
        ``--mask-truncated-samples``; default ``batch.truncated``.
    :param old_values: N float32 [T_i] critic values at scoring time (``value_loss``).
    :param sample_denominators: N floats ``D_i``, global over ranks (required when
        ``dp_world_size > 1`` and trajectories span ranks); default: from this batch.
    :param step_denominators: one :class:`~furlong.core.train.reduction.StepDenominators` per
        step, global over ranks (required when ``dp_world_size > 1``); default: from this
        batch's ``steps``.
    :param reuse_old_log_probs: pi_old is the training forward's log-probs, detached
        (``--reuse-train-log-probs``: one step, ``batch.old_log_probs`` is None); each call
        keeps them and the entropy, float32 ``[T_i]`` on the host, in :attr:`old_log_probs`
        and :attr:`entropy` (N entries, local order) for the driver's rollout metrics.
    :param metric_step_denominators: one per step, over the samples trained in it on every
        rank, when some are left out (``--skip-zero-advantage-samples``): metrics other than
        :data:`LOSS_METRICS` are then means over the trained samples; default: the step
        denominators.
    :param reducer: False ignores ``--loss-reducer`` and ``--custom-tis-function-path`` (a critic's value loss:
        both are the policy gradient's).
    :param trainer_log_probs: N float32 [T_i], pi_old as the trainer computed it when pi_old is the engine's
        (``--use-rollout-logprobs --get-mismatch-metrics``): the mismatch metrics compare it with the engine's.
    :raises PluginError: a bad ``--loss-reducer`` or ``--custom-pg-loss-reducer-function-path``.
    :raises ValueError: ``dp_world_size > 1`` without global step denominators; reuse with
        more than one step.
    """

    def __init__(
        self,
        config: RunConfig,
        pm: Any,
        batch: TrainBatch,
        loss_name: str,
        loss_flag: str,
        dp_world_size: int = 1,
        *,
        trajectory_ids: Sequence[int] | None = None,
        truncated: Sequence[bool] | None = None,
        old_values: list | None = None,
        sample_denominators: Sequence[float] | None = None,
        step_denominators: Sequence[reduction.StepDenominators] | None = None,
        reuse_old_log_probs: bool = False,
        metric_step_denominators: Sequence[reduction.StepDenominators] | None = None,
        reducer: bool = True,
        trainer_log_probs: list | None = None,
    ) -> None:
        self.config, self.pm, self.batch = config, pm, batch
        if reuse_old_log_probs and len(batch.steps) != 1:
            raise ValueError(f"StepObjective: pi_old from the training forward needs one optimizer step, "
                             f"got {len(batch.steps)}")
        self.reuse_old_log_probs = bool(reuse_old_log_probs)
        self.old_log_probs: list = [None] * len(batch.tokens)
        self.entropy: list = [None] * len(batch.tokens)
        self.loss_name, self.loss_flag = loss_name, loss_flag
        self.dp_world_size = int(dp_world_size)
        self.old_values = old_values
        self.per_token = bool(config.calculate_per_token_loss)
        if truncated is None:
            truncated = batch.truncated
        self.masks = reduction.effective_loss_masks(batch.loss_masks, truncated, config.mask_truncated_samples)
        n = len(self.masks)
        self.step_of = {}
        for s, step in enumerate(batch.steps):
            for i in reduction._flatten(step):
                self.step_of[i] = s
        if step_denominators is None:
            if self.dp_world_size > 1:
                raise ValueError(
                    "StepObjective: dp_world_size > 1 needs step_denominators computed over every rank's samples "
                    "(furlong.core.train.reduction.step_denominators on the whole rollout batch)"
                )
            excluded = reduction.excluded_samples(truncated, config.mask_truncated_samples, n)
            step_denominators = reduction.step_denominators(self.masks, batch.steps, trajectory_ids, excluded)
        if len(step_denominators) != len(batch.steps):
            raise ValueError(f"{len(step_denominators)} step denominators for {len(batch.steps)} steps")
        self.step_denominators = list(step_denominators)
        if metric_step_denominators is not None and len(metric_step_denominators) != len(batch.steps):
            raise ValueError(f"{len(metric_step_denominators)} metric step denominators for {len(batch.steps)} steps")
        self.metric_step_denominators = list(metric_step_denominators or self.step_denominators)
        if sample_denominators is None:
            if self.dp_world_size > 1 and trajectory_ids is not None:
                raise ValueError(
                    "StepObjective: dp_world_size > 1 with trajectory ids needs sample_denominators computed over "
                    "every rank's siblings (furlong.core.train.reduction.sample_denominators on the whole rollout batch)"
                )
            sample_denominators = reduction.sample_denominators(self.masks, trajectory_ids)
        reduction._check_len("sample_denominators", sample_denominators, n)
        self.sample_denominators = [float(d) for d in sample_denominators]
        self.reducer = chosen_reducer(config, pm) if reducer else None
        self.trainer_log_probs = trainer_log_probs
        self.tis = None
        if reducer and config.custom_tis_function_path and (config.use_tis or config.get_mismatch_metrics):
            self.tis = register_path(pm, "tis_function", config.custom_tis_function_path, TIS_FLAG)

    async def __call__(
        self, sample_ids: list[int], log_probs: list, entropy: list | None, values: list | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Loss and metrics of one micro-batch (see :class:`furlong.hooks.StepObjective`).

        :param sample_ids: indices into the ``TrainBatch``, all of one step.
        :param log_probs: N float32 tensors [T_i] of the current policy, carrying grad (None for a critic).
        :param entropy: N float32 tensors [T_i], or None when not computed.
        :param values: N float32 tensors [T_i] of the current critic (``value_loss``), or None.
        :returns: ``(loss, metrics)``: a 0-dim float32 tensor to ``backward()`` and detached
            0-dim float32 tensors (read once per step, so that no micro-batch waits for the
            GPU) already divided by the step's denominators, including ``loss`` (the reduced
            objective, not multiplied).
        :raises PluginError: the loss plugin fails, returns the wrong shapes, or (custom
            reducer) reports no grad-carrying ``pg_loss``.
        """
        import torch

        sample_ids = [int(i) for i in sample_ids]
        s = self._step(sample_ids)
        step = self.step_denominators[s] if s is not None else reduction.StepDenominators(0, 0.0)
        rows = log_probs if log_probs is not None else values
        device = rows[0].device if rows else torch.device("cpu")
        masks = rows_to_device([self.masks[i] for i in sample_ids], device)
        if self.config.use_rollout_logprobs and self.batch.rollout_log_probs is not None:
            old = self._pick(self.batch.rollout_log_probs, sample_ids, device)
        elif self.reuse_old_log_probs:
            old = detached_rows(log_probs)
            self._keep(sample_ids, old, entropy)
        else:
            old = self._pick(self.batch.old_log_probs, sample_ids, device)
        loss_input = LossInput(
            log_probs=_as_list(log_probs) if log_probs is not None else None,
            old_log_probs=old,
            advantages=self._pick(self.batch.advantages, sample_ids, device),
            loss_masks=masks,
            ref_log_probs=self._pick(self.batch.ref_log_probs, sample_ids, device),
            rollout_log_probs=self._pick(self.batch.rollout_log_probs, sample_ids, device),
            entropy=_as_list(entropy) if entropy is not None else None,
            values=_as_list(values) if values is not None else None,
            old_values=self._pick(self.old_values, sample_ids, device),
            returns=self._pick(self.batch.returns, sample_ids, device),
        )
        out = await self.pm.call_chosen("loss", self.loss_name, self.loss_flag, config=self.config, batch=loss_input)
        self._check_output(out, masks)
        if self.tis is not None or self.trainer_log_probs is not None:
            trainer = self._pick(self.trainer_log_probs, sample_ids, device) if self.trainer_log_probs else old
            out = await self._mismatch(out, sample_ids, masks, trainer, loss_input.rollout_log_probs)
        weights = reduction.sample_weights(sample_ids, self.sample_denominators, step, self.per_token)
        reduce = MaskedSum(masks, weights)  # kit.masked.masked_sum, the masks and weights built once
        trained = self.metric_step_denominators[s] if s is not None else step
        reduce_metric = reduce if trained == step else MaskedSum(
            masks, reduction.sample_weights(sample_ids, self.sample_denominators, trained, self.per_token))
        metrics = {k: (reduce if k in LOSS_METRICS else reduce_metric)(detached_rows(rows))
                   for k, rows in out.token_metrics.items()}
        if self.reducer is None:
            total = reduce(out.token_loss)
        else:
            pg = await self._reduced_pg(out, sample_ids, masks, step)
            rest = [t - p for t, p in zip(out.token_loss, out.token_metrics["pg_loss"])]
            total = pg + reduce(rest)
            metrics["pg_loss"] = pg.detach()
        metrics["loss"] = total.detach()
        return total, metrics

    async def _mismatch(self, out: LossOutput, sample_ids: list[int], masks: list, trainer: list,
                        rollout: list | None) -> LossOutput:
        """The train/rollout mismatch of one micro-batch: :func:`~furlong.kit.kl.rollout_mismatch` of the
        trainer's pi_old against the engine's log-probs (the loss plugin compared pi_old, which is the
        engine's own under ``--use-rollout-logprobs``), then ``--custom-tis-function-path`` on the policy-gradient
        term (Miles' order: the function's weights multiply ``pg_loss``, the masks it returns zero rejected
        tokens in the numerator; its metrics and ``ois = exp(-ppo_kl)`` join the loss's metrics)."""
        import torch

        if rollout is None:
            raise PluginError(f"{TIS_FLAG} / --get-mismatch-metrics: the batch has no rollout log-probs; the rollout "
                              "engine must return per-token log-probs (Sample.rollout_log_probs).")
        lengths = row_lengths(masks)
        active = concat_rows(masks) > 0
        train_flat = concat_rows(trainer).detach().float()
        metrics = dict(out.token_metrics)
        for name, value in rollout_mismatch(train_flat, concat_rows(rollout).float(), active).items():
            metrics[name] = SplitRows.of(value, lengths)
        if self.tis is None:
            return LossOutput(token_loss=out.token_loss, token_metrics=metrics)
        pg_rows = metrics.get("pg_loss")
        if pg_rows is None:
            raise PluginError(f"{TIS_FLAG}: {self.loss_flag} '{self.loss_name}' reports no per-token pg_loss for the "
                              "function to weight.")
        pg = concat_rows(pg_rows)
        detached = [t.detach() for t in trainer]
        new_pg, new_masks, extra = await self.pm.call_chosen(
            "tis_function", self.tis, TIS_FLAG, config=self.config, pg_loss=pg, train_log_probs=detached,
            rollout_log_probs=list(rollout), loss_masks=list(masks),
            total_lengths=[len(self.batch.tokens[i]) for i in sample_ids], response_lengths=lengths)
        if not torch.is_tensor(new_pg) or new_pg.shape != pg.shape:
            raise PluginError(f"{TIS_FLAG}: the function returned pg_loss of shape "
                              f"{tuple(getattr(new_pg, 'shape', ()))}; it must keep the shape {tuple(pg.shape)}.")
        new_pg = new_pg * torch.cat([torch.as_tensor(m).reshape(-1).to(new_pg) for m in new_masks])
        total = concat_rows(out.token_loss) - pg + new_pg
        metrics["pg_loss"] = SplitRows.of(new_pg, lengths)
        if "ppo_kl" in metrics and "ois" not in metrics:
            metrics["ois"] = SplitRows.of(torch.exp(-concat_rows(metrics["ppo_kl"]).detach().float()), lengths)
        for name, value in extra.items():
            metrics[name] = SplitRows.of(torch.as_tensor(value).reshape(-1).detach().float(), lengths)
        return LossOutput(token_loss=SplitRows.of(total, lengths), token_metrics=metrics)

    def _step(self, sample_ids: list[int]) -> int | None:
        """The step of the micro-batch's samples (None for no sample)."""
        steps = {self.step_of.get(i) for i in sample_ids}
        if None in steps:
            missing = [i for i in sample_ids if i not in self.step_of]
            raise ValueError(f"samples {missing} are in no step of TrainBatch.steps")
        if len(steps) > 1:
            raise ValueError(f"one micro-batch mixes samples of steps {sorted(steps)}")
        return steps.pop() if steps else None

    def _keep(self, sample_ids: list[int], old: list, entropy: list | None) -> None:
        import torch

        if not len(old):
            return
        parts = [concat_rows(old).detach().float()]
        if entropy is not None:
            parts.append(concat_rows(entropy).detach().float())
        # one copy, not blocking on a GPU: the values are read after the step, once the step's metrics
        # have been synchronised (StepLoop.train)
        host = torch.cat(parts).to("cpu", non_blocking=True).split(
            row_lengths(old) + (row_lengths(entropy) if entropy is not None else []))
        for k, i in enumerate(sample_ids):
            self.old_log_probs[i] = host[k]
            if entropy is not None:
                self.entropy[i] = host[len(sample_ids) + k]

    @staticmethod
    def _pick(rows: list | None, sample_ids: list[int], device) -> list | None:
        if rows is None:
            return None
        return rows_to_device([rows[i] for i in sample_ids], device)

    def _check_output(self, out: Any, masks: list) -> None:
        check_loss_output(out, masks, f"{self.loss_flag} '{self.loss_name}'")

    async def _reduced_pg(self, out: LossOutput, sample_ids: list[int], masks: list, step) -> Any:
        """The chosen ``loss_reducer`` on ``token_metrics["pg_loss"]``, times the step factor."""
        name, flag = self.reducer
        where = f"{flag} '{name}'"
        pg_rows = out.token_metrics.get("pg_loss")
        grads = any(t.requires_grad for t in out.token_loss)
        if pg_rows is None or (grads and not any(t.requires_grad for t in pg_rows)):
            raise PluginError(
                f"{where}: {self.loss_flag} '{self.loss_name}' must report its per-token policy-gradient term, "
                "carrying grad, as token_metrics['pg_loss'] for a loss reducer."
            )
        total_lengths = [len(self.batch.tokens[i]) for i in sample_ids]
        value = await self.pm.call_chosen("loss_reducer", name, flag, config=self.config, values=list(pg_rows),
                                          loss_masks=masks, total_lengths=total_lengths)
        check_loss_reducer_output(value, where)
        return value.reshape(()).float() * reduction.step_scale(step, self.per_token)


def _as_list(rows) -> list:
    """``rows`` as a list the loss plugin may keep or change: a :class:`SplitRows` as it is, else a new list."""
    return rows if isinstance(rows, SplitRows) else list(rows)
