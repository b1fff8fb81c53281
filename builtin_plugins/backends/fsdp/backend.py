"""The fsdp train backend: a transformers causal LM trained with torch, FSDP2 across ranks."""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from furlong.hooks import ParallelLayout, PluginError, RunConfig, TrainBatch
from furlong.kit.fp8 import fp8_quantization_config
from furlong.kit.hf import compile_decoder_layers, is_hf_dir
from furlong.kit.master_weights import MasterWeights
from furlong.kit.resume import load_parts
from furlong.kit.trainer import StepLoop

from . import checkpoint, lora
from .logprobs import forward_log_probs
from .model import build_optimizer, dist_info, load_causal_lm, shard, tied_names
from .schedule import LRSchedule

__all__ = ["FSDPBackend"]

log = logging.getLogger("furlong.backends.fsdp")


class FSDPBackend(StepLoop):
    """A :class:`furlong.hooks.TrainBackend` over a Hugging Face model (see PLUGINS.md, "Built-in plugins").

    Single process: plain torch, float32, or with ``--bf16`` bfloat16 parameters over float32
    master weights (:class:`furlong.kit.master_weights.MasterWeights`: a bfloat16 copy of
    the model runs every pass, the float32 model is what the optimizer updates, checkpoints
    hold and the engines receive); ``--bf16 --no-keep-fp32-master``: bfloat16 parameters alone,
    updated by the optimizer in place (half the weight memory, rounding at every step). With ``torch.distributed`` initialized over several ranks: FSDP2
    ``fully_shard`` per decoder layer and on the whole model, gradients SUMMED over ranks.
    The model stays in eval mode (no dropout) so training log-probs equal the old
    log-probs bit for bit at the first step; with ``--gradient-checkpointing`` it runs in
    train mode, which needs a dropout-free config.
    """

    name = "fsdp"

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.model = None
        self.compute_model = None  # the model the passes run: self.model, or its bfloat16 copy under --bf16
        self.masters: MasterWeights | None = None
        self.ref_model = None
        self.old_actor = self.rollout_actor = None  # --keep-old-actor: copies of the synced weights
        self.optimizer = None
        self.schedule: LRSchedule | None = None
        self.tokenizer = None
        self.global_step = 0
        self.world, self.rank = 1, 0
        self.device = None
        self._tied: set[str] = set()

    # --- set-up -------------------------------------------------------------------------

    async def init(self, config: RunConfig) -> int:
        """Load actor (and reference), build optimizer and LR schedule; return 0.

        Warm start: actor weights from ``--ref-load`` when it is a Hugging
        Face directory, else ``--hf-checkpoint``. The reference (``--use-kl-loss`` or
        ``--kl-coef`` != 0) loads from the same place and never trains. Resume is the
        core's job: it calls :meth:`load` and decides the start rollout id.

        :raises PluginError: an unloadable checkpoint or bad optimizer flags.
        """
        import torch
        from transformers import AutoTokenizer

        self.config = config
        self.world, self.rank = dist_info(config)
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", 0))
            if local >= torch.cuda.device_count():  # e.g. one visible GPU per Ray actor
                local = torch.cuda.current_device()
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        if self.world > 1 and self.device.type == "cpu" and config.bf16:
            raise PluginError(f"--bf16 with {self.world} FSDP2 ranks on CPU is not supported yet (FSDP2's mixed "
                              "precision runs on GPUs); leave it out to train in float32, or use one process.")
        self._load_models(config)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(config.hf_checkpoint)
        except (OSError, ValueError):
            log.warning("fsdp: no tokenizer in %s; checkpoints will hold weights and config only", config.hf_checkpoint)
        self.optimizer = build_optimizer(self.model, config)
        self.schedule = LRSchedule.from_config(config)
        if self.rank == 0:
            log.info("fsdp: %s", self._precision())
            log.info("fsdp optimizer: %s, weight decay %s, clip %s, schedule %s", type(self.optimizer).__name__,
                     config.weight_decay, config.clip_grad, self.schedule)
        return 0

    def _load_models(self, config: RunConfig) -> None:
        """The actor (and its bfloat16 copy) and the reference, placed on this rank."""
        source, flag = (config.ref_load, "--ref-load") if is_hf_dir(config.ref_load) else (
            config.hf_checkpoint, "--hf-checkpoint")
        if config.ref_load and source != config.ref_load:
            self._skip_torch_dist_ref_load(config)
        model = lora.apply_lora(load_causal_lm(source, config, self.device, flag), config)
        if config.bf16 and not config.keep_fp32_master:  # bfloat16 parameters are what the optimizer updates
            _bf16_parameters(model)
        self.model = self._place(model, trainable=True)
        self.compute_model, self.masters = self._bf16_copy()
        self._compile(self.compute_model, trainable=True)
        if config.use_kl_loss or config.kl_coef:
            self.ref_model = self._frozen_copy(source, config, flag)
        if config.keep_old_actor:
            self.old_actor = self._frozen_copy(source, config, flag)
            self.rollout_actor = self._frozen_copy(source, config, flag)

    def _skip_torch_dist_ref_load(self, config: RunConfig) -> None:
        """A ``torch_dist`` ``--ref-load`` (a megatron checkpoint, as Miles' scripts give) is not read here: the
        trainer starts from ``--hf-checkpoint``, said once, unless that is an FP8 checkpoint, whose rounded weights
        the trainer must not train (docs/fp8.md).

        :raises PluginError: ``--hf-checkpoint`` is an FP8 checkpoint.
        """
        if fp8_quantization_config(config.hf_checkpoint) is not None:
            raise PluginError(f"--ref-load {config.ref_load} is a torch_dist checkpoint, which --train-backend fsdp "
                              f"does not read, and --hf-checkpoint {config.hf_checkpoint} is an FP8 checkpoint: the "
                              "trainer would train the FP8-rounded weights. Give the BF16 model's Hugging Face "
                              "directory as --ref-load, or use --train-backend megatron.")
        if self.rank == 0:
            log.info("fsdp: --ref-load %s is a torch_dist checkpoint, which this backend does not read: the trainer "
                     "starts from --hf-checkpoint %s", config.ref_load, config.hf_checkpoint)

    def _frozen_copy(self, source: str, config: RunConfig, flag: str):
        """A model that never trains (the reference, the old actor), bfloat16 alone under ``--bf16`` like the
        model's passes, placed and compiled as the actor."""
        model = load_causal_lm(source, config, self.device, flag).requires_grad_(False)
        model = self._place(model, trainable=False)
        if config.bf16 and self.world == 1:  # (across ranks FSDP2 computes in bfloat16 over float32 shards)
            _bf16_parameters(model)
        self._compile(model, trainable=False)
        return model

    def _place(self, model, *, trainable: bool):
        if not trainable or not self.config.gradient_checkpointing:
            model.eval()
        if trainable:
            self._tied = tied_names(model)
        if self.world > 1:
            shard(model, self.config, self.world, self.device, trainable=trainable)
            return model
        return model.to(self.device)

    def _precision(self) -> str:
        if self.config.bf16 and not self.config.keep_fp32_master:
            return "bf16 parameters, no fp32 master weights (--no-keep-fp32-master)"
        if self.masters is not None:
            return "bf16 parameters, fp32 master weights"
        if self.world > 1 and self.config.bf16:
            return "FSDP2 bf16 compute over fp32 shards, fp32 gradient reduction"
        return "fp32"

    def _bf16_copy(self):
        """``--bf16`` in one process: ``(bfloat16 copy of the model, MasterWeights)``; the copy runs every pass
        and the float32 model holds the masters (the optimizer, checkpoints and weight sync read it).
        Otherwise ``(the model, None)``: float32, or FSDP2's bfloat16 compute over float32 shards."""
        import copy

        if self.world > 1 or not self.config.bf16 or not self.config.keep_fp32_master:
            return self.model, None
        compute = _bf16_parameters(copy.deepcopy(self.model))
        return compute, MasterWeights(compute, masters=dict(self.model.named_parameters()))

    def _compile(self, model, *, trainable: bool) -> None:
        if not self.config.train_torch_compile:
            return
        # dynamic: every micro-batch has another length; compiled once, not once per length
        layers = compile_decoder_layers(model, "--train-torch-compile", dynamic=True)
        if self.rank == 0 and trainable:
            log.info("fsdp: --train-torch-compile: %d decoder layers compiled (torch.compile, inductor) at their "
                     "first pass", layers)

    def _modules(self) -> list:
        return [m for m in (self.model, self.compute_model, self.ref_model, self.old_actor, self.rollout_actor)
                if m is not None]

    # --- forward passes -----------------------------------------------------------------

    def _forward(self, model, batch: TrainBatch, ids: list[int], grad: bool):
        if model is self.model:
            model = self.compute_model  # the bfloat16 copy under --bf16 (its gradients reach the masters)
            if lora.enabled(self.config):
                lora.set_dropout(model, active=grad)
        return forward_log_probs(
            model, [batch.tokens[i] for i in ids], [int(batch.response_lengths[i]) for i in ids], batch.temperature,
            self.device, grad=grad, entropy_grad=self._entropy_grad(grad),
            chunk_size=int(self.config.log_probs_chunk_size or -1),
        )

    def _shares_prompts(self) -> bool:
        """True where a micro-batch's samples that share a prompt run it once: packed micro-batches (a GPU under
        ``--bf16``), or right-padded ones whose model takes the masked layouts (:mod:`.shared_prompts`)."""
        from . import packing, shared_prompts

        model = self.compute_model
        return packing.packs(model) or shared_prompts.sharing_off_reason(model, shared_prompts.ROWS) is None

    def train_forward_gives_old_log_probs(self) -> bool:
        """False when the training forward drops anything the log-prob pass keeps: LoRA dropout, or a
        dropout of the model's config under ``--gradient-checkpointing`` (which trains in train mode)."""
        import torch

        if lora.enabled(self.config) and float(self.config.lora_dropout or 0.0) > 0:
            return False
        if not self.config.gradient_checkpointing:
            return True
        config = getattr(self.model, "config", None)
        rates = [v for k, v in (config.to_dict() if config is not None else {}).items()
                 if "dropout" in k and isinstance(v, (int, float)) and not isinstance(v, bool)]
        rates += [m.p for m in self.model.modules() if isinstance(m, torch.nn.Dropout)]
        return not any(rate > 0 for rate in rates)

    # --- training -----------------------------------------------------------------------

    def _before_train(self) -> None:
        if self.config.gradient_checkpointing:
            self.compute_model.train()

    def _after_train(self) -> None:
        if self.config.gradient_checkpointing:
            self.compute_model.eval()

    def _learning_rate(self) -> float:
        return self.schedule(self.global_step)

    def _optimizer_step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.masters is not None:
            self.masters.copy_to_model()

    def _clip(self, finite_loss: bool) -> tuple[float, bool]:
        """Global grad L2 norm before clipping, and whether loss and gradients are finite on every rank."""
        import torch

        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = float(self.config.clip_grad or 0.0)
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf) if params else torch.tensor(0.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm = float(norm)
        flag = torch.tensor([0.0 if finite_loss else 1.0], device=self.device)
        if self.world > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return norm, math.isfinite(norm) and float(flag) == 0.0

    # --- weights and checkpoints ---------------------------------------------------------

    def layout(self) -> ParallelLayout:
        """Every rank is a data-parallel rank of its own (FSDP shards parameters, not data)."""
        return ParallelLayout(dp_rank=self.rank, dp_size=self.world, returns_outputs=True, rank=self.rank,
                              world=self.world, shares_prompts=self._shares_prompts())

    async def iter_weights(self):
        """Yield ``(hf_name, tensor)`` one parameter or buffer at a time (tied aliases left out).

        Under FSDP2 each sharded tensor is gathered in full on every rank as it is
        yielded (a collective: every rank iterates). Single process: detached views of
        the live weights; copy them before the next :meth:`train`.
        """
        items = self._full_state()
        if lora.enabled(self.config):  # LoRA: the engines get W + scaling * B A under the HF names
            items = lora.merged_weights(self.model, items)
        async for name, tensor in items:
            yield name, tensor

    async def _full_state(self):
        for name, tensor in self.model.state_dict().items():
            if name in self._tied:
                continue
            if hasattr(tensor, "full_tensor"):
                tensor = await self._in_thread(tensor.full_tensor)
            yield name, tensor.detach()

    async def named_weights(self) -> list[tuple[str, Any]]:
        """Every tensor of :meth:`iter_weights` in one list (tests and tools; weight sync streams)."""
        return [(name, tensor) async for name, tensor in self.iter_weights()]

    async def update_ref_model(self) -> None:
        """The reference model takes the actor's current weights (``--ref-update-interval``); every rank calls it.

        The weights of :meth:`iter_weights` (full tensors, LoRA merged) are loaded into the
        reference, which keeps its own dtype (bfloat16 under ``--bf16``, as the actor's passes)
        and its sharding under FSDP2.

        :raises PluginError: no reference model is loaded.
        """
        if self.ref_model is None:
            raise PluginError("fsdp: update_ref_model() but no reference model is loaded (it loads only with "
                              "--use-kl-loss or --kl-coef != 0).")
        await self._copy_actor_into(self.ref_model)

    async def _copy_actor_into(self, target) -> None:
        """Load the weights of :meth:`iter_weights` (full tensors, LoRA merged) into ``target``, which keeps its
        dtype and sharding."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        state = {name: tensor async for name, tensor in self.iter_weights()}
        await self._in_thread(set_model_state_dict, target, state, options=checkpoint._options(strict=False))

    async def save(self, path: str) -> None:
        """Write the checkpoint into ``path`` (layout in :mod:`.checkpoint`); every rank calls it.

        ``--no-save-optim`` leaves out ``optimizer.pt`` (optimizer and scheduler).
        """
        await self._in_thread(
            checkpoint.save_checkpoint, path, model=self.model, optimizer=self.optimizer, tokenizer=self.tokenizer,
            global_step=self.global_step, world=self.world, rank=self.rank, tied=self._tied,
            save_optim=not self.config.no_save_optim,
        )

    async def load(self, path: str) -> None:
        """Restore weights, optimizer (unless ``--no-load-optim``), global step, RNG (unless ``--no-load-rng``);
        under ``--finetune`` the weights only (:func:`furlong.kit.resume.load_parts`).

        The global step (which sets the LR schedule position) comes from ``meta.json`` (0 under
        ``--finetune``); with ``--no-load-optim`` Adam's moments start fresh.

        :raises PluginError: ``path`` is not an fsdp checkpoint.
        """
        parts = load_parts(self.config)
        meta = checkpoint.read_meta(path)
        await self._in_thread(checkpoint.load_weights, path, self.model, self.world, self.rank, self._tied)
        if self.masters is not None:
            self.masters.copy_to_model()
        if parts.optimizer:
            found = await self._in_thread(checkpoint.load_optimizer, path, self.model, self.optimizer, self.world,
                                            self.rank)
            if not found and self.rank == 0:
                log.warning("fsdp: %s has no optimizer.pt (saved with --no-save-optim); Adam starts fresh", path)
        self.global_step = int(meta["global_step"]) if parts.step else 0
        if parts.rng:
            checkpoint.load_rng(path, self.rank)


def _bf16_parameters(model):
    """``model`` with its parameters cast to bfloat16 in place (buffers, e.g. RoPE frequencies, stay float32)."""
    import torch

    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    return model
