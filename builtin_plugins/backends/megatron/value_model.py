"""The megatron critic's model: the policy's GPTModel with a scalar value head in place of its output layer.

``V = w . h + b`` on the decoder's output ``h`` (after the final norm, as the fsdp critic's
``last_hidden_state``), ``w`` ``[1, hidden]`` and ``b`` ``[1]``, starting at zero (every value starts
at 0, as the fsdp critic's fresh head), or from the ``value_head.*`` tensors of a critic saved as a
Hugging Face directory (:data:`furlong.kit.critic.HEAD_PREFIX`). The model is built as a tied one
(no output-layer weight of its own, no ``lm_head`` read), and the head is put where megatron-core's
``GPTModel`` calls its output layer, so the forward returns values ``[b, s, 1]`` where the policy
returns logits. Every tensor-parallel rank holds the whole head and computes every value; under
sequence parallelism the head first gathers the sequence.

In ``torch_dist`` checkpoints the head's tensors are ``value_head.weight`` and ``value_head.bias``
(replicated), beside the decoder's megatron-core keys.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Sequence

from furlong.kit.critic import HEAD_PREFIX

__all__ = ["attach_value_head", "forward_values", "split_value_head", "value_head_class"]


@functools.cache
def value_head_class():
    """The ``ValueHead`` module class (built on first use: importing the plugin does not import torch)."""
    import torch

    class ValueHead(torch.nn.Module):
        """``weight`` ``[1, hidden]`` and ``bias`` ``[1]``; called as megatron-core's output layer
        (``head(hidden, weight=..., runtime_gather_output=...)``, the tied weight it is handed ignored):
        ``hidden`` ``[s, b, h]`` (``[s / tp, b, h]`` under sequence parallelism) gives float32
        ``([s, b, 1], None)``."""

        def __init__(self, hidden: int, dtype, device, sequence_parallel: bool) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype, device=device))
            self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
            self.sequence_parallel = sequence_parallel

        def forward(self, hidden, weight=None, runtime_gather_output=None):
            if self.sequence_parallel:
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

                # every TP rank computes the whole loss from the gathered sequence: its backward keeps
                # each rank's own chunk of the gradient (summing it over the ranks would count it TP times)
                hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
            return torch.nn.functional.linear(hidden, self.weight, self.bias).float(), None

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            """Both tensors replicated over every rank, under the keys ``value_head.weight`` / ``.bias``."""
            from megatron.core.utils import make_sharded_tensor_for_checkpoint

            return {f"{prefix}{name}": make_sharded_tensor_for_checkpoint(param, f"{HEAD_PREFIX}{name}")
                    for name, param in (("weight", self.weight), ("bias", self.bias))}

    return ValueHead


def split_value_head(named_tensors: Iterable[tuple[str, Any]], head: dict) -> Iterable[tuple[str, Any]]:
    """``named_tensors`` (a Hugging Face safetensors stream) without the value head's tensors, which go
    into ``head`` (``{"weight": ..., "bias": ...}``) as they pass."""
    for name, tensor in named_tensors:
        if name.startswith(HEAD_PREFIX):
            head[name[len(HEAD_PREFIX):]] = tensor
        else:
            yield name, tensor


def attach_value_head(model, head: dict | None = None) -> None:
    """Put a value head (:func:`value_head_class`) in place of ``model``'s output layer.

    :param model: a GPTModel built tied (:func:`~.model.build_gpt` with ``shape.tied``), one pipeline stage.
    :param head: ``{"weight": [1, hidden], "bias": [1]}`` to start from (a saved critic's), else zeros.
    :raises ValueError: ``head`` of another shape.
    """
    import torch

    embedding = model.embedding.word_embeddings.weight
    module = value_head_class()(int(model.config.hidden_size), embedding.dtype, embedding.device,
                                bool(model.config.sequence_parallel))
    if head:
        with torch.no_grad():
            for name, param in (("weight", module.weight), ("bias", module.bias)):
                if name not in head or tuple(head[name].shape) != tuple(param.shape):
                    raise ValueError(f"value head {name}: expected shape {tuple(param.shape)}, got "
                                     f"{tuple(head[name].shape) if name in head else 'none'}")
                param.copy_(head[name])
    model.output_layer = module


def forward_values(model, tokens: Sequence[Any], response_lengths: Sequence[int], device, *, grad: bool,
                   packed: bool = False) -> list:
    """Per-sample values of the response tokens: ``V_t`` read at the position that predicts token ``t``
    (the positions :func:`~.logprobs.forward_log_probs` reads log-probs at), from one forward of the
    micro-batch, right-padded or packed (``thd``) as there.

    Without sequence parallelism only those positions reach the head (:func:`~.logprobs.projecting_rows`).

    :param model: a GPTModel with a value head (:func:`attach_value_head`).
    :param tokens: B sequences of prompt + response ids; :param response_lengths: B ``T_i``.
    :returns: B float32 tensors ``[T_i]``.
    :raises ValueError: a response that starts at position 0 (no previous token).
    """
    import torch

    from .logprobs import micro_batch_inputs, projecting_rows, sequence_parallel_size

    inputs = micro_batch_inputs(tokens, response_lengths, device, packed=packed,
                                sequence_parallel=sequence_parallel_size(model))
    with torch.set_grad_enabled(grad), projecting_rows(model, inputs.head_rows):
        values = model(input_ids=inputs.ids, position_ids=None, attention_mask=None, **inputs.extra)[..., 0]
    if inputs.head_rows is not None:  # [1, N]: the responses one after another
        flat = values[0]
        return [flat[a:b] for _, a, b in inputs.spans]
    return [values[row, a:b] for row, a, b in inputs.spans]
