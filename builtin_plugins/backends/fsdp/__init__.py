"""fsdp train backend: Hugging Face transformers models trained with torch (FSDP2 across ranks; CPU with gloo)."""

from __future__ import annotations

from furlong.hooks import MegatronFlags, hookimpl
from furlong.kit.machine_budget import default_token_budget, long_enough_to_compile

from .backend import FSDPBackend
from .critic import FSDPCritic

__all__ = ["ATTENTION_IMPLEMENTATIONS", "MEGATRON_FLAGS", "FSDPBackend", "FSDPCritic", "configure", "critic_backend",
           "train_backend"]

# Of the backend flags LoRA's (peft, lora.py), --sgd-momentum (--optimizer sgd) and
# --no-check-for-nan-in-loss-and-grad (the step loop skips a non-finite step) are read;
# --context-parallel-size and --fp16 are refused by configure below; the model trains without dropout (eval mode), which is what
# dropout 0 asks; transformers keeps an MoE router's expert bias (e_score_correction_bias) as a
# buffer the optimizer never updates, which is what --moe-router-bias-update-rate 0 asks; the model
# comes from the --hf-checkpoint config, against which the core checks the architecture flags given.
MEGATRON_FLAGS = MegatronFlags(
    honours=frozenset({"lora_rank", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules",
                       "context_parallel_size", "fp16", "sgd_momentum", "check_for_nan_in_loss_and_grad"}),
    at_values={"attention_dropout": (0.0,), "hidden_dropout": (0.0,), "moe_router_bias_update_rate": (0.0,)},
    architecture_from_hf=True)


# the names transformers' from_pretrained takes (a "namespace/repo" names a kernels hub repository)
ATTENTION_IMPLEMENTATIONS = frozenset({"eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4",
                                       "flex_attention"})


@hookimpl
def configure(args, report):
    """No context parallelism, no ``--fp16``; ``--dp-replicate-size`` (HSDP replicas) must divide the
    trainer world size; ``--train-torch-compile`` with one trainer rank only.

    Data parallelism: every rank holds a shard of the whole model and trains on its own
    share of each step (replicated or sharded, ``--dp-replicate-size``), so the data-parallel
    size is the world size (``report.data_parallel_rule()`` with no model-parallel sizes).

    ``--attn-implementation`` must name one of transformers' attention implementations
    (:data:`ATTENTION_IMPLEMENTATIONS`, or a kernels hub repository ``namespace/name``); it
    defaults to ``sdpa``, with which on GPUs under ``--bf16`` each micro-batch is concatenated
    into one row (:mod:`.packing`; on an H200 1.4x the iteration rate of right-padded ones,
    docs/benchmarks.md)."""
    report.data_parallel_rule()
    attention = args.attn_implementation
    if attention not in ATTENTION_IMPLEMENTATIONS and "/" not in str(attention):
        report.error(f"--attn-implementation {attention!r}: not an attention implementation of transformers; choose "
                     f"{', '.join(sorted(ATTENTION_IMPLEMENTATIONS))}, or a kernels hub repository such as "
                     "kernels-community/flash-attn.")
    elif not report.given(args, "attn_implementation") and attention != "sdpa":
        report.default(args, "attn_implementation", "sdpa")
        report.info("--train-backend fsdp: --attn-implementation sdpa: on GPUs under --bf16 each micro-batch is "
                    "concatenated into one row for torch's variable-length flash-attention kernel (give "
                    "--attn-implementation flash_attention_2 to train right-padded micro-batches through the "
                    "flash-attn package).")
    _check_expert_bias_updates(args, report)
    if args.context_parallel_size > 1:
        report.error(f"--train-backend fsdp does not support --context-parallel-size {args.context_parallel_size}; "
                     f"use 1 or --train-backend megatron.")
    if getattr(args, "fp16", False):
        report.error("--fp16 is not supported yet by --train-backend fsdp; use --bf16 (bfloat16 parameters over "
                     "float32 master weights) or neither (float32).")
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    if getattr(args, "train_torch_compile", False) and world > 1:
        report.error(f"--train-torch-compile with {world} trainer ranks is not supported yet (FSDP2's sharded "
                     "layers are not compiled); use it with one trainer process.")
    if args.dp_replicate_size >= 1 and world % args.dp_replicate_size:
        report.error(f"--dp-replicate-size ({args.dp_replicate_size}) must divide the trainer world size {world}.")
    _follow_machine(args, report, world)


def _follow_machine(args, report, world: int) -> None:
    """On CUDA: the micro-batch token budget from the GPU's memory, and ``--train-torch-compile`` on a single
    trainer rank for runs long enough to repay it (docs/benchmarks.md, "Defaults that follow the machine")."""
    shards = max(world // max(args.dp_replicate_size, 1), 1)
    default_token_budget(args, report, state_shards=shards)
    why = long_enough_to_compile(args, report)
    if why and world == 1 and not args.fsdp_cpu_offload:
        report.machine_default(args, "train_torch_compile", True, why)


MEGATRON_BIAS_UPDATE_RATE = 1e-3
"""Megatron-LM's default ``--moe-router-bias-update-rate``."""


def _check_expert_bias_updates(args, report) -> None:
    """``--moe-router-enable-expert-bias`` makes Megatron move each expert's routing bias after every step by
    ``--moe-router-bias-update-rate`` (aux-loss-free load balancing, DeepSeek-V3); transformers keeps that bias as a
    buffer no step updates, so here only a rate of 0 trains what Megatron would."""
    given = args.megatron_args or {}
    if given.get("moe_router_enable_expert_bias") and "moe_router_bias_update_rate" not in given:
        # a rate given other than 0 is the core's error (MEGATRON_FLAGS.at_values)
        report.error(f"--moe-router-enable-expert-bias with Megatron's default --moe-router-bias-update-rate "
                     f"{MEGATRON_BIAS_UPDATE_RATE:g}: updating the experts' routing bias after each step is not "
                     "supported yet by --train-backend fsdp (the checkpoint's bias stays fixed); pass "
                     "--moe-router-bias-update-rate 0 to train with it fixed.")


@hookimpl
def train_backend(config):
    """Create the fsdp backend; :meth:`FSDPBackend.init` loads the model.

    Flags read: ``--hf-checkpoint``, ``--ref-load``, ``--use-kl-loss``, ``--kl-coef``,
    ``--optimizer``, ``--lr``, ``--min-lr``, ``--lr-decay-style``, ``--lr-decay-iters``,
    ``--lr-warmup-iters``, ``--lr-warmup-fraction``, ``--lr-warmup-init``,
    ``--weight-decay``, ``--adam-beta1``, ``--adam-beta2``, ``--adam-eps``,
    ``--clip-grad``, ``--num-rollout`` and the batch knobs (total steps),
    ``--micro-batch-size``, ``--entropy-coef``, ``--reset-optimizer-states``,
    ``--no-check-for-nan-in-loss-and-grad``, ``--no-save-optim``, ``--no-load-optim``,
    ``--no-load-rng``, ``--gradient-checkpointing``, ``--attn-implementation``,
    ``--bf16``, ``--fsdp-cpu-offload``, ``--train-torch-compile``, ``--dp-replicate-size``.
    Megatron flags: none honoured (``MEGATRON_FLAGS``); the core reports the given ones
    (a warning, or an error for those that change the model or the math).

    :returns: an :class:`FSDPBackend` (meets :class:`furlong.hooks.TrainBackend`).
    """
    return FSDPBackend(config)


@hookimpl
def critic_backend(config):
    """Create the fsdp critic (``--advantage-estimator ppo``); :meth:`FSDPCritic.init` loads the value model.

    Flags read: ``--critic-load`` (a Hugging Face directory to start from; a critic checkpoint
    folder is the core's to load), ``--hf-checkpoint``, ``--critic-lr``,
    ``--critic-lr-warmup-iters``, and the actor's optimizer, schedule, precision and sharding
    flags (:func:`~.critic.critic_config`).

    :returns: an :class:`FSDPCritic` (meets :class:`furlong.hooks.CriticBackend`).
    """
    return FSDPCritic(config)
