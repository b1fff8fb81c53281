"""The megatron backend's critic: a value model trained beside the actor (``--advantage-estimator ppo``)."""

from __future__ import annotations

import logging

import attrs

from furlong.hooks import PluginError, RunConfig, TrainBatch
from furlong.kit.critic import CriticLoop, critic_config
from furlong.kit.hf import is_hf_dir

from .backend import MegatronBackend
from .convert import load_hf, safetensors_stream
from .value_model import attach_value_head, forward_values, split_value_head

__all__ = ["MegatronCritic"]

log = logging.getLogger("furlong.backends.megatron")


class MegatronCritic(CriticLoop, MegatronBackend):
    """A :class:`furlong.hooks.CriticBackend`: the megatron backend over the policy's GPTModel with a value
    head (:mod:`.value_model`), with its own optimizer and learning-rate schedule
    (:func:`furlong.kit.critic.critic_config`).

    Precision (``--bf16`` over float32 masters), tensor and data parallelism, ``torch_dist`` checkpoints
    (:mod:`.checkpoint`; the head under ``value_head.*``) and offloading are the actor's. Pipeline and
    context parallelism and mixture-of-experts models are not supported yet for the critic.
    """

    name = "megatron critic"

    def __init__(self, config: RunConfig) -> None:
        unsupported = [f"{flag} {size}" for flag, size in (
            ("--pipeline-model-parallel-size", config.pipeline_model_parallel_size),
            ("--context-parallel-size", config.context_parallel_size)) if int(size or 1) > 1]
        if unsupported:
            raise PluginError(f"{', '.join(unsupported)} with --advantage-estimator ppo is not supported yet by "
                              "--train-backend megatron (its critic runs with tensor and data parallelism only); "
                              "use --train-backend fsdp, or leave them at 1.")
        super().__init__(critic_config(config))

    async def init(self, config: RunConfig) -> int:
        """Build the value model, load its weights (``--critic-load`` when it is a Hugging Face directory,
        else the actor's starting weights with a fresh head), build its optimizer and schedule; return 0.

        :raises PluginError: a mixture-of-experts model, or weights that do not load.
        """
        return await super().init(critic_config(config))

    def _built_shape(self, shape):
        if shape.is_moe:
            raise PluginError(f"--hf-checkpoint {self.config.hf_checkpoint}: a critic for a mixture-of-experts model "
                              "is not supported yet by --train-backend megatron; use --train-backend fsdp.")
        return attrs.evolve(shape, tied=True)  # no output layer of its own: the value head takes its place

    def _load_model(self):
        source = self.config.critic_load
        head: dict = {}
        if is_hf_dir(source):
            model = self._build_model()
            load_hf(model, split_value_head(safetensors_stream(source), head), self.shape, self.vocab_rows, self.tp,
                    self._tp_rank(), f"--critic-load {source}", self.stage, self.experts)
            where = f"--critic-load {source}" + (" (with its value head)" if head else " with a fresh value head")
        else:
            model = super()._load_model()
            start = self.config.ref_load or self.config.hf_checkpoint
            where = f"the actor's starting weights ({start}) with a fresh value head"
        try:
            attach_value_head(model, head)
        except ValueError as exc:
            raise PluginError(f"--critic-load {source}: {exc}.") from exc
        if self.rank == 0:
            log.info("megatron critic: the policy's GPTModel with a value head, from %s", where)
        return model.eval()

    def _own_adamw_reason(self, config) -> str | None:
        return super()._own_adamw_reason(config) or (
            "megatron-core's distributed optimizer for the PPO critic is not supported yet")

    def _masters_from_checkpoint(self, skip: tuple[str, ...] = ()) -> None:
        if not is_hf_dir(self.config.critic_load):
            super()._masters_from_checkpoint(skip=("output_layer.",))  # an actor's checkpoint has no value head

    def _forward(self, model, batch: TrainBatch, ids: list[int], grad: bool):
        tokens = [batch.tokens[i] for i in ids]
        values = forward_values(model, tokens, [int(batch.response_lengths[i]) for i in ids], self.device, grad=grad,
                                packed=self._packed(tokens))
        return values, [None] * len(values)
