"""Flags of the ``model and checkpoints`` group, with Megatron's architecture flags.

Megatron architecture flags default to None: the megatron backend then takes the value
from the ``--hf-checkpoint`` config, and compares every given value against it.
"""

from __future__ import annotations

from ._util import megatron

__all__ = ["add"]


def add(g, dev) -> None:
    """Add the flags to argument group ``g``; ``dev`` holds the machine-dependent defaults."""
    g.add_argument("--hf-checkpoint", default=None,
                   help="HF model directory: tokenizer, config, engine boot weights, fsdp weights; "
                        "also the reference model when --ref-load is absent. A local folder: Hugging Face Hub ids "
                        "are not downloaded (hf download ID --local-dir DIR first). A fine-grained FP8 checkpoint "
                        "(furlong quantize-fp8) is served FP8 by the engine; the trainer then starts from --ref-load "
                        "(BF16) (docs/fp8.md).")
    megatron(g, "--model-name", default=None,
             help="Megatron: model family for Megatron->HF weight conversion (default: from the HF config).")
    g.add_argument("--ref-load", default=None,
                   help="Frozen reference model (Megatron torch_dist dir or HF dir) and warm-start source; never an "
                        "FP8 checkpoint (docs/fp8.md).")
    megatron(g, "--ref-ckpt-step", type=int, default=None, help="Megatron: iteration of a torch_dist --ref-load to read.")
    g.add_argument("--load", default=None, help="Resume directory (the parent of iter_* directories).")
    g.add_argument("--save", default=None, help="Checkpoint directory (the parent of iter_* directories).")
    g.add_argument("--save-interval", type=int, default=100,
                   help="Rollouts between saves; needs --save (default was 10 before 0.0.8).")
    g.add_argument("--save-hf", default=None, help="Also write the weights as a Hugging Face model directory at each "
                                                   "save (a path template with {rollout_id}); needs --save.")
    g.add_argument("--save-trigger-sentinel", default=None,
                   help="At a save point, if this file exists: save now, then delete it. Needs --save.")
    g.add_argument("--save-retain-interval", type=int, default=None, metavar="N",
                   help="After each save, delete the checkpoint saved before it (iter_*, its data state, its critic) "
                        "unless its rollout id is a multiple of N, as Megatron-LM does; the newest checkpoint and "
                        "the one this run resumed from are always kept. A multiple of --save-interval; needs --save.")
    g.add_argument("--exit-interval", type=int, default=None, metavar="N",
                   help="Stop after a rollout whose count (rollout id + 1) is a multiple of N, saving a checkpoint "
                        "first under --save (Megatron-LM's --exit-interval, counted in rollouts).")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, metavar="MINUTES",
                   help="Stop after the first rollout that ends more than MINUTES after the run started, saving a "
                        "checkpoint first under --save (Megatron-LM's; checked between rollouts).")
    g.add_argument("--no-save-optim", action="store_true", help="Do not save optimizer and scheduler state.")
    g.add_argument("--no-load-optim", action="store_true", help="Do not load optimizer state.")
    g.add_argument("--no-load-rng", action="store_true", help="Do not load RNG state.")
    g.add_argument("--async-save", action="store_true",
                   help="Write each checkpoint in the background while the run goes on (weight sync, the next "
                        "rollout's generation); the trainer's next step, the next save and the run's end wait for it.")
    g.add_argument("--start-rollout-id", type=int, default=None, help="Override the rollout id to start from.")
    g.add_argument("--custom-megatron-post-save-hook-path", default=None,
                   help="module.function called as hook(args, rollout_id, ckpt_dir, hf_dir) after each save; "
                        "needs --save.")
    megatron(g, "--tokenizer-model", default=None,
             help="Megatron: tokenizer directory (default: --hf-checkpoint, which the fsdp trainer, the embedded "
                  "engine and the data always use).")
    g.add_argument("--finetune", action="store_true",
                   help="Load only the weights of the --load checkpoint: fresh optimizer, learning-rate schedule and "
                        "RNG, the run starts at rollout 0 with the data from its start (Megatron-LM's --finetune).")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="Resume from iter_<N> of --load instead of the one its latest_checkpointed_iteration.txt names.")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="Stop with an error when --load holds no checkpoint, instead of starting from the initial "
                        "weights (Megatron-LM's).")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="Megatron-LM: weights to fine-tune from when --load holds no checkpoint; not supported: "
                        "pass that directory as --ref-load.")
    megatron(g, "--use-checkpoint-opt_param-scheduler", action="store_true",
             help="Megatron: take the LR schedule from the checkpoint.")
    megatron(g, "--override-opt_param-scheduler", action="store_true",
             help="Megatron: take the LR schedule from the flags, not the checkpoint.")
    _architecture(g)


def _architecture(g) -> None:
    """Megatron architecture constants (MODEL_ARGS of a Miles script)."""
    for flag, kind, text in (
        ("--num-layers", int, "transformer layers"),
        ("--hidden-size", int, "hidden size"),
        ("--ffn-hidden-size", int, "MLP hidden size"),
        ("--num-attention-heads", int, "attention heads"),
        ("--num-query-groups", int, "key/value heads under --group-query-attention"),
        ("--kv-channels", int, "projection size per head"),
        ("--rotary-base", int, "RoPE theta"),
        ("--rotary-percent", float, "fraction of the head dimension rotated, in (0, 1]"),
        ("--norm-epsilon", float, "normalization epsilon"),
        ("--vocab-size", int, "vocabulary size"),
        ("--padded-vocab-size", int, "vocabulary size after padding"),
        ("--num-experts", int, "MoE experts"),
        ("--moe-router-topk", int, "experts per token"),
        ("--moe-ffn-hidden-size", int, "MoE expert MLP hidden size"),
        ("--mtp-num-layers", int, "multi-token-prediction layers"),
    ):
        megatron(g, flag, type=kind, default=None, help=f"Megatron: {text} (default: from the HF config).")
    megatron(g, "--seq-length", type=int, default=4096, help="Megatron: maximum sequence length.")
    megatron(g, "--max-position-embeddings", type=int, default=None,
             help="Megatron: position table size (default: --seq-length).")
    megatron(g, "--make-vocab-size-divisible-by", type=int, default=None,
             help="Megatron: pad the vocabulary to a multiple of this (default: Megatron's).")
    megatron(g, "--moe-aux-loss-coeff", type=float, nargs="+", default=None,
             help="Megatron: MoE load-balancing loss coefficient, one or one per --moe-router-load-balancing-type "
                  "(default: Megatron's).")
    megatron(g, "--position-embedding-type", default=None, choices=["learned_absolute", "rope", "mrope", "none"],
             help="Megatron: position embedding.")
    megatron(g, "--normalization", default=None, choices=["LayerNorm", "RMSNorm"], help="Megatron: normalization.")
    megatron(g, "--moe-token-dispatcher-type", default="alltoall", choices=["allgather", "alltoall", "flex"],
             help="Megatron: MoE token dispatcher (allgather is rewritten to alltoall).")
    megatron(g, "--spec", nargs=2, default=None, metavar=("MODULE", "FN"),
             help="Megatron: layer spec provider function.")
    for flag, text in (
        ("--group-query-attention", "grouped-query attention"),
        ("--use-rotary-position-embeddings", "RoPE (legacy spelling of --position-embedding-type rope)"),
        ("--swiglu", "SwiGLU MLP"),
        ("--disable-bias-linear", "no bias in linear layers"),
        ("--add-qkv-bias", "bias in the QKV projection only"),
        ("--qk-layernorm", "normalize queries and keys"),
        ("--untie-embeddings-and-output-weights", "separate input and output embeddings"),
        ("--moe-grouped-gemm", "grouped GEMM for experts"),
    ):
        megatron(g, flag, action="store_true", help=f"Megatron: {text}.")
