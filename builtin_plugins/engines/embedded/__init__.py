"""Embedded rollout engine: batched generation with a Hugging Face transformers model in this process.

Meant for CPU runs, tests and small models; SGLang serves production. The sampling
semantics follow the ``sampling_params`` of SGLang's native API; see :mod:`.sampling`.
Mixture-of-experts models (Qwen3-MoE and the other transformers families with fused
experts) run with the same batching and CUDA graphs; see :mod:`.experts`.
"""

from __future__ import annotations

import argparse

import logging

from furlong.hooks import PluginError, hookimpl
from furlong.kit.hf import load_causal_lm_weights, load_tokenizer, non_full_attention
from furlong.kit.fp8 import fp8_quantization_config
from furlong.kit.machine_budget import long_enough_to_compile

from .engine import EmbeddedEngine

__all__ = ["EmbeddedEngine", "add_arguments", "configure", "load_engine", "rollout_engine"]

log = logging.getLogger("furlong.engines.embedded")

PLUGIN = "embedded"


@hookimpl
def add_arguments(parser):
    """Add ``--embedded-max-batch-size``, ``--embedded-torch-compile`` and ``--embedded-decode-kernels`` (group
    "embedded")."""
    group = parser.add_argument_group("embedded")
    group.add_argument(
        "--embedded-max-batch-size", type=int, default=64,
        help="Most generate requests the embedded engine decodes together in one batch.",
    )
    group.add_argument(
        "--embedded-torch-compile", action=argparse.BooleanOptionalAction, default=False,
        help="Run the embedded engine's decode step through torch.compile (inductor), then capture it in CUDA "
             "graphs: fused kernels, a faster step on a GPU, for a compilation at the start (14 s for a 0.5B model "
             "on an H200, 27-36 s for the demo model on a CPU). On by default on a GPU for runs of 20 "
             "rollouts or more (--print-config: machine_defaults); --no-embedded-torch-compile keeps it off.",
    )
    group.add_argument(
        "--embedded-decode-kernels", action=argparse.BooleanOptionalAction, default=True,
        help="On CUDA, decode with furlong's Triton attention and sampling kernels and one product for each "
             "layer's query/key/value and gate/up projections (1.5x tokens/s at a 0.5B model's shape on an "
             "H100); --no-embedded-decode-kernels runs torch's attention and sampler and the separate "
             "projections. No effect without CUDA.",
    )


@hookimpl
def configure(args, report):
    """The engine runs in this process: there are no external servers to attach to.

    On CUDA two defaults follow the machine (``--print-config``: ``machine_defaults``): the
    batch holds a whole rollout (``--embedded-max-batch-size`` = the larger of the rollout's and
    over-sampling's prompts x ``--n-samples-per-prompt``, at most :data:`MAX_SLOTS_BY_DEFAULT`;
    slots are allocated as requests arrive, so an unused one costs nothing), and
    ``--embedded-torch-compile`` is on for runs long enough to repay its warm-up.
    """
    if args.rollout_external or args.rollout_external_engine_addrs:
        report.error("--rollout-external and --rollout-external-engine-addrs attach to SGLang servers: they need "
                     "--rollout-backend sglang.")
    if args.embedded_max_batch_size < 1:
        report.error(f"--embedded-max-batch-size must be at least 1, got {args.embedded_max_batch_size}.")
    if not report.machine.cuda:
        return
    prompts = max(args.rollout_batch_size, args.over_sampling_batch_size or 0)
    rollout = min(prompts * args.n_samples_per_prompt, MAX_SLOTS_BY_DEFAULT)
    if rollout > args.embedded_max_batch_size:
        report.machine_default(args, "embedded_max_batch_size", rollout,
                               f"{report.machine.describe()}: one rollout ({prompts} prompts x "
                               f"{args.n_samples_per_prompt} samples, at most {MAX_SLOTS_BY_DEFAULT}) decodes at once")
    why = long_enough_to_compile(args, report)
    fp8 = fp8_quantization_config(args.hf_checkpoint) is not None
    if why and fp8 and not report.given(args, "embedded_torch_compile"):
        report.info("--embedded-torch-compile stays off by default for an FP8 --hf-checkpoint: its FP8 layers have "
                    "not been measured under torch.compile yet; give --embedded-torch-compile to try it.")
    elif why:
        report.machine_default(args, "embedded_torch_compile", True, why)


MAX_SLOTS_BY_DEFAULT = 1024


@hookimpl
def rollout_engine(config, engine_index):
    """Create the embedded engine from ``--hf-checkpoint`` (its own copy of the weights).

    Flags read: ``--hf-checkpoint``, ``--bf16``/``--fp16`` (CUDA only; CPU runs float32),
    ``--embedded-max-batch-size``, ``--embedded-torch-compile``, ``--embedded-decode-kernels``, ``--seed`` (engine ``engine_index``
    seeds its sampling with ``seed + engine_index``), ``--use-rollout-routing-replay`` (record
    each fed token's experts: ``GenerateOutput.routed_experts``).

    :returns: an :class:`EmbeddedEngine` (meets :class:`furlong.hooks.RolloutEngine`).
    :raises PluginError: ``--hf-checkpoint`` is missing or cannot be loaded, or
        ``--use-rollout-routing-replay`` with a model that has no mixture-of-experts layer.
    """
    own = config.plugin_config(PLUGIN)
    return load_engine(
        config.hf_checkpoint,
        max_batch_size=int(own.embedded_max_batch_size),
        half=not config.fp16 and config.bf16,
        fp16=config.fp16,
        seed=config.seed + int(engine_index),
        compile="inductor" if own.embedded_torch_compile else None,
        record_routing=bool(config.use_rollout_routing_replay),
        decode_kernels=bool(own.embedded_decode_kernels),
    )


def load_engine(path: str | None, max_batch_size: int = 64, half: bool = True, fp16: bool = False,
                seed: int = 0, compile: str | None = None, record_routing: bool = False,
                experts: tuple[str, str] | None = None, fp8_gemm: str = "auto",
                decode_kernels: bool = True) -> EmbeddedEngine:
    """Load model and tokenizer from the Hugging Face directory ``path`` into an engine.

    On CUDA the model runs in bfloat16 when ``half`` (float16 when ``fp16``), else float32;
    on CPU always float32. Attention is ``sdpa`` when the model supports it, else eager.
    ``compile``: None, or the ``torch.compile`` backend of the decode step (see
    :class:`~.decode.SlotDecoder`). ``record_routing``, ``experts`` and ``decode_kernels``
    (``--embedded-decode-kernels``): see :class:`EmbeddedEngine`.

    A fine-grained FP8 checkpoint (``quantization_config`` with ``quant_method`` "fp8",
    :mod:`furlong.kit.fp8`) runs its quantised linear layers as FP8 layers (:mod:`.fp8`): FP8
    products with block scales on CUDA (``fp8_gemm``: "auto", "scaled_mm" or "triton",
    :func:`.fp8_kernels.choose_gemm`), the dequantised weights on a CPU; the rest in the dtype above.

    :raises PluginError: ``path`` is None or not a loadable model directory, an FP8 format
        furlong does not run, or ``record_routing`` with a dense model.
    """
    import torch

    if not path:
        raise PluginError("--rollout-backend embedded needs --hf-checkpoint (a Hugging Face model directory).")
    cuda = torch.cuda.is_available()
    dtype = (torch.float16 if fp16 else torch.bfloat16 if half else torch.float32) if cuda else torch.float32
    tokenizer = load_tokenizer(path)
    model = load_causal_lm_weights(path, "--hf-checkpoint", ("sdpa", "eager"), dtype=dtype)
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise PluginError(f"--hf-checkpoint {path}: the tokenizer has {len(tokenizer)} tokens but the model's "
                          f"embedding only {vocab} rows; the tokenizer files and the model do not belong together.")
    if fp8_quantization_config(path) is not None:
        from .fp8 import install_fp8_layers

        layers = install_fp8_layers(model, path, "cuda" if cuda else "cpu", fp8_gemm)
        log.info("embedded engine: %s: %d FP8 linear layers (e4m3, 128 x 128 blocks, %s)", path, layers,
                 "dynamic 1 x 128 activation scales" if cuda else "dequantised on the CPU")
    if non_full_attention(model.config):
        log.warning("embedded engine: %s has sliding-window (or other not fully causal) attention layers; the "
                    "engine attends to every earlier position, so a response that outgrows the window is sampled "
                    "with more context than the trainer's log-probs see.", path)
    if cuda:
        model = model.to("cuda")
    return EmbeddedEngine(model, tokenizer, max_batch_size=max_batch_size, seed=seed, compile=compile,
                          record_routing=record_routing, experts=experts, decode_kernels=decode_kernels)
