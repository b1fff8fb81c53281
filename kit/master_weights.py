"""Float32 master weights for a bfloat16 model (``--bf16``), as Megatron-LM trains.

The model's parameters are bfloat16, so the forward and backward passes run in bfloat16
end to end (no autocast casts, no float32 residual stream). Each parameter has a float32
master copy that the optimizer updates; each micro-batch's bfloat16 gradient is added into
the master's float32 gradient as soon as autograd has accumulated it (a post-accumulate
hook, after which the bfloat16 gradient is freed), so gradients accumulate across
micro-batches in float32. After each optimizer step the masters are rounded into the
model. This is the arrangement of Megatron-LM's ``Float16OptimizerWithFloat16Params``
with ``--accumulate-allreduce-grads-in-fp32`` (Micikevicius et al., "Mixed Precision
Training", 2018), written on plain torch so that it also runs on CPU. The ``megatron`` and
``fsdp`` train backends use it; a third-party backend may.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

__all__ = ["MasterWeights"]


class MasterWeights:
    """Float32 masters of the trainable parameters of ``model`` (any dtype; bfloat16 in use).

    :param model: a module whose trainable parameters get masters; its bfloat16 gradients
        never outlive a backward pass (they are folded into the masters' ``.grad``).
    :param masters: existing float32 parameters to serve as the masters, by ``model``'s
        parameter names (e.g. those of the float32 model ``model`` was copied from, which the
        optimizer and checkpoints then keep using); default: new float32 copies.
    :raises KeyError: ``masters`` lacks a trainable parameter's name.
    """

    def __init__(self, model, masters: Mapping[str, Any] | None = None) -> None:
        import torch

        self.model = model
        self.names: list[str] = []
        self.params: list = []
        self.masters: list = []
        self._master_of: dict[int, Any] = {}
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            if masters is None:
                master = torch.nn.Parameter(param.detach().to(torch.float32, copy=True))
            else:
                master = masters[name]
            self.names.append(name)
            self.params.append(param)
            self.masters.append(master)
            self._master_of[id(param)] = master
            param.register_post_accumulate_grad_hook(self._fold)

    def _fold(self, param) -> None:
        master = self._master_of[id(param)]
        if master.grad is None:
            master.grad = param.grad.to(master.dtype)
        else:
            master.grad.add_(param.grad)
        param.grad = None

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        """``(model parameter name, float32 master)`` pairs: what the optimizer updates."""
        return zip(self.names, self.masters)

    def master_of(self, param):
        """The master of a model parameter (the parameter itself when it has none)."""
        return self._master_of.get(id(param), param)

    def copy_to_model(self) -> None:
        """Round every master into its model parameter (after an optimizer step or a load)."""
        import torch

        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)

    def to(self, device) -> None:
        """Move the masters (and their gradients) to ``device`` in place (offloading to host memory)."""
        for master in self.masters:
            master.data = master.data.to(device)
            if master.grad is not None:
                master.grad = master.grad.to(device)
