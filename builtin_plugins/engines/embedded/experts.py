"""Mixture-of-experts layers in the embedded engine: the experts kernel of each pass, and the routing record.

transformers 5 runs an MoE layer's experts through one of its ``experts_implementation``
kernels (``integrations/moe.py``). Their fitness for a captured decode step differs:

- ``eager`` loops over the experts that received tokens (``nonzero()``, a host sync per
  layer): not capturable in a CUDA graph.
- ``grouped_mm`` sorts the ``N * k`` (token, expert) pairs by expert, counts them with
  ``histc`` and runs one grouped GEMM whose group offsets stay on the device: fixed shapes,
  no host sync, every expert's weights read once. On CUDA only in bfloat16 on SM80+ (else
  transformers falls back to a loop with a host sync).
- ``batched_mm`` gathers each pair's expert weights and runs batched products: fixed shapes,
  no host sync, any dtype, but it copies ``N * k`` experts' weights (too much memory for a
  prefill of long prompts).

:func:`experts_kernels` picks one kernel for prefills and one for decode steps from the
device and dtype; :class:`SlotExperts` installs an experts implementation (``furlong_slots``)
that runs the pass's kernel and, when routing is recorded, first writes each token's
``top_k_index`` into the :class:`~.slots.SlotCache` at the token's slot and column (on the
device, inside the captured step).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable

from furlong.kit.moe import RoutingLayout, experts_modules, routing_layout

__all__ = ["EXPERTS_NAME", "SlotExperts", "experts_kernels"]

EXPERTS_NAME = "furlong_slots"
KERNELS = ("eager", "grouped_mm", "batched_mm")


def experts_kernels(device_type: str, dtype, capability: tuple[int, int] | None = None) -> tuple[str, str]:
    """The transformers experts kernels ``(prefill, decode)`` for a model on ``device_type`` in ``dtype``.

    CUDA, bfloat16, compute capability 8.0 or higher: ``grouped_mm`` for both. Other CUDA
    dtypes or older GPUs: ``eager`` prefills (each expert's weights read once) and
    ``batched_mm`` decode steps (capturable). Other devices (no graphs): ``grouped_mm``.

    :param capability: the CUDA device's compute capability (ignored elsewhere).
    """
    import torch

    if device_type != "cuda":
        return "grouped_mm", "grouped_mm"
    if dtype == torch.bfloat16 and capability is not None and tuple(capability) >= (8, 0):
        return "grouped_mm", "grouped_mm"
    return "eager", "batched_mm"


class SlotExperts:
    """The MoE layers of one model, switched to the ``furlong_slots`` experts implementation.

    ``step``: the :class:`~.slots.SlotPass` of the forward pass running (set by :meth:`passing`),
    ``decoding`` whether it is a decode step. With ``record``, every pass with a step writes the
    experts each fed token was routed to into ``step.cache.routes`` (one buffer per MoE layer).

    :param prefill: and :param decode: kernel names (:data:`KERNELS`).
    :raises ValueError: ``model`` has no MoE layer, or a kernel name is unknown.
    """

    def __init__(self, model, prefill: str, decode: str, record: bool) -> None:
        import torch

        found = experts_modules(model)
        if not found:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts layer")
        unknown = {prefill, decode} - set(KERNELS)
        if unknown:
            raise ValueError(f"unknown experts kernel {sorted(unknown)[0]!r}; choose from {', '.join(KERNELS)}")
        self.layout: RoutingLayout = routing_layout(model)
        # the routing buffers' dtype: int16 when every expert id fits
        self.route_dtype = torch.int16 if max(m.num_experts for _, m in found) <= 2**15 else torch.int32
        self.kernels = (prefill, decode)
        self._prefill, self._decode = _kernel(prefill), _kernel(decode)
        self.record = record
        self.step = None
        self.decoding = False
        for index, (_, module) in enumerate(found):
            module.furlong_slots = (self, index)
        _register()
        try:
            model.set_experts_implementation(EXPERTS_NAME)
        except (AttributeError, ValueError):
            model.config._experts_implementation = EXPERTS_NAME

    @contextmanager
    def passing(self, step):
        """Run a forward pass of ``step`` (a :class:`~.slots.SlotPass`) inside this block."""
        self.step, self.decoding = step, step.causal is None
        try:
            yield
        finally:
            self.step, self.decoding = None, False

    def write(self, index: int, top_k_index) -> None:
        """Write ``top_k_index`` ``[rows * columns, k]`` into MoE layer ``index``'s routing buffer at the
        step's slots and columns (the scratch column for prefill padding)."""
        step = self.step
        if step is None:
            return
        columns = step.columns
        buffer = step.cache.routes[index]
        buffer[step.rows[:, None], 0, columns] = top_k_index.view(*columns.shape, -1).to(buffer.dtype)


def slot_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """The ``furlong_slots`` experts implementation: record the routing (when asked), then run the pass's kernel."""
    experts, index = module.furlong_slots
    if experts.record:
        _writer()(experts, index, top_k_index)
    kernel = experts._decode if experts.decoding else experts._prefill
    return kernel(module, hidden_states, top_k_index, top_k_weights)


def _kernel(name: str) -> Callable:
    """The experts function of transformers' kernel ``name`` (``eager``: the experts class's own forward)."""
    if name == "eager":
        return lambda module, *args: type(module).forward.__wrapped__(module, *args)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS[name]


@functools.cache
def _writer() -> Callable:
    """:meth:`SlotExperts.write`, never traced by torch.compile (it reads the pass's slots, which change)."""
    import torch

    return torch.compiler.disable(SlotExperts.write)


@functools.cache
def _register() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_NAME, slot_experts_forward)
