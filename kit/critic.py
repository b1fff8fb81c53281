"""What every train backend's critic (a :class:`furlong.hooks.CriticBackend`, ``--advantage-estimator ppo``)
does the same way: its configuration, its value passes and its objective over :class:`~.trainer.StepLoop`.

A backend's critic subclasses :class:`CriticLoop` before the backend itself
(``class MyCritic(CriticLoop, MyBackend)``) and makes its ``_forward`` return the values of the
micro-batch's samples, ``(values, [None] * B)``. The value loss itself is the ``value_loss`` plugin's
(the core builds the objective); nothing here computes it.
"""

from __future__ import annotations

from furlong.hooks.run_config import RunConfig
from furlong.hooks.types import TrainBatch

__all__ = ["HEAD_PREFIX", "CriticLoop", "critic_config"]

HEAD_PREFIX = "value_head."
"""Names of the value head's tensors in a critic saved as a Hugging Face directory (``value_head.weight``
``[1, hidden]``, ``value_head.bias`` ``[1]``), beside the decoder's ``model.*``: the fsdp critic's
``model/`` folder; ``--critic-load`` takes such a folder on every backend."""


def critic_config(config: RunConfig) -> RunConfig:
    """The run's configuration as the critic trains with it: ``--critic-lr`` (default ``--lr``) and
    ``--critic-lr-warmup-iters`` (in place of ``--lr-warmup-iters`` and ``--lr-warmup-fraction``);
    no reference model, entropy term or LoRA (the whole value model trains). Every other optimizer
    and schedule flag is the actor's."""
    return config.replace(lr=config.critic_lr if config.critic_lr is not None else config.lr,
                          lr_warmup_iters=config.critic_lr_warmup_iters, lr_warmup_fraction=None,
                          use_kl_loss=False, kl_coef=0.0, entropy_coef=0.0, lora_rank=0)


class CriticLoop:
    """The :class:`furlong.hooks.CriticBackend` members a :class:`~.trainer.StepLoop` backend shares:
    forward-only :meth:`values`, the objective called with values, no pi_old from the training forward."""

    async def _objective(self, batch: TrainBatch, ids: list[int], outputs: tuple):
        return await batch.objective(ids, None, None, values=outputs[0])

    async def values(self, batch: TrainBatch) -> dict:
        """Forward-only values of every response token: ``{"values": [...]}``, N float32 ``[T_i]`` on the
        host, micro-batched as :meth:`~.trainer.StepLoop.log_probs` (samples of other ranks None)."""
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
