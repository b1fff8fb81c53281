"""The fsdp backend's critic: a value model trained beside the actor (``--advantage-estimator ppo``)."""

from __future__ import annotations

import logging

from furlong.hooks import RunConfig, TrainBatch

from .backend import FSDPBackend
from .value_model import forward_values, load_value_model

__all__ = ["FSDPCritic", "critic_config"]

log = logging.getLogger("furlong.backends.fsdp")


def critic_config(config: RunConfig) -> RunConfig:
    """The run's configuration as the critic trains with it: ``--critic-lr`` (default ``--lr``) and
    ``--critic-lr-warmup-iters`` (in place of ``--lr-warmup-iters`` and ``--lr-warmup-fraction``);
    no reference model, entropy term or LoRA (the whole value model trains). Every other optimizer
    and schedule flag is the actor's."""
    return config.replace(lr=config.critic_lr if config.critic_lr is not None else config.lr,
                          lr_warmup_iters=config.critic_lr_warmup_iters, lr_warmup_fraction=None,
                          use_kl_loss=False, kl_coef=0.0, entropy_coef=0.0, lora_rank=0)


class FSDPCritic(FSDPBackend):
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

    async def _objective(self, batch: TrainBatch, ids: list[int], outputs: tuple):
        return await batch.objective(ids, None, None, values=outputs[0])

    async def values(self, batch: TrainBatch) -> dict:
        """Forward-only values of every response token: ``{"values": [...]}``, N float32 ``[T_i]`` on the
        host, micro-batched as :meth:`log_probs` (samples of other ranks None)."""
        import torch

        n = len(batch.tokens)
        chunks = [list(mb) for step in batch.steps for mb in step]
        values: list = [None] * n
        for ids, rows, _ in await self._forward_chunks(self.model, batch, chunks):
            for i, row in zip(ids, rows):
                values[i] = row.detach().to("cpu", torch.float32)
        return {"values": values}

    def train_forward_gives_old_log_probs(self) -> bool:
        return False
