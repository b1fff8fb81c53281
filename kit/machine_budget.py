"""Defaults that follow the machine: a train micro-batch's token budget from the GPU's memory.

A train backend's ``configure`` calls :func:`token_budget` when the run packs micro-batches
by tokens without ``--max-tokens-per-gpu`` and the machine has CUDA, and sets the flag
with :meth:`furlong.hooks.ConfigReport.machine_default`. The estimate reads only file
headers (``config.json`` and the safetensors headers of ``--hf-checkpoint``), so it costs
nothing before the model loads.

Memory model (bytes; ``N`` parameters, a micro-batch of ``T`` tokens):

- fixed: ``18 N`` for training (bfloat16 parameters, float32 master weights, float32
  gradients, Adam's two float32 moments) plus ``2 N`` for the engine's bfloat16 copy;
- per token: ``4 V / TP`` (the float32 logits and their gradient over the vocabulary
  ``V``, sharded by tensor parallelism) plus ``16 L H`` (the bfloat16 activations kept for
  the backward pass, ``L`` layers of width ``H``).

The per-token constants fit the peaks measured on one H200 at the Qwen2.5-0.5B shape
(docs/benchmarks.md, "Defaults that follow the machine"): 26 GiB at 8,192 tokens and 48 GiB
at 32,768 tokens under the fsdp backend, about 0.92 MB per token. Half of what is free
after the fixed part goes to one micro-batch (the engine's key/value cache, the
allocator's fragmentation and the reference model take the rest); the budget is that
many tokens rounded down to a power of two, between :data:`MIN_BUDGET` and
:data:`MAX_BUDGET`.
"""

from __future__ import annotations

import json
import math
import os
import struct

import attrs

from furlong.hooks.config_report import Machine

__all__ = ["COMPILE_PAYS_AFTER_ROLLOUTS", "MAX_BUDGET", "MIN_BUDGET", "ModelSize", "bytes_per_token",
           "default_token_budget", "fixed_bytes", "long_enough_to_compile", "model_size", "token_budget"]

MIN_BUDGET = 8192
"""The budget of the core's default packing: a machine-following budget is never below it."""
MAX_BUDGET = 65536
"""Larger micro-batches gain nothing measurable on an H200 at the shapes measured (one
micro-batch already fills the GPU), and cost memory."""

TRAIN_BYTES_PER_PARAM = 18
ENGINE_BYTES_PER_PARAM = 2
SHARE_FOR_ONE_MICRO_BATCH = 0.5


@attrs.frozen
class ModelSize:
    """What the budget needs to know of a Hugging Face model directory."""

    parameters: int
    layers: int
    hidden: int
    vocab: int


def model_size(path: str) -> ModelSize | None:
    """Parameter count (safetensors headers) and shape (``config.json``) of the model in ``path``.

    :returns: None when ``path`` has no readable ``config.json`` or no ``*.safetensors`` file
        (the backend's own loading reports what is wrong, later and with the details).
    """
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
            config = json.load(handle)
        files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
        parameters = sum(_parameters_in(os.path.join(path, name)) for name in files)
    except (OSError, ValueError, struct.error):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    try:
        return ModelSize(parameters, int(text["num_hidden_layers"]), int(text["hidden_size"]),
                         int(text["vocab_size"])) if parameters else None
    except (KeyError, TypeError, ValueError):
        return None


def _parameters_in(file: str) -> int:
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def bytes_per_token(size: ModelSize, tensor_parallel: int = 1) -> int:
    """Bytes one token of a micro-batch holds at the peak of a train step (see the module's memory model)."""
    return 4 * size.vocab // tensor_parallel + 16 * size.layers * size.hidden


def fixed_bytes(size: ModelSize, state_shards: int = 1) -> int:
    """Bytes of one rank's training state and engine weights (the module's fixed part), sharded over ``state_shards``."""
    return (TRAIN_BYTES_PER_PARAM + ENGINE_BYTES_PER_PARAM) * size.parameters // state_shards


def token_budget(machine: Machine, size: ModelSize, tensor_parallel: int = 1,
                 state_shards: int = 1) -> tuple[int, str] | None:
    """The token budget of one micro-batch on ``machine``'s first GPU, and why, or None without CUDA.

    :param tensor_parallel: ranks that share one layer's weights (the logits divide by it).
    :param state_shards: ranks the training state (the fixed part) is sharded over: FSDP's
        world size, Megatron's TP x PP.
    :returns: ``(tokens, why)``: ``tokens`` a power of two in ``[MIN_BUDGET, MAX_BUDGET]``;
        ``why`` one sentence with the probe and the arithmetic, for ``--print-config``.
    """
    if not machine.cuda or machine.gpu_free_bytes <= 0:
        return None
    fixed = fixed_bytes(size, state_shards)
    per_token = bytes_per_token(size, tensor_parallel)
    room = max(machine.gpu_free_bytes - fixed, 0) * SHARE_FOR_ONE_MICRO_BATCH
    fits = int(room // per_token)
    tokens = min(max(1 << max(fits.bit_length() - 1, 0), MIN_BUDGET), MAX_BUDGET)
    why = (f"{machine.describe()}; model {size.parameters / 1e9:.2f}B parameters: {fixed / 2**30:.1f} GiB for "
           f"weights, gradients and optimizer state, {per_token / 2**20:.2f} MiB per token of a micro-batch; half "
           f"of the rest holds {fits} tokens, rounded down to a power of two within "
           f"[{MIN_BUDGET}, {MAX_BUDGET}]")
    return tokens, why


def default_token_budget(args, report, tensor_parallel: int = 1, state_shards: int = 1) -> None:
    """In a backend's ``configure``: on CUDA, when the run packs micro-batches by the core's default
    budget (neither ``--max-tokens-per-gpu`` nor a micro-batch rule given), set
    ``--max-tokens-per-gpu`` from the machine (:func:`token_budget`) as a machine default; and,
    whatever the packing, warn when the training state alone (:func:`fixed_bytes`) exceeds the
    GPU's free memory."""
    if not report.machine.cuda:
        return
    size = model_size(args.hf_checkpoint or "")
    fixed = fixed_bytes(size, state_shards) if size else 0
    if fixed > report.machine.gpu_free_bytes > 0:
        report.warn(f"the training state of {size.parameters / 1e9:.2f}B parameters needs about {fixed / 2**30:.1f} GiB "
                    f"per GPU ({TRAIN_BYTES_PER_PARAM} bytes per parameter for training and {ENGINE_BYTES_PER_PARAM} "
                    f"for the engine's weights, over {state_shards} rank(s)), more than the "
                    f"{report.machine.gpu_free_bytes / 2**30:.1f} GiB free: expect running out of memory; train "
                    "on more GPUs, or offload the optimizer state to the host (--fsdp-cpu-offload with --train-backend fsdp, "
                    "--use-distributed-optimizer --optimizer-cpu-offload with megatron).")
    if args.packed_by_default != "the default budget":
        return
    budget = token_budget(report.machine, size, tensor_parallel, state_shards) if size else None
    if budget is not None:
        report.machine_default(args, "max_tokens_per_gpu", *budget)


COMPILE_PAYS_AFTER_ROLLOUTS = 20
"""Compilation (``--train-torch-compile``, ``--embedded-torch-compile``) is a machine default on CUDA
for runs of at least this many rollouts: its warm-up (tens of seconds on an H200) is repaid
within that many steps at the measured gains (docs/benchmarks.md)."""


def long_enough_to_compile(args, report) -> str | None:
    """Why compiling is the default for this run (CUDA and ``--num-rollout`` of at least
    :data:`COMPILE_PAYS_AFTER_ROLLOUTS`), or None when it is not."""
    rollouts = args.num_rollout or 0
    if not report.machine.cuda or rollouts < COMPILE_PAYS_AFTER_ROLLOUTS:
        return None
    return (f"{report.machine.describe()}; --num-rollout {rollouts} >= {COMPILE_PAYS_AFTER_ROLLOUTS}: the "
            f"compilation's warm-up is repaid")
