"""Micro-batches through megatron-core's pipeline schedule (``--pipeline-model-parallel-size`` > 1).

Every stage of a data-parallel rank runs the same micro-batches in the same order:
megatron-core's non-interleaved 1F1B schedule (``get_forward_backward_func``) sends each
micro-batch's activations ``[s, b, h]`` to the next stage and their gradients back. The
last stage turns the logits into response log-probs and entropy (:mod:`.logprobs`) and,
when training, into the loss of the core's objective, which the schedule back-propagates
unscaled (the model's config sets ``calculate_per_token_loss``; the objective already
carries the step's denominators). :class:`PipelineStages` holds the backend's
methods for it and for a tied model's two embedding copies.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Callable

from furlong.hooks import TrainBatch
from furlong.kit.trainer import sum_step_metrics

from .logprobs import micro_batch_inputs, model_extra, projecting_rows, response_log_probs, sequence_parallel_size

__all__ = ["PipelineStages", "broadcast_from_last_stage", "run_schedule"]


def run_schedule(model, chunks: list[list[int]], inputs: Callable, finish: Callable, *, grad: bool,
                 around: Callable | None = None) -> None:
    """Run every micro-batch of ``chunks`` through the pipeline (a collective over the stages).

    :param chunks: sample ids per micro-batch, the same on every stage.
    :param inputs: ``ids -> MicroBatchInputs`` (:func:`~.logprobs.micro_batch_inputs`), on every stage.
    :param finish: ``(ids, inputs, logits) -> loss`` on the last stage: a scalar tensor that
        the schedule back-propagates when ``grad`` (its value is not used otherwise).
    :param grad: train (forward and backward, gradients accumulate) or forward only.
    :param around: ``ids -> context manager`` entered around each micro-batch's forward on every stage
        (routing replay), or None.
    """
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, stage_model):
        ids = next(data_iterator)
        batch = inputs(ids)
        with projecting_rows(stage_model, batch.head_rows), (around(ids) if around else contextlib.nullcontext()):
            output = stage_model(input_ids=batch.ids, position_ids=None, attention_mask=None,
                                 **model_extra(stage_model, batch))
        # the schedule sends a stage's output to the next stage as it is, and send needs a contiguous tensor: under
        # sequence parallelism a padded micro-batch's output ([s / TP, b, h], b > 1) is a view of a [b, s / TP, h] one
        output = output.contiguous()

        def loss_func(logits):
            return finish(ids, batch, logits), torch.ones((), dtype=torch.int, device=logits.device), {}

        return output, loss_func

    with torch.set_grad_enabled(grad), _backend_aux_loss_scale():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(chunks), model=[model],
                                    num_microbatches=len(chunks), seq_length=1, micro_batch_size=1,
                                    forward_only=not grad)


@contextlib.contextmanager
def _backend_aux_loss_scale():
    """While megatron-core's schedule runs, skip the scale it gives the MoE load-balancing loss's gradient after
    every forward (1 under ``calculate_per_token_loss``, where it expects ``finalize_model_grads`` to divide every
    gradient by the step's tokens): the backend's objective carries the step's denominators, and the backend sets
    the scale once per step (:class:`~.moe_train.ExpertLayers`), with the routers' per-token multiplication off
    (:func:`~.model.build_gpt`)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    own = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]
    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(lambda scale: None)
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = own


def broadcast_from_last_stage(value: Any) -> Any:
    """``value`` of the last pipeline stage (picklable), on every stage of this pipeline (a collective)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, dist.get_world_size(group) - 1), group=group)
    return box[0]


class PipelineStages:
    """The :class:`~.backend.MegatronBackend` parts that differ with PP > 1: micro-batch passes through
    :func:`run_schedule` (PP = 1 keeps :class:`furlong.kit.trainer.StepLoop`'s) and a tied model's two
    embedding copies (the first stage's table, the last stage's output layer).

    Uses the backend's ``pp``, ``stage``, ``shape``, ``model``, ``masters``, ``config``, ``device``, ``_mcore()``,
    ``_packed()`` and ``_routing()`` (:class:`~.moe_train.ExpertLayers`).
    """

    def _pipeline(self, net, batch: TrainBatch, chunks: list[list[int]], grad: bool, loop) -> list[tuple]:
        """Run ``chunks`` through megatron-core's pipeline schedule (:func:`run_schedule`).

        On the last stage: forward only, ``(ids, log_probs, entropy)`` per chunk; training,
        ``(loss, metrics)`` per chunk from ``batch.objective``, which runs on the event
        ``loop`` (this is a worker thread) while the schedule waits. Other stages: ``[]``.
        """
        outputs: list[tuple] = []

        def packed(ids) -> bool:
            return self._packed([batch.tokens[i] for i in ids])

        def inputs(ids):
            return micro_batch_inputs([batch.tokens[i] for i in ids], [int(batch.response_lengths[i]) for i in ids],
                                      self.device, packed=packed(ids), sequence_parallel=sequence_parallel_size(net))

        def around(ids):
            return self._routing(net, batch, ids, grad, packed(ids))

        def finish(ids, micro, logits):
            lp, ent = response_log_probs(logits, micro, batch.temperature, vocab_size=self.shape.vocab_size,
                                         entropy_grad=self._entropy_grad(grad), chunk_rows=self._chunk_rows())
            if not grad:
                outputs.append((ids, lp, ent))
                return logits.new_zeros(())
            loss, metrics = asyncio.run_coroutine_threadsafe(batch.objective(ids, lp, ent), loop).result()
            outputs.append((loss.detach(), metrics))
            return loss

        run_schedule(net, chunks, inputs, finish, grad=grad, around=around)
        return outputs

    async def _forward_chunks(self, net, batch: TrainBatch, chunks: list[list[int]]) -> list[tuple]:
        if self.pp == 1:
            return await super()._forward_chunks(net, batch, chunks)
        outputs = await self._in_thread(self._pipeline, net, batch, chunks, False, asyncio.get_running_loop())
        await self._in_thread(self._merge_stage_routing)
        return outputs

    async def _train_step(self, batch: TrainBatch, micro_batches) -> tuple[dict, bool]:
        """With PP > 1: one pass of the pipeline schedule; the last stage's metric sums reach every stage
        (the loss's finiteness is checked with the gradients', on every rank, in :meth:`_clip`)."""
        if self.pp == 1:
            return await super()._train_step(batch, micro_batches)
        outputs = await self._in_thread(self._pipeline, self.model, batch, [list(mb) for mb in micro_batches], True,
                                        asyncio.get_running_loop())
        sums, finite_loss = await self._in_thread(sum_step_metrics, [loss for loss, _ in outputs],
                                                  [metrics for _, metrics in outputs])
        return await self._in_thread(broadcast_from_last_stage, sums), finite_loss

    def _is_embedding_copy(self, name: str) -> bool:
        """Whether parameter ``name`` is a tied model's last-stage copy of the embedding (PP > 1)."""
        return name == "output_layer.weight" and self.shape.tied and self.stage.last and not self.stage.first

    def _embedding_grads(self) -> list:
        """Gradients of this stage's embedding table and of its tied copy (the masters' under ``--bf16``, the float32
        buffers of megatron-core's distributed optimizer)."""
        weights = []
        if self.stage.first:
            weights.append(self.model.embedding.word_embeddings.weight)
        if self.shape.tied and self.stage.last and not self.stage.first:
            weights.append(self.model.output_layer.weight)
        grads = [w.main_grad if self._mcore() else (self.masters.master_of(w) if self.masters else w).grad
                 for w in weights if w.requires_grad]  # (frozen under LoRA; megatron-core's buffers: .main_grad)
        return [g for g in grads if g is not None]

    def _sum_embedding_copies(self) -> None:
        """A tied model at PP > 1: add the first stage's embedding gradient and the last stage's
        output-layer gradient (megatron-core's embedding group), so both copies take the same step."""
        if not (self.shape.tied and self.pp > 1):
            return
        import torch.distributed as dist
        from megatron.core import parallel_state

        for grad in self._embedding_grads():
            dist.all_reduce(grad, group=parallel_state.get_embedding_group())

