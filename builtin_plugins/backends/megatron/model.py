"""Process groups (megatron-core ``parallel_state``) and the GPTModel built from a Hugging Face config."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from typing import Any

from furlong.hooks import PluginError

from .config import ModelShape

__all__ = ["build_gpt", "cpu_shims", "init_parallel"]


def init_parallel(tp: int, device, pp: int = 1, cp: int = 1, ep: int = 1) -> tuple[int, int]:
    """Initialise megatron-core's tensor/pipeline/context/expert/data-parallel groups; return ``(world, rank)``.

    Uses the default process group when one exists (``furlong train`` under ``torchrun``,
    a Ray worker); a single process without one gets a one-rank group on an in-memory
    store (gloo on CPU, NCCL on GPU), which megatron-core needs for its groups.

    Rank order is megatron-core's default ``tp-cp-ep-dp-pp`` (TP peers adjacent, then CP peers).
    Experts (``ep`` > 1; expert tensor parallelism 1: every expert whole on its rank): the ``world / PP`` ranks
    of a stage split into groups of ``ep`` consecutive ranks that share the experts out; each expert is
    replicated over the ``world / (PP x ep)`` expert-data-parallel ranks (TP ranks included), the other weights
    over the ``world / (TP x PP x CP)`` data-parallel ones.

    :raises PluginError: TP x PP x CP (or PP x EP) does not divide the world size, or ``WORLD_SIZE > 1``
        without an initialised process group.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    # megatron-core 0.16 still calls torch's older collective names; torch's notice of it says nothing to users
    warnings.filterwarnings("ignore", message=r".*`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is "
                            r"deprecated", category=FutureWarning)
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise PluginError("megatron: WORLD_SIZE > 1 but torch.distributed is not initialized; call "
                              "torch.distributed.init_process_group before the backend's init (furlong train does).")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (tp * pp * cp):
        raise PluginError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} x "
                          f"--context-parallel-size {cp} does not divide the trainer world size {world}.")
    if world % (pp * ep):
        raise PluginError(f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp} does not divide "
                          f"the trainer world size {world}.")
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_context_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tp, pp, cp, ep):
            raise PluginError(f"megatron: model-parallel groups already exist with TP {have[0]}, PP {have[1]}, "
                              f"CP {have[2]}, EP {have[3]}, not TP {tp}, PP {pp}, CP {cp}, EP {ep}.")
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 context_parallel_size=cp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=1, create_gloo_process_groups=False)
    return world, rank


_shims_lock = threading.Lock()
_shims_depth = 0
_cuda_originals: tuple = ()


@contextlib.contextmanager
def cpu_shims(device):
    """On a machine without CUDA, let megatron-core's CUDA-only calls fall back to the CPU.

    megatron-core 0.16 moves RoPE's ``inv_freq`` to ``torch.cuda.current_device()`` and
    calls ``torch.cuda.synchronize()`` when saving a distributed checkpoint
    (docs/megatron.md, "CPU"); its pipeline schedule and p2p exchange allocate on
    ``torch.cuda.current_device()`` and ``device="cuda"``, a tied model's last
    pipeline stage calls ``Tensor.cuda()`` on its copy of the embedding, and under sequence
    parallelism the embedding forks the CUDA RNG tracker around its dropout; the all-to-all token dispatcher
    copies its split sizes to the host (as numpy arrays) on a CUDA stream of its own. All are undefined without
    CUDA, so inside this block they stay on (or return) the CPU, synchronising does nothing, the RNG fork is a
    no-op (dropout is 0 here), there is one stream (:class:`_HostStream`) and host split sizes become numpy
    arrays; with CUDA nothing is changed.
    Blocks may nest and overlap across threads: the originals come back when the last one exits.
    """
    import torch

    global _shims_depth, _cuda_originals
    if device.type == "cuda" or torch.cuda.is_available():
        yield
        return
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    from megatron.core.transformer.moe import token_dispatcher

    with _shims_lock:
        if _shims_depth == 0:
            _cuda_originals = (torch.cuda.current_device, torch.cuda.synchronize, CudaRNGStatesTracker.fork,
                               torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream,
                               token_dispatcher.maybe_move_tensor_to_cpu)
            torch.cuda.current_device = lambda: torch.device("cpu")
            torch.cuda.synchronize = lambda *a, **k: None
            CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
            torch.cuda.Stream = lambda *a, **k: _HOST_STREAM
            torch.cuda.current_stream = lambda *a, **k: _HOST_STREAM
            torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
            token_dispatcher.maybe_move_tensor_to_cpu = _host_split_sizes
        _shims_depth += 1
    try:
        with _cuda_on_cpu():
            yield
    finally:
        with _shims_lock:
            _shims_depth -= 1
            if _shims_depth == 0:
                (torch.cuda.current_device, torch.cuda.synchronize, CudaRNGStatesTracker.fork, torch.cuda.Stream,
                 torch.cuda.current_stream, torch.cuda.stream,
                 token_dispatcher.maybe_move_tensor_to_cpu) = _cuda_originals


def _host_split_sizes(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's ``maybe_move_tensor_to_cpu`` for host tensors: the all-to-all dispatcher asks for its split
    sizes as numpy arrays, which its own version makes only when copying from a GPU."""
    import torch

    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


class _HostStream:
    """The one stream there is without CUDA: megatron-core's all-to-all token dispatcher copies its split sizes to
    the host on a side stream it makes once, after waiting for the current one; here both are this object, so the
    copy happens in order, on the host."""

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self) -> "_HostStream":
        return self  # an event already reached

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


_mode_class: list = []


def _cuda_on_cpu():
    """A torch function mode that turns ``device="cuda"`` of tensor factories and ``Tensor.cuda()``
    into the CPU (a mode is per thread: :func:`cpu_shims` enters one in each)."""
    import torch
    from torch.overrides import TorchFunctionMode

    if not _mode_class:
        class CudaOnCpu(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is torch.Tensor.cuda:
                    return args[0]
                if kwargs.get("pin_memory"):  # RoPE's CP slicing pins a host tensor (no pinned memory without CUDA)
                    kwargs = {**kwargs, "pin_memory": False}
                device = kwargs.get("device")
                if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
                    kwargs = {**kwargs, "device": "cpu"}
                return func(*args, **kwargs)

        _mode_class.append(CudaOnCpu)
    return _mode_class[0]()


def transformer_config(shape: ModelShape, tp: int, dtype, device, **extra: Any):
    """megatron-core ``TransformerConfig`` of ``shape`` (docs/megatron.md, "Models"): RMSNorm,
    SwiGLU, no dropout, no biases but q/k/v's where the family has them; of the fused kernels only
    furlong's SwiGLU module (``use_te_activation_func``: the MLP calls the spec's
    ``activation_func``, :class:`~.layers.FusedSwiGLU`; TransformerEngine and Apex are not used).

    :param dtype: parameter dtype (``torch.float32`` or ``torch.bfloat16``).
    :param extra: more or replaced ``TransformerConfig`` fields (recompute settings;
        ``perform_initialization=True`` for megatron-core's own random init).
    """
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels, normalization="RMSNorm", layernorm_epsilon=shape.norm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_layernorm, rotary_interleaved=shape.rotary_interleaved, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, use_te_activation_func=True, bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True, tensor_model_parallel_size=tp, sequence_parallel=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=device.type != "cuda",
        perform_initialization=False,
    )
    fields.update(extra)
    return TransformerConfig(**fields)


def untrained_padding_lookups(model, padding_idx: int | None):
    """Let the embedding lookups of token ``padding_idx`` pass no gradient to the table, as HF's
    ``nn.Embedding(padding_idx=...)``: the row does not move through its lookups, but a tied output
    layer still trains it (its logit is in every softmax), as it does in transformers.

    A forward hook on ``model.embedding.word_embeddings`` (megatron-core's ``VocabParallelEmbedding``,
    whose output is ``[b, s, h]``, or this rank's ``[s / tp, b, h]`` under sequence parallelism) keeps
    the output's values and detaches it at the pad token's positions, when gradients are on.

    :returns: the hook's handle, or None (no ``padding_idx``, or a pipeline stage without the embedding).
    """
    import torch

    if padding_idx is None or not getattr(model, "pre_process", True):
        return None

    def detach_padding(module, args, output):
        if not torch.is_grad_enabled():
            return None
        keep = args[0] != padding_idx  # [b, s]
        if module.reduce_scatter_embeddings:
            rows = output.shape[0]
            start = module.tp_group.rank() * rows
            keep = keep.t()[start:start + rows]  # [s / tp, b]
        return torch.where(keep.unsqueeze(-1), output, output.detach())

    return model.embedding.word_embeddings.register_forward_hook(detach_padding)


def _fused_layer(spec, qk_layernorm: bool):
    """``spec`` (a local-spec layer) with :class:`~.layers.FusedRMSNorm` for every norm (the query/key
    norms only where the model has them: the spec holds an ``IdentityOp`` there otherwise) and
    :class:`~.layers.FusedSwiGLU` as the activation of its MLP, or of each expert of its MoE layer.
    megatron-core's own torch norm (``WrappedTorchNorm``) refuses sequence parallelism;
    :class:`~.layers.FusedRMSNorm` normalises whatever rows it is given."""
    from .layers import FusedRMSNorm, FusedSwiGLU

    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = FusedRMSNorm
    mlp = layer.mlp  # a ModuleSpec, or in megatron-core 0.19 a partial of MLP.as_mlp_submodule
    submodules = mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules
    experts = getattr(submodules, "experts", None)
    (experts.submodules if experts is not None else submodules).activation_func = FusedSwiGLU
    if qk_layernorm:
        attention = layer.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = FusedRMSNorm
    return spec


def _layer_spec(shape: ModelShape, experts: bool):
    """A local-spec decoder layer (:func:`_fused_layer`) with furlong's attention modules; ``experts``: with
    megatron-core's MoE layer (router, token dispatcher, ``SequentialMLP`` experts) as its MLP. A model with
    ``post_norms`` (GLM-4) gets :func:`~.layers.post_norm_layer`'s layer class, which norms each sublayer's
    output before the residual add."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from .attention import RopeSelfAttention, SDPACoreAttention

    spec = get_gpt_layer_local_spec(num_experts=shape.num_experts if experts else None, moe_grouped_gemm=False,
                                    normalization="RMSNorm", qk_layernorm=shape.qk_layernorm)
    spec.submodules.self_attention.module = RopeSelfAttention
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if shape.post_norms:
        if experts:
            raise PluginError("megatron: post-sublayer norms (GLM-4) on mixture-of-experts layers are not built yet.")
        from .layers import post_norm_layer

        spec.module = post_norm_layer()
    return _fused_layer(spec, shape.qk_layernorm)


def _block_spec(shape: ModelShape, config):
    """The decoder block of this pipeline stage (megatron-core's ``get_num_layers_to_build`` layers from its
    ``get_transformer_layer_offset``), MoE layers where ``shape.moe_layers`` has them, with the final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from .layers import FusedRMSNorm

    dense = _layer_spec(shape, experts=False)
    moe = _layer_spec(shape, experts=True) if shape.is_moe else dense
    offset = get_transformer_layer_offset(config)
    layers = [moe if offset + i in shape.moe_layers else dense for i in range(get_num_layers_to_build(config))]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=FusedRMSNorm)


def build_gpt(shape: ModelShape, tp: int, vocab_rows: int, dtype, device, pp: int = 1, cp: int = 1,
              sequence_parallel: bool = False, **extra: Any):
    """A GPTModel of the local spec with :class:`~.attention.SDPACoreAttention` and
    :class:`~.attention.RopeSelfAttention`, uninitialised weights (the caller loads them), on ``device``.

    With ``pp > 1`` (the groups of :func:`init_parallel`) it is this rank's pipeline stage:
    ``num_layers / pp`` layers (megatron-core numbers them from the stage's offset), the
    embedding on the first stage, the final norm and output layer on the last; a tied
    model's last stage holds its own copy of the embedding as output layer (megatron-core's
    ``setup_embeddings_and_output_layer``; the caller loads it and keeps it equal).
    Stages exchange activations of each micro-batch's own shape (``variable_seq_lengths``)
    one tensor at a time (no batched p2p, which gloo lacks), and every loss passes through
    the schedule unscaled (``calculate_per_token_loss``: the objective carries the step's
    denominators). With ``cp > 1`` the model takes this rank's chunks of each sequence
    (:mod:`.context`: :class:`~.attention.RopeSelfAttention` picks their RoPE positions, the attention
    gathers keys and values). With ``sequence_parallel`` (TP > 1) the activations between the
    tensor-parallel regions, and those the pipeline stages exchange, hold each TP rank's chunk of the
    sequence (of this CP rank's share under CP: megatron-core's sequence parallelism), so inputs must have
    a multiple of ``tp`` positions per CP rank. Norms and the MLP's activation are
    :mod:`.layers`' (:func:`_fused_layer`). A mixture-of-experts ``shape`` gets megatron-core's MoE layers
    on its expert layers; ``extra`` then carries their settings (:func:`~.moe.moe_transformer_fields`).

    :param vocab_rows: embedding/output rows (:func:`~.config.padded_vocab_size`).
    :param dtype: every parameter's dtype (norm scales included).
    :returns: the model; logits stay vocab-parallel (``[b, s, vocab_rows / tp]``) on the last stage, other
        stages return hidden states ``[s, b, h]``.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    stages: dict = {}
    if pp > 1:
        extra = {**dict(pipeline_model_parallel_size=pp, pipeline_dtype=dtype, variable_seq_lengths=True,
                        batch_p2p_comm=False, calculate_per_token_loss=True,
                        moe_token_dispatcher_type="alltoall"),  # the default refuses variable_seq_lengths
                 **extra}
        stages = dict(pre_process=parallel_state.is_pipeline_first_stage(),
                      post_process=parallel_state.is_pipeline_last_stage())
    if cp > 1:
        extra = dict(context_parallel_size=cp, **extra)
    sequence_parallel = sequence_parallel and tp > 1
    config = transformer_config(shape, tp, dtype, device, sequence_parallel=sequence_parallel, **extra)
    spec = _block_spec(shape, config)
    if shape.is_moe:
        from .moe import router_gemm_without_te

        router_gemm_without_te()
        # the experts' linear layers see expert TP 1 under sequence parallelism: megatron-core says it runs them
        # without it, which is what expert TP 1 means (every expert whole on each rank)
        warnings.filterwarnings("ignore", message=r".*`sequence_parallel` is set to `True`, but tensor model "
                                r"parallel size is 1", category=UserWarning)
    scaling = {"rope_scaling": True, "rope_scaling_factor": shape.rope_scaling_factor} if (
        shape.rope_scaling_factor is not None) else {}
    with cpu_shims(device):
        model = GPTModel(config, spec, vocab_size=vocab_rows, max_sequence_length=shape.max_position_embeddings,
                         parallel_output=True, share_embeddings_and_output_weights=shape.tied,
                         position_embedding_type="rope", rotary_percent=shape.rotary_percent,
                         rotary_base=shape.rotary_base,
                         **scaling, **stages)
    model = model.to(device)
    if shape.is_moe and pp > 1:  # under the schedule's per-token loss the backend scales the load-balancing loss
        for layer in model.decoder.layers:  # itself (pipeline._backend_aux_loss_scale)
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.calculate_per_token_loss = False
    for param in model.parameters():  # norm scales too (megatron-core makes them float32), as Float16Module does
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model
