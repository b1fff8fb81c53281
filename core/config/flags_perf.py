"""Flags of the ``performance`` group: dynamic batching, FSDP options, and Megatron
parallelism, recompute and numerics."""

from __future__ import annotations

import argparse

from ._util import megatron

__all__ = ["add"]


def add(g, dev) -> None:
    """Add the flags to argument group ``g``; ``dev`` holds the machine-dependent defaults."""
    g.add_argument("--use-dynamic-batch-size", action="store_true",
                   help="Pack samples into micro-batches under --max-tokens-per-gpu (overrides --micro-batch-size).")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="Token cap per micro-batch per device (x context-parallel size); required with "
                        "--use-dynamic-batch-size.")
    g.add_argument("--log-probs-max-tokens-per-gpu", type=int, default=None,
                   help="Token cap per micro-batch of the forward-only log-prob passes (reference and pi_old) when "
                        "micro-batches are packed by tokens (default: --max-tokens-per-gpu); the log-probs are the "
                        "same whatever the cap.")
    g.add_argument("--balance-by-flops", action="store_true",
                   help="FLOPs-weighted micro-batch partitioning (not supported yet).")
    g.add_argument("--qkv-format", choices=["thd", "bshd"], default="thd",
                   help="Attention input layout: packed thd, or padded bshd (not supported yet).")
    g.add_argument("--gradient-checkpointing", action="store_true", help="FSDP: recompute activations.")
    g.add_argument("--fsdp-cpu-offload", action="store_true", help="FSDP: keep parameters and optimizer on CPU.")
    g.add_argument("--train-torch-compile", action=argparse.BooleanOptionalAction, default=False,
                   help="Compile each decoder layer of the train backend's model with torch.compile (inductor) for "
                        "the training and log-prob passes: fused norms, rotary embedding, activations and residual "
                        "adds, and far fewer kernel launches, for a compilation at the start (15-18 s for a 0.5B "
                        "model on an H200, 4-6 s from inductor's cache; 10-30 s for the demo model on a CPU, by "
                        "machine). fsdp, one trainer process (not supported yet under FSDP2 across ranks, nor with "
                        "megatron, where it measured slower); turns the CPU's prompt sharing off. On by default on a "
                        "GPU for runs of 20 rollouts or more (--print-config: machine_defaults); "
                        "--no-train-torch-compile keeps it off.")
    g.add_argument("--fsdp-cpu-backend", default="gloo",
                   help="FSDP: collective backend for CPU-offloaded state (not supported yet).")
    g.add_argument("--dp-replicate-size", type=int, default=1,
                   help="FSDP: replicas (HSDP); must divide the trainer world size.")
    g.add_argument("--attn-implementation", default=dev.attn_implementation,
                   help="FSDP: transformers attention implementation (sdpa without CUDA).")
    g.add_argument("--keep-fp32-master", action=argparse.BooleanOptionalAction, default=True,
                   help="Under --bf16, keep float32 master weights for the optimizer; --no-keep-fp32-master "
                        "trains the bfloat16 parameters in place (fsdp and megatron).")
    g.add_argument("--train-memory-margin-bytes", type=int, default=1 << 30,
                   help="Memory kept free when offloading, in bytes.")
    g.add_argument("--reuse-train-log-probs", action=argparse.BooleanOptionalAction, default=True,
                   help="A rollout trained in one optimizer step takes pi_old from its training forward (detached) "
                        "instead of a separate forward-only pass, when nothing reads pi_old before training "
                        "(no reference model, no --use-opd, an advantage estimator that does not read it) and the "
                        "backend's training forward equals its log-prob forward; --no-reuse-train-log-probs keeps "
                        "the pass.")
    g.add_argument("--skip-zero-advantage-samples", action=argparse.BooleanOptionalAction, default=True,
                   help="Leave out of the training forward and backward the samples whose advantage is 0 on every "
                        "trained token (a GRPO group whose samples all got one reward): their loss is 0, they still "
                        "count in the loss denominators, so the gradient is unchanged. On unless the loss might "
                        "not vanish at zero advantage (--loss-type other than policy_loss, --entropy-coef, "
                        "--use-kl-loss, a loss reducer), where it turns itself off (and is refused if given). "
                        "Metrics other than loss and pg_loss (entropy, clip fraction, train/rollout log-prob "
                        "differences; rollout/log_probs and rollout/entropy when pi_old comes from the training "
                        "forward) are then means over the trained samples.")
    g.add_argument("--bf16", action="store_true", default=dev.bf16,
                   help="Train in bfloat16 (the default with CUDA; fp32 without): bfloat16 parameters over float32 "
                        "master weights in one process (fsdp on CPU too; megatron always), FSDP2's bfloat16 "
                        "compute over float32 shards across GPU ranks.")
    g.add_argument("--fp16", action="store_true", help="Train in float16 (turns bf16 off).")
    for flag, default, text in (
        ("--tensor-model-parallel-size", 1,
         "tensor-parallel size (values > 1 may add --sequence-parallel)"),
        ("--pipeline-model-parallel-size", 1, "pipeline-parallel size"),
        ("--virtual-pipeline-model-parallel-size", None, "virtual pipeline stages per rank"),
        ("--context-parallel-size", 1, "context-parallel size (the fsdp backend needs 1)"),
        ("--expert-model-parallel-size", 1, "expert-parallel size"),
        ("--expert-tensor-parallel-size", None, "tensor-parallel size inside experts"),
        ("--recompute-num-layers", None, "layers per recompute unit"),
    ):
        megatron(g, flag, type=int, default=default, help=f"Megatron: {text}.")
    megatron(g, "--sequence-parallel", action="store_true",
             help="Megatron: sequence parallelism with --tensor-model-parallel-size > 1 (megatron "
                  "backend; a warning at TP 1; the fsdp backend ignores it with a warning).")
    megatron(g, "--recompute-granularity", choices=["full", "selective"], default=None,
             help="Megatron: activation recompute granularity.")
    megatron(g, "--recompute-method", choices=["uniform", "block"], default=None,
             help="Megatron: activation recompute method.")
    megatron(g, "--attention-dropout", type=float, default=None, help="Megatron: attention dropout, in [0, 1).")
    megatron(g, "--hidden-dropout", type=float, default=None, help="Megatron: hidden dropout, in [0, 1).")
    megatron(g, "--attention-backend", default=None, choices=["flash", "fused", "unfused", "local", "auto"],
             help="Megatron: attention kernel.")
    for flag, text in (
        ("--overlap-grad-reduce", "overlap gradient reduce-scatter with backward"),
        ("--overlap-param-gather", "overlap parameter all-gather with forward"),
        ("--use-distributed-optimizer", "shard the AdamW moments over the data-parallel x context-parallel ranks "
         "(megatron backend, ZeRO stage 1; the fsdp backend ignores it with a warning: FSDP2 shards optimizer state "
         "already)"),
        ("--attention-softmax-in-fp32", "attention softmax in fp32"),
        ("--accumulate-allreduce-grads-in-fp32", "accumulate and all-reduce gradients in fp32"),
    ):
        megatron(g, flag, action="store_true", help=f"Megatron: {text}.")
