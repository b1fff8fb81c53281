"""megatron train backend: Hugging Face models trained with megatron-core (local spec, no TransformerEngine/apex)."""

from __future__ import annotations

import logging
import os
import warnings

from furlong.hooks import ConfigReport, MegatronFlags, PluginError, hookimpl
from furlong.kit.machine_budget import default_token_budget

from .config import RECOMPUTE_NEEDS_CUDA, flag_dest
from .mcore_optimizer import (OPTIMIZER_DESTS, PRECISION_AWARE_WITHOUT_TE, asked_features, fraction_problem,
                              idle_offload_flags, mcore_optimizer_problems, precision_aware, uses_mcore_optimizer)
from .moe import MOE_DESTS

# megatron-core warns at import, once per module, that it falls back from TransformerEngine
# and apex to torch (this backend builds the local spec on purpose), and that the cuda-graph
# scope "full" it defaults to is deprecated: neither is something a user can act on. Set here,
# before any module of this backend imports megatron.core (every process that loads the plugin).
for _message in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "full scope is deprecated"):
    warnings.filterwarnings("ignore", message=_message, category=UserWarning)
# ... and its Megatron-FSDP module logs "Using Megatron-FSDP without Transformer Engine" at import,
# although this backend does not use Megatron-FSDP
for _name in ("megatron.core.distributed.fsdp", "megatron_fsdp"):
    logging.getLogger(_name).setLevel(logging.WARNING)

__all__ = ["MEGATRON_FLAGS", "configure", "critic_backend", "train_backend"]

# Megatron flags whose values this backend reads (architecture checks, parallel sizes, recompute, schedule).
_USED = {
    "--rotary-interleaved", "--post-self-attn-layernorm", "--post-mlp-layernorm",
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
    "--kv-channels", "--rotary-base", "--rotary-percent", "--norm-epsilon", "--vocab-size", "--normalization",
    "--position-embedding-type", "--group-query-attention", "--swiglu", "--disable-bias-linear", "--add-qkv-bias",
    "--qk-layernorm", "--untie-embeddings-and-output-weights", "--make-vocab-size-divisible-by",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--recompute-granularity", "--recompute-method",
    "--recompute-num-layers", "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
    "--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler", "--no-check-for-nan-in-loss-and-grad",
    "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32", "--use-rotary-position-embeddings",
    "--sequence-parallel", "--use-distributed-optimizer",
}

# Given with a value other than this default (or, for a parallel size, 1: one rank changes
# nothing): "not supported yet".
_REFUSED = (
    ("--virtual-pipeline-model-parallel-size", "virtual_pipeline_model_parallel_size", None),
    ("--padded-vocab-size", "padded_vocab_size", None),
    ("--fp16", "fp16", False),
)


# multi-token prediction: what a user can do about it
_MTP = ("--mtp-num-layers", "--enable-mtp-training", "--mtp-loss-scaling-factor")
_MTP_REASON = ("multi-token prediction is not supported yet by --train-backend megatron: it needs MTP layers in the "
               "--hf-checkpoint (DeepSeek-V3's num_nextn_predict_layers, a family this backend does not build yet); "
               "Qwen3, Qwen3-MoE, Qwen2, Llama and GLM-4 checkpoints ship none. Remove {given}.")

# What the core must not report for this backend: the flags it reads, and those its configure
# refuses itself with a "not supported yet" naming the value. The model comes from the
# --hf-checkpoint config; other architecture flags are checked against it by the core, the MoE
# ones by configure (:mod:`.moe`).
MEGATRON_FLAGS = MegatronFlags(
    honours=frozenset(flag_dest(f) for f in _USED) | frozenset(dest for _, dest, _ in _REFUSED)
    | frozenset({"spec", "lora_rank", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules",
                 "attention_dropout", "hidden_dropout", "moe_token_dispatcher_type", "mtp_num_layers",
                 "mtp_loss_scaling_factor", "moe_enable_routing_replay"}) | MOE_DESTS | OPTIMIZER_DESTS,
    architecture_from_hf=True)


@hookimpl
def configure(args, report):
    """Check the parallel sizes and features this backend supports, and Miles' architecture flags
    (``MODEL_ARGS``) against ``--hf-checkpoint``'s config.json (a disagreement names both values).

    Data parallelism: each model replica spans TP x PP x CP ranks, so the data-parallel size
    is ``world / (TP x PP x CP)`` (reported with ``report.data_parallel_rule``); experts are shared
    out over ``--expert-model-parallel-size`` of those data-parallel ranks (EP divides D x CP, the
    experts are replicated over ``world / (PP x EP)`` ranks), which does not change D.

    The core reports the other Megatron flags given (``MEGATRON_FLAGS``): a warning for those
    that do not change results (overlap switches, fusions), an error for those that would.
    """
    for flag, dest, default in _REFUSED:
        value = getattr(args, dest, default)
        no_op = value == 1 and dest.endswith("_parallel_size")
        if value is not None and value is not False and value != default and not no_op:
            report.error(f"{flag} {value if value is not True else ''}".rstrip()
                         + " is not supported yet by --train-backend megatron.")
    # Miles' megatron backend turns the distributed optimizer on for Adam (its set_default_megatron_args), so its
    # scripts give --optimizer-cpu-offload / --use-precision-aware-optimizer without --use-distributed-optimizer
    if uses_mcore_optimizer(args) and (args.optimizer or "adam") == "adam":
        report.default(args, "use_distributed_optimizer", True)
    # a Ray run's training ranks may have GPUs where the driver has none; they check when the backend starts
    refused = mcore_optimizer_problems(args, cuda=report.machine.cuda or args.executor == "ray")
    if not uses_mcore_optimizer(args) and fraction_problem(args):
        refused.append(fraction_problem(args))
    for problem in refused:
        report.error(problem)
    if not refused and args.use_precision_aware_optimizer and args.use_distributed_optimizer \
            and not precision_aware(args):
        report.warn(PRECISION_AWARE_WITHOUT_TE)
    idle = idle_offload_flags(args)
    if idle:
        report.warn(f"{', '.join(idle)} {'change' if len(idle) > 1 else 'changes'} nothing without "
                    "--optimizer-cpu-offload.")
    mtp = [f for f in _MTP if _given(args, flag_dest(f))]
    if mtp:
        report.error(_MTP_REASON.format(given=", ".join(mtp)))
    report.data_parallel_rule(TP=args.tensor_model_parallel_size, PP=args.pipeline_model_parallel_size,
                              CP=args.context_parallel_size)
    default_token_budget(args, report, tensor_parallel=args.tensor_model_parallel_size,
                         state_shards=args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    _check_sequence_parallel(args, report)
    _check_spec(args, report)
    from .lora import lora_problems

    for problem in lora_problems(args, int(args.tensor_model_parallel_size or 1)):
        report.error(problem)
    for dest in ("attention_dropout", "hidden_dropout"):
        value = getattr(args, dest, None)
        if value:
            report.error(f"--{dest.replace('_', '-')} {value} is not supported yet by --train-backend megatron "
                         "(RL log-probs need a dropout-free forward; use 0).")
    if getattr(args, "train_torch_compile", False):
        report.error("--train-torch-compile is not supported yet by --train-backend megatron: its decoder layers "
                     "compiled measured slower than the plain ones (0.455 s against 0.395 s per step of 16 x 2048 "
                     "tokens at the Qwen2.5-0.5B shape on an H200, after 87 s of compilation); use it with fsdp.")
    if (getattr(args, "optimizer", "adam") or "adam") != "adam":
        report.error(f"--optimizer {args.optimizer} is not supported yet by --train-backend megatron (adam only).")
    if getattr(args, "recompute_granularity", None) == "selective":
        report.error("--recompute-granularity selective is not supported yet by --train-backend megatron "
                     "(its local spec has no selective recompute modules); use full (on a CUDA GPU).")
    elif args.recompute_granularity and not (report.machine.cuda or args.executor == "ray"):
        report.error(RECOMPUTE_NEEDS_CUDA)  # (a Ray run's training ranks check when they start)
    idle = [f"--recompute-{name}" for name in ("method", "num-layers")
            if not args.recompute_granularity and _given(args, f"recompute_{name.replace('-', '_')}")]
    if idle:
        report.warn(f"{', '.join(idle)} {'change' if len(idle) > 1 else 'changes'} nothing without "
                    "--recompute-granularity full.")
    _check_architecture(args, report)


def _distributed_optimizer(args) -> bool | str:
    """Off, or the flags that turned the distributed optimizer on (configure turns it on for Miles' offload flags)."""
    if not args.use_distributed_optimizer:
        return False
    if "use_distributed_optimizer" in (args.megatron_args or {}) or ConfigReport.given(args, "use_distributed_optimizer"):
        return "--use-distributed-optimizer"
    return f"{asked_features(args)} (megatron-core's distributed optimizer, which Miles turns on with Adam)"


def _given(args, dest: str) -> bool:
    return dest in (getattr(args, "megatron_args", None) or {}) or getattr(args, dest, None) not in (None, False)


def _check_sequence_parallel(args, report) -> None:
    if not getattr(args, "sequence_parallel", False):
        return
    if int(getattr(args, "tensor_model_parallel_size", 1) or 1) == 1:
        report.warn("--sequence-parallel changes nothing without --tensor-model-parallel-size > 1 (as in Megatron, "
                    "it is off there).")


def _check_spec(args, report) -> None:
    """Miles' ``--spec``: the family it names against the one this backend builds (:mod:`.specs`)."""
    import json

    from .specs import spec_problems

    spec = getattr(args, "spec", None)
    if not spec:
        return
    model_type = None
    try:
        with open(os.path.join(str(args.hf_checkpoint or ""), "config.json"), encoding="utf-8") as handle:
            model_type = json.load(handle).get("model_type")
    except (OSError, ValueError, AttributeError):
        pass  # unreadable here: _check_architecture reports it
    errors, infos = spec_problems(spec, model_type)
    for message in errors:
        report.error(message)
    for message in infos:
        report.info(message)


def _check_architecture(args, report) -> None:
    from transformers import AutoConfig

    from .backend import moe_layout_problems
    from .config import check_model_args, model_shape
    from .convert import pipeline_split, stage_layer_counts
    from .moe import flag, moe_flag_problems

    where = f"--hf-checkpoint {args.hf_checkpoint}"
    if not os.path.isfile(os.path.join(str(args.hf_checkpoint or ""), "config.json")):
        if getattr(args, "print_config", False):  # a cluster path, checked on the laptop: the run checks it
            report.warn(f"{where}: no config.json here, so the architecture flags and parallel sizes are not "
                        "checked against it (the run checks them).")
        else:
            report.error(f"{where}: no config.json there; --hf-checkpoint must be a Hugging Face model directory "
                         "on this machine.")
        return
    try:
        shape = model_shape(AutoConfig.from_pretrained(args.hf_checkpoint), where)
    except PluginError as exc:
        report.error(str(exc))
        return
    except (OSError, ValueError) as exc:
        report.error(f"{where}: cannot read config.json: {exc}")
        return
    for problem in check_model_args(args, shape, f"{where}/config.json"):
        report.error(problem)
    if int(args.lora_rank or 0) > 0 and shape.is_moe:
        report.error("--lora-rank on a mixture-of-experts model is not supported yet by --train-backend megatron.")
    errors, warnings = moe_flag_problems(args, shape, f"{where}/config.json")
    ep, pp = int(flag(args, "expert_model_parallel_size", 1)), int(args.pipeline_model_parallel_size or 1)
    errors += moe_layout_problems(shape, int(args.tensor_model_parallel_size or 1), ep, args.hf_checkpoint,
                                  _distributed_optimizer(args), bool(args.sequence_parallel))
    world = int(args.actor_num_nodes) * int(args.actor_num_gpus_per_node)
    if shape.is_moe and ep > 1 and world % (ep * pp):  # (init_parallel's check, before any rank starts)
        errors.append(f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp} does not divide the "
                      f"trainer world size {world} (--actor-num-nodes x --actor-num-gpus-per-node).")
    for problem in errors:
        report.error(problem)
    for warning in warnings:
        report.warn(warning)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    for what, value in (("num_attention_heads", shape.num_attention_heads),
                        ("intermediate_size", shape.ffn_hidden_size)):
        if value % tp:
            report.error(f"--tensor-model-parallel-size {tp} does not divide {what} {value} of {where}.")
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    try:
        stage_layer_counts(shape.num_layers, pp, *pipeline_split(args.megatron_args))
    except ValueError as exc:
        message = str(exc)  # a split flag's own value is at fault, or the split of this model's layers
        report.error(message if message.startswith("--decoder-") else f"{where}: {message}")
    if pp == 1 and any(n is not None for n in pipeline_split(args.megatron_args)):
        report.warn("--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers change nothing "
                    "without --pipeline-model-parallel-size > 1.")
    groups = shape.num_query_groups
    if groups % tp and tp % groups:
        report.error(f"--tensor-model-parallel-size {tp}: num_key_value_heads {groups} of {where} must be a "
                     "multiple or a divisor of it.")


@hookimpl
def train_backend(config):
    """Create the megatron backend; :meth:`MegatronBackend.init` builds and loads the model.

    Flags read: ``--hf-checkpoint``, ``--ref-load``, ``--tensor-model-parallel-size``,
    ``--pipeline-model-parallel-size``, ``--decoder-first-pipeline-num-layers``,
    ``--decoder-last-pipeline-num-layers``, ``--context-parallel-size``, ``--sequence-parallel``,
    Miles' architecture flags (checked against the HF config), ``--spec`` (Miles' model spec: the family
    it names, :mod:`.specs`), ``--make-vocab-size-divisible-by``,
    ``--use-kl-loss``, ``--kl-coef``, ``--optimizer`` (adam), ``--lr`` and the Megatron LR schedule
    flags, ``--weight-decay``, ``--adam-beta1``, ``--adam-beta2``, ``--adam-eps``, ``--clip-grad``,
    ``--use-distributed-optimizer``, ``--lora-rank``, ``--lora-alpha``, ``--lora-dropout``, ``--target-modules``,
    ``--exclude-modules`` (:mod:`.lora`), ``--micro-batch-size``, ``--use-dynamic-batch-size`` (packing
    off CUDA), ``--log-probs-chunk-size``, ``--entropy-coef``, ``--recompute-granularity``,
    ``--recompute-method``, ``--recompute-num-layers``, ``--reset-optimizer-states``,
    ``--no-check-for-nan-in-loss-and-grad``, ``--no-save-optim``, ``--no-load-optim``,
    ``--no-load-rng``, ``--bf16``, ``--seed``; on a mixture-of-experts model ``--expert-model-parallel-size``,
    ``--moe-router-load-balancing-type``, ``--moe-aux-loss-coeff``, ``--moe-z-loss-coeff``, ``--moe-router-dtype``,
    ``--moe-token-dispatcher-type``, ``--use-routing-replay``, ``--use-rollout-routing-replay`` (the other MoE
    flags are checked against the HF config).

    :returns: a :class:`MegatronBackend` (meets :class:`furlong.hooks.TrainBackend`).
    """
    from .backend import MegatronBackend

    return MegatronBackend(config)


@hookimpl
def critic_backend(config):
    """Create the megatron critic (``--advantage-estimator ppo``); :meth:`MegatronCritic.init` builds the value
    model (the policy's GPTModel with a value head, :mod:`.value_model`) and loads it.

    Flags read: ``--critic-load`` (a Hugging Face directory to start from; a critic checkpoint folder is the
    core's to load), ``--ref-load`` and ``--hf-checkpoint`` (the actor's starting weights, else),
    ``--critic-lr``, ``--critic-lr-warmup-iters``, and the actor's optimizer, schedule, precision and
    parallelism flags (:func:`furlong.kit.critic.critic_config`).

    :returns: a :class:`MegatronCritic` (meets :class:`furlong.hooks.CriticBackend`).
    :raises PluginError: ``--pipeline-model-parallel-size`` or ``--context-parallel-size`` above 1 (not
        supported yet for the critic).
    """
    from .critic import MegatronCritic

    return MegatronCritic(config)
