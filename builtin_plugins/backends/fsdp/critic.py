"""The fsdp backend's critic: a value model trained beside the actor (``--advantage-estimator ppo``)."""

from __future__ import annotations

import logging

from furlong.hooks import RunConfig, TrainBatch
from furlong.kit.critic import CriticLoop, critic_config

from .backend import FSDPBackend
from .value_model import forward_values, load_value_model

__all__ = ["FSDPCritic", "critic_config"]

log = logging.getLogger("furlong.backends.fsdp")


class FSDPCritic(CriticLoop, FSDPBackend):
    """A :class:`furlong.hooks.CriticBackend`: the fsdp backend over a value model
    (:mod:`.value_model`), with its own optimizer and learning-rate schedule (:func:`critic_config`).

    Precision, FSDP2 sharding, checkpoints (the layout of :mod:`.checkpoint`, ``model/`` a Hugging
    Face directory with the value head) and offloading are the actor's.
    """

    name = "fsdp critic"

    def __init__(self, config: RunConfig) -> None:
        super().__init__(critic_config(config))

    async def init(self, config: RunConfig) -> int:
        """Load the value model (see :func:`~.value_model.load_value_model`), build its optimizer and schedule."""
        return await super().init(critic_config(config))

    def _load_models(self, config: RunConfig) -> None:
        model, source = load_value_model(config, self.device)
        self.model = self._place(model, trainable=True)
        self.compute_model, self.masters = self._bf16_copy()
        self._compile(self.compute_model, trainable=True)
        if self.rank == 0:
            log.info("fsdp critic: the policy's decoder and a value head, from %s", source)

    def _forward(self, model, batch: TrainBatch, ids: list[int], grad: bool):
        values = forward_values(self.compute_model, [batch.tokens[i] for i in ids],
                                [int(batch.response_lengths[i]) for i in ids], self.device, grad=grad)
        return values, [None] * len(values)
