"""Micro-batches through megatron-core's pipeline schedule (``--pipeline-model-parallel-size`` > 1).

Every stage of a data-parallel rank runs the same micro-batches in the same order:
megatron-core's non-interleaved 1F1B schedule (``get_forward_backward_func``) sends each
micro-batch's activations ``[s, b, h]`` to the next stage and their gradients back. The
last stage turns the logits into response log-probs and entropy (:mod:`.logprobs`) and,
when training, into the loss of the core's objective, which the schedule back-propagates
unscaled (the model's config sets ``calculate_per_token_loss``; the objective already
carries the step's denominators, SPEC.md 6.3).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["broadcast_from_last_stage", "run_schedule"]


def run_schedule(model, chunks: list[list[int]], inputs: Callable, finish: Callable, *, grad: bool) -> None:
    """Run every micro-batch of ``chunks`` through the pipeline (a collective over the stages).

    :param chunks: sample ids per micro-batch, the same on every stage.
    :param inputs: ``ids -> MicroBatchInputs`` (:func:`~.logprobs.micro_batch_inputs`), on every stage.
    :param finish: ``(ids, inputs, logits) -> loss`` on the last stage: a scalar tensor that
        the schedule back-propagates when ``grad`` (its value is not used otherwise).
    :param grad: train (forward and backward, gradients accumulate) or forward only.
    """
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, stage_model):
        ids = next(data_iterator)
        batch = inputs(ids)
        output = stage_model(input_ids=batch.ids, position_ids=None, attention_mask=None, **batch.extra)

        def loss_func(logits):
            return finish(ids, batch, logits), torch.ones((), dtype=torch.int), {}

        return output, loss_func

    with torch.set_grad_enabled(grad):
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(chunks), model=[model],
                                    num_microbatches=len(chunks), seq_length=1, micro_batch_size=1,
                                    forward_only=not grad)


def broadcast_from_last_stage(value: Any) -> Any:
    """``value`` of the last pipeline stage (picklable), on every stage of this pipeline (a collective)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, dist.get_world_size(group) - 1), group=group)
    return box[0]
