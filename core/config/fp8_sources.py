"""BF16 training with FP8 rollouts: which checkpoint each side starts from, and what each side runs.

The recipe (Miles' low-precision rollouts): ``--hf-checkpoint`` is a fine-grained FP8 checkpoint
(:mod:`furlong.kit.fp8`) that the rollout engine serves; the trainer starts from the BF16 model,
``--ref-load`` (a Hugging Face directory, or a ``torch_dist`` checkpoint for megatron), or resumes
a ``--load`` checkpoint; each weight sync sends the trainer's BF16 weights, which the engine
quantises. The trainer never loads FP8 weights as its policy or its KL reference: the reference
would be the rounded model, not the one the policy is trained from (the KL anchor moves).
"""

from __future__ import annotations

import json
import os

from furlong.kit.fp8 import fp8_quantization_config, supported_config_problem
from furlong.kit.start_weights import torch_dist_dir

__all__ = ["fp8_sources", "precision_summary"]

MARKER_NAME = "latest_checkpointed_iteration.txt"
"""The file a ``--load`` directory with a saved checkpoint holds (core/run/checkpoints.py)."""

FP8_WORDS = "fp8 e4m3 weights with 128 x 128 block scales, dynamic 1 x 128 activation scales"


def _kl_users(args) -> list[str]:
    users = ["--use-kl-loss"] if args.use_kl_loss else []
    return users + ([f"--kl-coef {args.kl_coef:g}"] if args.kl_coef else [])


def fp8_sources(args, f) -> None:
    """An FP8 ``--ref-load``, or an FP8 ``--hf-checkpoint`` with no BF16 trainer source, is an error;
    an FP8 ``--hf-checkpoint`` in a format furlong does not run is one too."""
    ref = fp8_quantization_config(args.ref_load)
    if ref is not None:
        f.error(f"--ref-load {args.ref_load} is an FP8 checkpoint (quantization_config quant_method fp8): the "
                "trainer would start from, and keep as its KL reference, the FP8-rounded weights instead of the BF16 "
                "model, which changes the KL anchor. Point --ref-load at the BF16 model (a Hugging Face directory, "
                "or a torch_dist checkpoint for megatron) and keep the FP8 directory as --hf-checkpoint for the "
                "rollout engine.")
        return
    quant = fp8_quantization_config(args.hf_checkpoint)
    if quant is None:
        return
    problem = supported_config_problem(quant, f"--hf-checkpoint {args.hf_checkpoint}")
    if problem:
        f.error(problem)
    if args.ref_load or args.debug_rollout_only:  # (a rollout-only run starts no trainer)
        return
    users = _kl_users(args)
    resumes = bool(args.load) and os.path.isfile(os.path.join(args.load, MARKER_NAME))
    if users:
        f.error(f"--hf-checkpoint {args.hf_checkpoint} is an FP8 checkpoint and there is no --ref-load: "
                f"{' and '.join(users)} would take the FP8-rounded weights as the KL reference, which changes the KL "
                "anchor. Give the BF16 model as --ref-load (the trainer starts from it and keeps it as the "
                "reference; the engine serves the FP8 directory).")
    elif not resumes:
        f.error(f"--hf-checkpoint {args.hf_checkpoint} is an FP8 checkpoint and the trainer has no BF16 source: it "
                "would train the FP8-rounded weights. Give the BF16 model as --ref-load (a Hugging Face directory, "
                "or a torch_dist checkpoint for megatron), or --load a saved checkpoint to resume.")


def _dtype_of(path: str | None) -> str:
    """The dtype config.json of ``path`` records (``torch_dtype`` or ``dtype``); "torch_dist" for a
    megatron checkpoint without config.json; "unknown" for an unreadable one or one that holds neither."""
    if not os.path.isfile(os.path.join(str(path), "config.json")) and torch_dist_dir(path):
        return "torch_dist"
    try:
        with open(os.path.join(str(path), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return "unknown"
    return str(config.get("torch_dtype") or config.get("dtype") or "unknown")


def precision_summary(args) -> dict:
    """What ``--print-config`` shows under ``precision``: the rollout side's weights, the trainer's
    compute precision and where its weights come from."""
    fp8 = fp8_quantization_config(args.hf_checkpoint) is not None
    rollout = (f"{FP8_WORDS} (--hf-checkpoint {args.hf_checkpoint}); weight syncs send the trainer's weights, "
               "quantised into the same blocks by the engine" if fp8 else
               f"{_dtype_of(args.hf_checkpoint)} checkpoint (--hf-checkpoint {args.hf_checkpoint}), run in the "
               "engine's dtype")
    trainer = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if args.ref_load:
        source = f"--ref-load {args.ref_load} ({_dtype_of(args.ref_load)})"
    elif fp8:
        source = f"--load {args.load} (resumed checkpoint)"
    else:
        source = f"--hf-checkpoint {args.hf_checkpoint} ({_dtype_of(args.hf_checkpoint)})"
    return {"rollout": rollout, "trainer": f"{trainer} compute, weights from {source}"}
