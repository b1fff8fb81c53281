"""Float32 master weights for a bfloat16 model (``--bf16``), as Megatron-LM trains.

The model's parameters are bfloat16, so the forward and backward passes run in bfloat16
end to end (no autocast casts, no float32 residual stream). Each parameter has a float32
master copy that the optimizer updates; each micro-batch's bfloat16 gradient is added into
the master's float32 gradient as soon as autograd has accumulated it (a post-accumulate
hook, after which the bfloat16 gradient is freed), so gradients accumulate across
micro-batches in float32. After each optimizer step the masters are rounded into the
model. This is the arrangement of Megatron-LM's ``Float16OptimizerWithFloat16Params``
with ``--accumulate-allreduce-grads-in-fp32`` (Micikevicius et al., "Mixed Precision
Training", 2018), written on plain torch so that it also runs on CPU.
"""

from __future__ import annotations

from typing import Any, Iterator

__all__ = ["MasterWeights"]


class MasterWeights:
    """Float32 masters of the trainable parameters of ``model`` (any dtype; bfloat16 in use).

    :param model: a module whose trainable parameters get masters; its bfloat16 gradients
        never outlive a backward pass (they are folded into the masters' ``.grad``).
    """

    def __init__(self, model) -> None:
        import torch

        self.model = model
        self.names: list[str] = []
        self.params: list = []
        self.masters: list = []
        self._master_of: dict[int, Any] = {}
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            master = torch.nn.Parameter(param.detach().to(torch.float32, copy=True))
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

    def sharded_state_dict(self, model_sharded: dict) -> dict:
        """``model_sharded`` (the model's megatron-core sharded state dict) with each parameter's
        data replaced by its float32 master, so a checkpoint holds the masters (the same files
        as a float32 model's) and a load fills them."""
        from dataclasses import replace

        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        def swap(value):
            if isinstance(value, dict):
                return {k: swap(v) for k, v in value.items()}
            if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and id(value.data) in self._master_of:
                master = self._master_of[id(value.data)]
                fields = {"dtype": master.dtype} if isinstance(value, ShardedTensor) else {}
                return replace(value, data=master, **fields)
            return value

        return swap(model_sharded)

    def load_loaded(self, loaded_model: dict) -> None:
        """Copy a loaded model state (state-dict key -> float32 tensor) into the masters, then into the model.

        :raises KeyError: a trainable parameter missing from ``loaded_model``.
        """
        import torch

        by_key = {id(p): key for key, p in self.model.state_dict(keep_vars=True).items()}
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                key = by_key[id(param)]
                if master.data_ptr() != loaded_model[key].data_ptr():
                    master.copy_(loaded_model[key])
        self.copy_to_model()
