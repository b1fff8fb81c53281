"""The megatron train backend: a megatron-core GPTModel (local spec, SDPA attention) built from a Hugging Face model."""

from __future__ import annotations

import logging
import math
import os
import warnings
from typing import Any

from furlong.hooks import ParallelLayout, PluginError, RunConfig, TrainBatch
from furlong.kit.hf import is_hf_dir
from furlong.kit.resume import load_parts
from furlong.kit.start_weights import torch_dist_dir
from furlong.kit.trainer import StepLoop, local_optimizer

from . import checkpoint, lora
from .config import RECOMPUTE_NEEDS_CUDA, check_model_args, model_shape, padded_vocab_size
from .convert import (ExpertShard, Stage, export_hf, load_hf, pipeline_split, placed_units, safetensors_stream,
                      stage_layer_counts)
from .logprobs import forward_log_probs
from .master import MasterWeights
from .mcore_optimizer import MegatronCoreOptimizer, chooses_mcore_optimizer, mcore_optimizer_problems, own_adamw_reason
from .model import build_gpt, cpu_shims, init_parallel, untrained_padding_lookups
from .moe import flag, moe_flag_problems, moe_transformer_fields
from .moe_train import ExpertLayers, is_expert_parameter
from .optimizer import build_optimizer, build_scheduler
from .pipeline import PipelineStages

__all__ = ["MegatronBackend"]

log = logging.getLogger("furlong.backends.megatron")


class MegatronBackend(ExpertLayers, PipelineStages, StepLoop):
    """A :class:`furlong.hooks.TrainBackend` over megatron-core (see docs/megatron.md).

    Tensor and pipeline parallelism through megatron-core's ``parallel_state`` (every TP
    peer and pipeline stage gets the same micro-batches; with PP > 1 they run through
    megatron-core's pipeline schedule, :mod:`.pipeline`, and the last stage computes
    log-probs and the loss); context parallelism (every CP peer gets the same micro-batches and
    computes two chunks of each sequence, :mod:`.context`; log-probs are gathered back into
    whole sequences); data parallelism over ``world / (TP x PP x CP)`` ranks with
    gradients SUMMED over data- and context-parallel ranks (the core's objective already carries
    the whole step's denominators). Without
    ``--bf16`` parameters, gradients and AdamW state are float32; with ``--bf16`` the
    parameters are bfloat16 and AdamW updates float32 master weights whose gradients
    accumulate in float32 (:mod:`.master`). Mixture-of-experts models (:mod:`.moe`, :mod:`.moe_train`):
    megatron-core's MoE layers, their load-balancing loss in the objective, experts shared out over
    ``--expert-model-parallel-size`` ranks (their gradients summed over the expert-data-parallel ranks).
    """

    name = "megatron"

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.model = None
        self.ref_model = None
        self.old_actor = self.rollout_actor = None  # --keep-old-actor: copies of the synced weights
        self.optimizer = None
        self.scheduler = None
        self.shape = None
        self.vocab_rows = 0
        self.global_step = 0
        self.masters: MasterWeights | None = None
        self.world, self.rank, self.tp, self.pp, self.cp, self.ep = 1, 0, 1, 1, 1, 1
        self.stage = Stage()
        self.experts = ExpertShard()
        self.device = None
        self._tp_sharded: set[int] = set()
        self._replay = None
        self._recorded_routing: dict = {}
        self._unmerged: list = []  # recorded routing a pipeline stage has not completed with the others' yet
        self._disagreeing = [0, 0]

    # --- set-up -------------------------------------------------------------------------

    async def init(self, config: RunConfig) -> int:
        """Build the model from ``--hf-checkpoint``'s config and load the actor (and reference) weights; return 0.

        Weights: ``--ref-load`` when it is a Hugging Face directory or a ``torch_dist``
        checkpoint (an ``iter_N`` dir, or a save root with its marker), else
        ``--hf-checkpoint``. Resume is the core's job (it calls :meth:`load`).

        :raises PluginError: an unsupported model, Miles architecture flags that disagree
            with the HF config, or unloadable weights.
        """
        import torch
        from transformers import AutoConfig

        self.config = config
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", 0))
            if local >= torch.cuda.device_count():
                local = torch.cuda.current_device()
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
            # megatron-core's advice for overlapping tensor-parallel communication on a GPU
            warnings.filterwarnings("ignore", message=".*recommended to set the environment variable "
                                    "CUDA_DEVICE_MAX_CONNECTIONS", category=UserWarning)
        if recompute_settings(config) and self.device.type != "cuda":
            raise PluginError(RECOMPUTE_NEEDS_CUDA)
        self.tp = int(config.tensor_model_parallel_size or 1)
        self.pp = int(config.pipeline_model_parallel_size or 1)
        self.cp = int(config.context_parallel_size or 1)
        self.ep = int(flag(config, "expert_model_parallel_size", 1))
        self.world, self.rank = init_parallel(self.tp, self.device, self.pp, self.cp, self.ep)
        if self.device.type == "cuda":
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(int(config.seed))
        try:
            hf_config = AutoConfig.from_pretrained(config.hf_checkpoint)
        except (OSError, ValueError) as exc:
            raise PluginError(f"--hf-checkpoint {config.hf_checkpoint}: cannot read config.json: {exc}") from exc
        self.shape = model_shape(hf_config, f"--hf-checkpoint {config.hf_checkpoint}")
        problems = check_model_args(config, self.shape, f"--hf-checkpoint {config.hf_checkpoint}/config.json")
        problems += moe_flag_problems(config, self.shape, f"--hf-checkpoint {config.hf_checkpoint}/config.json")[0]
        problems += moe_layout_problems(self.shape, self.tp, self.ep, config.hf_checkpoint,
                                        bool(config.use_distributed_optimizer), bool(config.sequence_parallel))
        problems += mcore_optimizer_problems(config)
        try:
            counts = stage_layer_counts(self.shape.num_layers, self.pp, *pipeline_split(config.megatron_args))
        except ValueError as exc:
            problems.append(f"--hf-checkpoint {config.hf_checkpoint}: {exc}")
        if problems:
            raise PluginError(" ".join(problems))
        self.shape = self._built_shape(self.shape)
        from megatron.core import parallel_state

        if self.pp > 1:
            self.stage = Stage(parallel_state.get_pipeline_model_parallel_rank(), self.pp, counts)
        self.experts = ExpertShard(parallel_state.get_expert_model_parallel_rank(), self.ep)
        self.vocab_rows = padded_vocab_size(self.shape.vocab_size, self.tp,
                                            config.make_vocab_size_divisible_by)
        self.model = self._load_model()
        untrained_padding_lookups(self.model, self.shape.padding_idx)
        if lora.enabled(config):
            problems = lora.lora_problems(config, self.tp, self.shape.is_moe)
            if problems:
                raise PluginError(" ".join(problems))
            adapted = lora.apply_lora(self.model, config, int(config.seed), self.stage.offset(self.shape.num_layers))
            if self.rank == 0:
                log.info("megatron: LoRA rank %d, alpha %d on %s (%d layers); the base weights are frozen",
                         int(config.lora_rank), int(config.lora_alpha),
                         ", ".join(sorted(lora.target_linears(config))), len(adapted))
        own_adamw = self._own_adamw_reason(config)
        mcore = chooses_mcore_optimizer(config, own_adamw)
        if config.use_distributed_optimizer and not mcore and self.rank == 0:
            log.info("megatron: --use-distributed-optimizer: the backend's own sharded AdamW (%s)", own_adamw)
        if self._dtype() != torch.float32 and config.keep_fp32_master and not mcore:
            self.masters = MasterWeights(self.model)
            self._masters_from_checkpoint()
        params = dict(self._trained_parameters())
        self._tp_sharded = {id(params[local]) for u, local in placed_units(self.shape, self.stage, self.experts)
                            if u.split is not None and local in params}  # (LoRA: frozen weights are not trained)
        self._tp_sharded |= {id(p) for n, p in params.items() if lora.sharded_adapter(n)}
        if config.use_kl_loss or config.kl_coef:
            self.ref_model = self._load_model().requires_grad_(False)
        if config.keep_old_actor:
            self.old_actor = self._load_model().requires_grad_(False)
            self.rollout_actor = self._load_model().requires_grad_(False)
        self._start_routing_replay()
        if mcore:  # megatron-core keeps the float32 masters itself
            self.optimizer = MegatronCoreOptimizer(self.model, config, self._dtype() == torch.bfloat16)
        else:
            self.optimizer = build_optimizer(self._trained_parameters(), config, self._optimizer_shards())
        self.scheduler = build_scheduler(self.optimizer, config)
        if self.rank == 0:
            log.info("megatron: %s, TP %d%s, PP %d%s, CP %d, DP %d%s, vocab rows %d, %s%s", self.shape.family, self.tp,
                     " (sequence parallel)" if self._sequence_parallel() else "", self.pp, f" (layers per stage {'+'.join(map(str, self.stage.layers))})" if self.pp > 1 else "",
                     self.cp, self._dp_size(), self._experts_note(), self.vocab_rows,
                     "bf16 parameters, fp32 master weights" if self.masters or self._mcore() else
                     "bf16 parameters, no fp32 master weights" if self._dtype() != torch.float32 else "fp32",
                     self._optimizer_note())
        return 0

    def _built_shape(self, shape):
        """The shape the model is built with: the checkpoint's (a critic builds another, :mod:`.critic`)."""
        return shape

    def _masters_from_checkpoint(self, skip: tuple[str, ...] = ()) -> None:
        """Under ``--bf16`` with a ``torch_dist`` ``--ref-load``: the float32 master weights start from the
        checkpoint's float32 weights, not from their bfloat16 rounding (``skip``: state-dict key prefixes of
        parameters it does not hold, :func:`~.checkpoint.load_weights`)."""
        saved = torch_dist_dir(self.config.ref_load)
        if saved:
            checkpoint.load_weights(saved, self.model, self.device, masters=self.masters, skip=skip)

    def _build_model(self):
        """This rank's GPTModel of :attr:`shape`, its weights not loaded yet."""
        first, last = pipeline_split(self.config.megatron_args) if self.pp > 1 else (None, None)
        split = {k: v for k, v in (("num_layers_in_first_pipeline_stage", first),
                                   ("num_layers_in_last_pipeline_stage", last)) if v is not None}
        return build_gpt(self.shape, self.tp, self.vocab_rows, self._dtype(), self.device, pp=self.pp, cp=self.cp,
                         sequence_parallel=self._sequence_parallel(), **recompute_settings(self.config), **split,
                         deterministic_mode=bool(self.config.deterministic_mode),
                         **moe_transformer_fields(self.shape, self.config))

    def _load_model(self):
        """:meth:`_build_model` with the actor's starting weights: ``--ref-load`` (Hugging Face or
        ``torch_dist``), else ``--hf-checkpoint``."""
        model = self._build_model()
        ref = self.config.ref_load
        if is_hf_dir(ref):
            load_hf(model, safetensors_stream(ref), self.shape, self.vocab_rows, self.tp, self._tp_rank(),
                    f"--ref-load {ref}", self.stage, self.experts)
        elif torch_dist_dir(ref):
            checkpoint.load_weights(torch_dist_dir(ref), model, self.device)
        else:
            source = self.config.hf_checkpoint
            load_hf(model, safetensors_stream(source), self.shape, self.vocab_rows, self.tp, self._tp_rank(),
                    f"--hf-checkpoint {source}", self.stage, self.experts)
        return model.eval()

    def _experts_note(self) -> str:
        if not self.shape.is_moe:
            return ""
        return (f", {self.shape.num_experts} experts (top {self.shape.moe_topk}) on {len(self.shape.moe_layers)} layers, "
                f"EP {self.ep} ({self.shape.num_experts // self.ep} per rank)")

    def _tp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_rank()

    def _sequence_parallel(self) -> bool:
        """``--sequence-parallel`` with TP > 1 (with TP 1 it changes nothing, as in Megatron)."""
        return bool(self.config.sequence_parallel) and self.tp > 1

    def _dtype(self):
        """Parameter dtype: bfloat16 with ``--bf16``, else float32."""
        import torch

        return torch.bfloat16 if self.config.bf16 else torch.float32

    def _trained_parameters(self):
        """``(name, tensor)`` of what the optimizer updates: the float32 masters under ``--bf16``."""
        return list(self.masters.named_parameters() if self.masters else self.model.named_parameters())

    async def _in_thread(self, fn, *args, **kwargs):
        """:meth:`StepLoop._in_thread` inside :func:`~.model.cpu_shims` (megatron-core's CUDA calls on CPU)."""

        def shimmed():
            with cpu_shims(self.device):
                return fn(*args, **kwargs)

        return await super()._in_thread(shimmed)

    # --- forward passes -----------------------------------------------------------------

    def _forward(self, model, batch: TrainBatch, ids: list[int], grad: bool):
        """Response log-probs and entropy of samples ``ids`` (vocab-parallel softmax, :mod:`.logprobs`);
        packed (``thd``) or right-padded by :meth:`_packed`; a packed one runs each prompt its samples share once
        where :meth:`_shares_packed_prompts`."""
        tokens = [batch.tokens[i] for i in ids]
        packed = self._packed(tokens)
        with self._routing(model, batch, ids, grad, packed):
            return forward_log_probs(
                model, tokens, [int(batch.response_lengths[i]) for i in ids], batch.temperature,
                self.device, vocab_size=self.shape.vocab_size, grad=grad, entropy_grad=self._entropy_grad(grad),
                packed=packed, chunk_rows=self._chunk_rows(), share_prompts=self._shares_packed_prompts())

    def _packed(self, tokens) -> bool:
        """Pack this micro-batch? Always where packed attention is one ``varlen_attn`` flash call per layer
        (CUDA in bfloat16 with a torch that has it, no context parallelism); elsewhere, under
        ``--use-dynamic-batch-size`` (micro-batches planned by tokens), when right-padding would waste
        much (:func:`pack_micro_batch`)."""
        from furlong.kit.packed_attention import varlen_supported

        if self.cp == 1 and varlen_supported(self.device, self._dtype()):
            return True
        return bool(self.config.use_dynamic_batch_size) and pack_micro_batch([len(t) for t in tokens])

    def _chunk_rows(self) -> int:
        return int(self.config.log_probs_chunk_size or -1)

    # --- training -----------------------------------------------------------------------

    def _before_train(self) -> None:
        if recompute_settings(self.config) or self.shape.is_moe:
            # megatron-core recomputes activations, and its routers add the load-balancing loss, in training mode
            # only (no dropout here)
            self.model.train()

    def _after_train(self) -> None:
        self.model.eval()
        self._recorded_routing.clear()
        self._unmerged.clear()

    def _optimizer_shards(self):
        """The group the AdamW state is sharded over: the data-parallel x context-parallel ranks under
        ``--use-distributed-optimizer`` (as megatron-core's distributed optimizer), None otherwise."""
        if not self.config.use_distributed_optimizer or self._dp_size() * self.cp == 1:
            return None
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group(with_context_parallel=True)

    def _own_adamw_reason(self, config: RunConfig) -> str | None:
        """Why ``--use-distributed-optimizer`` keeps the backend's own sharded AdamW here, or None
        (:func:`.own_adamw_reason`)."""
        return own_adamw_reason(config, self.device.type == "cuda", self.shape.is_moe)

    def _mcore(self) -> bool:
        """Whether megatron-core's distributed optimizer runs the steps (:mod:`.mcore_optimizer`)."""
        return isinstance(self.optimizer, MegatronCoreOptimizer)

    def _optimizer_note(self) -> str:
        if self._mcore():
            offload = (f", AdamW state of {float(self.optimizer.inner.config.optimizer_offload_fraction):.0%} of the "
                       "parameters on the host (--optimizer-cpu-offload)" if self.config.optimizer_cpu_offload else "")
            return (f"; megatron-core's distributed optimizer over {self._dp_size() * self.cp} rank(s) (DP x CP)"
                    f"{offload}")
        if not self.config.use_distributed_optimizer:
            return ""
        shards = self._dp_size() * self.cp
        if shards == 1:
            return "; --use-distributed-optimizer has one rank (DP x CP) to shard over: the AdamW state stays whole"
        mine = sum(p.numel() for g in local_optimizer(self.optimizer).param_groups for p in g["params"])
        total = sum(p.numel() for g in self.optimizer.param_groups for p in g["params"])
        return (f"; AdamW state sharded over {shards} ranks (DP x CP, --use-distributed-optimizer): this rank keeps "
                f"the moments of {mine:,} of {total:,} parameter elements ({8 * mine / 2**20:.1f} of "
                f"{8 * total / 2**20:.1f} MiB in float32)")

    def _shares_packed_prompts(self) -> bool:
        """True where a packed micro-batch's samples that share a prompt run it once: a dense model (the routers of
        a model with experts, their load-balancing loss and routing replay see every sample whole), without
        context, sequence or pipeline parallelism."""
        return not self.shape.moe_layers and self.cp == 1 and self.pp == 1 and not self._sequence_parallel()

    def train_forward_gives_old_log_probs(self) -> bool:
        """False with ``--lora-dropout`` > 0 (the training forward drops adapter inputs, the log-prob pass does not)."""
        return not (lora.enabled(self.config) and float(self.config.lora_dropout or 0.0) > 0)

    def _learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])  # set by the scheduler

    def _optimizer_step(self, lr: float) -> None:
        self.optimizer.step()
        self.scheduler.step(1)
        if self.masters:
            self.masters.copy_to_model()

    def _dp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def _dp_size(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    def _clip(self, finite_loss: bool) -> tuple[float, bool]:
        """SUM gradients over DP x CP ranks (each CP rank holds its tokens' share: :mod:`.context`; and a
        tied model's two embedding copies over the stages; and the query/key norms' over the TP ranks,
        every norm scale's under ``--sequence-parallel``, :func:`summed_over_tensor_parallel`); global
        L2 norm before clipping (over TP shards and pipeline stages, each parameter once); whether all
        is finite everywhere."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        if self._mcore():
            return self._clip_mcore(finite_loss)
        self._sum_embedding_copies()
        named = [(n, p) for n, p in self._trained_parameters() if p.grad is not None]
        params = [p for _, p in named]
        if self._dp_size() * self.cp > 1:
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            for name, p in named:
                if not is_expert_parameter(name):
                    dist.all_reduce(p.grad, group=group)
        self._expert_grads([(n, p) for n, p in named if is_expert_parameter(n)])
        if self.tp > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            for name, p in named:
                if summed_over_tensor_parallel(name, self._sequence_parallel()) or lora.summed_adapter(
                        name, self._sequence_parallel()):
                    dist.all_reduce(p.grad, group=group)
        counted = [p for n, p in named if not self._is_embedding_copy(n)]  # a tied copy is counted once
        split = [id(p) in self._tp_sharded for p in counted]
        norms = torch.stack(torch._foreach_norm([p.grad.detach() for p in counted])).double() if counted else \
            torch.zeros(0, dtype=torch.float64, device=self.device)
        squares = norms.square()
        mask = torch.tensor(split, dtype=torch.bool, device=squares.device)
        experts = torch.tensor([is_expert_parameter(n) for n, _ in named if not self._is_embedding_copy(n)],
                               dtype=torch.bool, device=squares.device)
        sharded, replicated = squares[mask & ~experts].sum(), squares[~mask & ~experts].sum()
        if self.tp > 1:
            dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
        held = squares[experts].sum()  # this EP rank's experts: each expert's gradient is on one EP rank
        if self.ep > 1:
            dist.all_reduce(held, group=parallel_state.get_expert_model_parallel_group())
        total = sharded + replicated + held
        if self.pp > 1:
            dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        norm = float(total.sqrt())
        finite = math.isfinite(norm) and self._finite_everywhere(finite_loss)
        clip = float(self.config.clip_grad or 0.0)
        if finite and clip > 0 and norm > clip:
            torch._foreach_mul_([p.grad for p in params], clip / (norm + 1e-6))
        return norm, finite

    def _finite_everywhere(self, finite_loss: bool) -> bool:
        """Whether every rank's loss was finite."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0.0 if finite_loss else 1.0], device=self.device)
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return float(flag) == 0.0

    def _clip_mcore(self, finite_loss: bool) -> tuple[float, bool]:
        """:meth:`_clip` under megatron-core's distributed optimizer: its reduce-scatter over DP x CP, the same
        sums as :meth:`_clip` over the pipeline stages (a tied embedding) and over TP
        (:func:`summed_over_tensor_parallel`) on its float32 gradient buffers, then its own norm and clipping."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        self.optimizer.reduce()
        self._sum_embedding_copies()
        if self.tp > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            for name, grad in self.optimizer.main_grads():
                if summed_over_tensor_parallel(name, self._sequence_parallel()):
                    dist.all_reduce(grad, group=group)
        norm = self.optimizer.clip()
        return norm, math.isfinite(norm) and self._finite_everywhere(finite_loss)

    def _move(self, device) -> None:
        """:meth:`StepLoop._move`; under megatron-core's distributed optimizer the model's weights and gradients
        live in its buffers, which it moves itself (the parameters stay views of them)."""
        if not self._mcore():
            return super()._move(device)
        import torch

        for model in self._modules():
            if model is not self.model:
                model.to(device)
        if torch.device(device).type == "cpu":
            self.optimizer.offload()
        else:
            self.optimizer.onload()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    # --- weights and checkpoints ---------------------------------------------------------

    def layout(self) -> ParallelLayout:
        """Data-parallel rank and size from megatron-core's groups (CP peers share a data-parallel rank);
        TP and CP rank 0 of the last pipeline stage (which computes log-probs and the loss) returns the outputs."""
        from megatron.core import parallel_state

        from furlong.kit.packed_attention import varlen_supported

        first_cp = parallel_state.get_context_parallel_rank() == 0
        # shares prompts in every micro-batch only where every micro-batch is packed (CUDA in 16-bit)
        shares = self._shares_packed_prompts() and varlen_supported(self.device, self._dtype())
        return ParallelLayout(dp_rank=parallel_state.get_data_parallel_rank(),
                              dp_size=parallel_state.get_data_parallel_world_size(),
                              returns_outputs=self._tp_rank() == 0 and first_cp and self.stage.last, rank=self.rank,
                              world=self.world, shares_prompts=shares)

    async def iter_weights(self):
        """Yield ``(hf_name, tensor)`` one Hugging Face tensor at a time (:func:`~.convert.export_hf`).

        A collective over the TP group (sharded parameters are all-gathered) and the
        pipeline stages (each parameter is broadcast from its stage): every rank iterates
        and gets every tensor. Tensors are in the parameters' dtype (bfloat16 under ``--bf16``), full
        shape, vocabulary trimmed to the HF size; tied models yield no ``lm_head.weight``. With LoRA the
        adapted layers' weights are merged, ``W + (alpha / r) B A`` (:func:`~.lora.merged_weight`).
        Copy them before the next :meth:`train`.
        """
        from megatron.core import parallel_state

        weight_of = None
        if lora.enabled(self.config):
            def weight_of(name, param):
                return lora.merged_weight(self.model.get_submodule(name.rpartition(".")[0])) if (
                    name.endswith(".weight")) else param

        stream = export_hf(self.model, self.shape, self.tp, parallel_state.get_tensor_model_parallel_group(),
                           self.stage, parallel_state.get_pipeline_model_parallel_group() if self.pp > 1 else None,
                           self.experts, parallel_state.get_expert_model_parallel_group() if self.ep > 1 else None,
                           weight_of)
        sentinel = object()
        while True:
            item = await self._in_thread(next, stream, sentinel)
            if item is sentinel:
                return
            yield item

    async def named_weights(self) -> list[tuple[str, Any]]:
        """Every tensor of :meth:`iter_weights` in one list (tests and tools; weight sync streams)."""
        return [(name, tensor) async for name, tensor in self.iter_weights()]

    async def update_ref_model(self) -> None:
        """The reference model takes the actor's current weights (``--ref-update-interval``); every rank calls it.

        Both models are built alike (same shards on this rank, same dtype), so each rank copies its own
        parameters: the weights the actor's passes run (bfloat16 under ``--bf16``), no communication.

        :raises PluginError: no reference model is loaded.
        """
        if self.ref_model is None:
            raise PluginError("megatron: update_ref_model() but no reference model is loaded (it loads only with "
                              "--use-kl-loss or --kl-coef != 0).")
        await self._copy_actor_into(self.ref_model)

    async def _copy_actor_into(self, target) -> None:
        await self._in_thread(_copy_parameters, self.model, target)

    async def save(self, path: str) -> None:
        """Write a ``torch_dist`` checkpoint into ``path`` (:mod:`.checkpoint`); every rank calls it.

        ``--no-save-optim`` leaves out the optimizer moments. With LoRA the checkpoint holds the adapters (and
        their moments) only, and rank 0 also writes them in peft's format into ``path/adapter``
        (:func:`~.lora.save_adapter`).
        """
        await self._in_thread(
            checkpoint.save_checkpoint, path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            masters=self.masters, global_step=self.global_step, rank=self.rank, world=self.world, tp=self.tp,
            pp=self.pp, cp=self.cp,
            save_optim=not self.config.no_save_optim, device=self.device)
        if lora.enabled(self.config):
            from megatron.core import parallel_state

            await self._in_thread(lora.save_adapter, self.model, self.shape, self.config,
                                  os.path.join(path, "adapter"), self.tp,
                                  parallel_state.get_tensor_model_parallel_group(), self.rank == 0,
                                  self.stage.offset(self.shape.num_layers),
                                  parallel_state.get_pipeline_model_parallel_group() if self.pp > 1 else None)

    async def load(self, path: str) -> None:
        """Restore weights, optimizer and schedule (unless ``--no-load-optim``), RNG (unless ``--no-load-rng``);
        under ``--finetune`` the weights only, the global step at 0 (:func:`furlong.kit.resume.load_parts`).

        Works at any TP, PP or CP size (megatron-core reshards; CP peers hold the same weights). The global
        step comes from the checkpoint (0 under ``--finetune``).

        :raises PluginError: ``path`` is not a checkpoint of this backend or of this model.
        """
        parts = load_parts(self.config)
        step = await self._in_thread(
            checkpoint.load_checkpoint, path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            masters=self.masters, rank=self.rank, world=self.world, load_optim=parts.optimizer,
            load_rng=parts.rng, device=self.device)
        self.global_step = step if parts.step else 0


def _copy_parameters(source, target) -> None:
    """Copy every parameter and buffer of ``source`` into the same-named one of ``target`` (built alike, without
    LoRA): an adapted linear's weight as its merged ``W + scaling B A`` (this rank's piece)."""
    import torch

    with torch.no_grad():
        tensors = dict(target.named_parameters())
        tensors.update(target.named_buffers())
        for name, value in [*source.named_parameters(), *source.named_buffers()]:
            if not lora.is_adapter_key(name):
                tensors[name].copy_(value)
        for name, module in source.named_modules():
            if hasattr(module, "lora_A"):
                tensors[f"{name}.weight"].copy_(lora.merged_weight(module))


def moe_layout_problems(shape, tp: int, ep: int, where: str,
                        distributed_optimizer: bool | str = False, sequence_parallel: bool = False) -> list[str]:
    """What the parallel sizes cannot do with the model of ``shape`` (``where``: its checkpoint): experts
    (``ep`` > 1) only on a model with them, dividing their count, and without ``--use-distributed-optimizer``
    (whose shards assume every data-parallel rank holds the same parameters); on a model with experts, TP > 1
    only with ``--sequence-parallel`` (megatron-core's rule: each TP rank routes its share of the sequence).
    ``distributed_optimizer``: on, or the flags that turned it on (named in the message)."""
    if not shape.is_moe:
        return [f"--expert-model-parallel-size {ep}: the model of --hf-checkpoint {where} has no experts."] if (
            ep > 1) else []
    problems = []
    if ep > 1 and distributed_optimizer:
        asked = distributed_optimizer if isinstance(distributed_optimizer, str) else "--use-distributed-optimizer"
        problems.append(f"{asked} with --expert-model-parallel-size {ep} is not supported yet by "
                        "--train-backend megatron (its AdamW shards assume every data-parallel rank holds the same "
                        "parameters); leave one of them out.")
    if shape.num_experts % ep:
        problems.append(f"--expert-model-parallel-size {ep} does not divide the {shape.num_experts} experts of "
                        f"--hf-checkpoint {where}.")
    if tp > 1 and not sequence_parallel:
        problems.append(f"--tensor-model-parallel-size {tp} on a mixture-of-experts model (--hf-checkpoint {where}) "
                        "needs --sequence-parallel: megatron-core routes each TP rank's share of the sequence.")
    return problems


def summed_over_tensor_parallel(name: str, sequence_parallel: bool = False) -> bool:
    """Whether parameter ``name``'s gradient is a partial sum on each TP rank: the query/key norm scales
    (Qwen3), which every rank applies to its own attention heads, so each rank's gradient covers its
    heads only; under sequence parallelism every norm scale and every MoE router too, each rank normalising
    and routing its own chunk of the sequence (megatron-core's ``finalize_model_grads`` sums both over the TP
    group likewise). Experts are whole on every TP rank (expert TP 1): their gradients are summed over the
    expert-data-parallel ranks, which include the TP ranks (:meth:`ExpertLayers._expert_grads`)."""
    return ".q_layernorm." in name or ".k_layernorm." in name or (
        sequence_parallel and ("layernorm." in name or ".mlp.router." in name))


# padded tokens over real tokens above which a token-planned micro-batch is packed (thd) rather than padded
PACK_ABOVE_PADDING = 1.25


def pack_micro_batch(lengths: list[int]) -> bool:
    """Pack a micro-batch of sequences of ``lengths`` tokens (``thd``) rather than right-pad it,
    where attention over packed input is one SDPA call per sequence (CPU, float32, a torch without
    ``varlen_attn``, or CP > 1)?

    Both layouts give the same values (tested). Padding computes ``B x max(lengths)``
    tokens in one attention call; packing computes only the real ones, in a host-side loop
    over the sequences, which costs more than a little padding: micro-batches of similar
    lengths are padded; mixed lengths are packed.
    """
    real = sum(lengths)
    return bool(real) and len(lengths) * max(lengths) > PACK_ABOVE_PADDING * real


def recompute_settings(config: RunConfig) -> dict:
    """``TransformerConfig`` recompute fields from ``--recompute-granularity``, ``--recompute-method``,
    ``--recompute-num-layers`` (none when the granularity is not given)."""
    granularity = config.recompute_granularity
    if not granularity:
        return {}
    settings = {"recompute_granularity": granularity}
    if granularity == "full":
        settings["recompute_method"] = config.recompute_method or "uniform"
        settings["recompute_num_layers"] = int(config.recompute_num_layers or 1)
    return settings
