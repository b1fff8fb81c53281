"""Float32 master weights of a bfloat16 megatron-core model (``--bf16``): the generic
:class:`furlong.kit.master_weights.MasterWeights`, plus the masters' place in megatron-core's
sharded state dicts (checkpoints hold the masters, the same files as a float32 model's)."""

from __future__ import annotations

from furlong.kit.master_weights import MasterWeights as _MasterWeights

__all__ = ["MasterWeights"]


class MasterWeights(_MasterWeights):
    """:class:`furlong.kit.master_weights.MasterWeights` that megatron-core checkpoints can save and load."""

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
