"""megatron train backend: Hugging Face models trained with megatron-core (local spec, no TransformerEngine/apex)."""

from __future__ import annotations

from furlong.hooks import PluginError, hookimpl

__all__ = ["configure", "train_backend"]

# Megatron flags whose values this backend reads (architecture checks, parallel sizes, recompute, schedule).
_USED = {
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
    "--kv-channels", "--rotary-base", "--rotary-percent", "--norm-epsilon", "--vocab-size", "--normalization",
    "--position-embedding-type", "--group-query-attention", "--swiglu", "--disable-bias-linear", "--add-qkv-bias",
    "--qk-layernorm", "--untie-embeddings-and-output-weights", "--make-vocab-size-divisible-by",
    "--tensor-model-parallel-size", "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
    "--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler", "--no-check-for-nan-in-loss-and-grad",
    "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32", "--use-rotary-position-embeddings",
}

# Given with a value other than this default: "not supported yet".
_REFUSED = (
    ("--pipeline-model-parallel-size", "pipeline_model_parallel_size", 1),
    ("--virtual-pipeline-model-parallel-size", "virtual_pipeline_model_parallel_size", None),
    ("--context-parallel-size", "context_parallel_size", 1),
    ("--expert-model-parallel-size", "expert_model_parallel_size", 1),
    ("--expert-tensor-parallel-size", "expert_tensor_parallel_size", None),
    ("--sequence-parallel", "sequence_parallel", False),
    ("--num-experts", "num_experts", None),
    ("--mtp-num-layers", "mtp_num_layers", None),
    ("--spec", "spec", None),
    ("--padded-vocab-size", "padded_vocab_size", None),
    ("--optimizer-cpu-offload", "optimizer_cpu_offload", False),
    ("--use-precision-aware-optimizer", "use_precision_aware_optimizer", False),
    ("--fp16", "fp16", False),
)

# Performance switches of Megatron's own DDP / distributed optimizer: the math is the same without them.
_NOT_APPLIED = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")


@hookimpl
def configure(args, report):
    """Check the parallel sizes and features this backend supports, and Miles' architecture flags
    (``MODEL_ARGS``) against ``--hf-checkpoint``'s config.json (a disagreement names both values)."""
    for flag, dest, default in _REFUSED:
        value = getattr(args, dest, default)
        if value is not None and value is not False and value != default:
            report.error(f"{flag} {value if value is not True else ''}".rstrip()
                         + " is not supported yet by --train-backend megatron.")
    for dest in ("attention_dropout", "hidden_dropout"):
        value = getattr(args, dest, None)
        if value:
            report.error(f"--{dest.replace('_', '-')} {value} is not supported yet by --train-backend megatron "
                         "(RL log-probs need a dropout-free forward; use 0).")
    if (getattr(args, "optimizer", "adam") or "adam") != "adam":
        report.error(f"--optimizer {args.optimizer} is not supported yet by --train-backend megatron (adam only).")
    if getattr(args, "advantage_estimator", None) == "ppo":
        report.error("--advantage-estimator ppo needs a critic, which --train-backend megatron does not have yet "
                     "(not supported yet).")
    if getattr(args, "recompute_granularity", None) == "selective":
        report.error("--recompute-granularity selective is not supported yet by --train-backend megatron "
                     "(its local spec has no selective recompute modules); use full.")
    given = list(getattr(args, "megatron_flags_given", None) or [])
    skipped = [f for f in given if f in _NOT_APPLIED]
    if skipped:
        report.warn(f"{' '.join(skipped)}: the megatron backend all-reduces plain gradients and keeps a full AdamW "
                    "state per data-parallel rank; these Megatron DDP options are not applied.")
    refused = {flag for flag, _, _ in _REFUSED} | {"--attention-dropout", "--hidden-dropout"}
    ignored = [f for f in given if f not in _USED and f not in _NOT_APPLIED and f not in refused]
    if ignored:
        report.warn(f"the megatron backend does not use these Megatron flags: {' '.join(ignored)}")
    _check_architecture(args, report)


def _check_architecture(args, report) -> None:
    from transformers import AutoConfig

    from .config import check_model_args, model_shape

    where = f"--hf-checkpoint {args.hf_checkpoint}"
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
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    for what, value in (("num_attention_heads", shape.num_attention_heads),
                        ("intermediate_size", shape.ffn_hidden_size)):
        if value % tp:
            report.error(f"--tensor-model-parallel-size {tp} does not divide {what} {value} of {where}.")
    groups = shape.num_query_groups
    if groups % tp and tp % groups:
        report.error(f"--tensor-model-parallel-size {tp}: num_key_value_heads {groups} of {where} must be a "
                     "multiple or a divisor of it.")


@hookimpl
def train_backend(args):
    """Create the megatron backend; :meth:`MegatronBackend.init` builds and loads the model.

    Flags read: ``--hf-checkpoint``, ``--ref-load``, ``--tensor-model-parallel-size``,
    Miles' architecture flags (checked against the HF config), ``--make-vocab-size-divisible-by``,
    ``--use-kl-loss``, ``--kl-coef``, ``--lr`` and the Megatron LR schedule flags,
    ``--weight-decay``, ``--adam-beta1``, ``--adam-beta2``, ``--adam-eps``, ``--clip-grad``,
    ``--micro-batch-size``, ``--entropy-coef``, ``--recompute-granularity``,
    ``--recompute-method``, ``--recompute-num-layers``, ``--reset-optimizer-states``,
    ``--no-check-for-nan-in-loss-and-grad``, ``--no-save-optim``, ``--no-load-optim``,
    ``--no-load-rng``, ``--bf16``, ``--seed``.

    :returns: a :class:`MegatronBackend` (meets :class:`furlong.hooks.TrainBackend`).
    """
    from .backend import MegatronBackend

    return MegatronBackend(args)
