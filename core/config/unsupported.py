"""Flags accepted for Miles compatibility whose feature furlong does not have.

One table, so it shrinks in one place as features land: each row names the flag, its
attribute and the values that work today; any other value is a validation error,
"<flag> is not supported yet", or, for a row with a ``reason``, "<flag>: <reason>" (what
furlong does instead, so the user knows what to change).

A second table, :data:`NO_EFFECT`, holds the Miles flags whose other values choose only a
memory or layout detail that furlong decides itself: the run's results are the same, so a
Miles script keeps them and gets one warning each saying why they change nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .flag_access import flag_value

__all__ = ["NO_EFFECT", "UNSUPPORTED", "Unsupported", "no_effect_warnings", "unsupported_problems"]


@dataclass(frozen=True)
class Unsupported:
    """``flag`` (attribute ``dest``) works only with one of ``supported`` values; ``reason``: why
    not, and what to do instead (None: the feature is still to come)."""

    flag: str
    dest: str
    supported: tuple[Any, ...] = (False,)
    reason: str | None = None


UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("--true-on-policy-mode", "true_on_policy_mode", reason=(
        "bit-identical rollout and training numerics need batch-invariant kernels in both the engine and the "
        "trainer, which furlong does not have; remove it and keep training on-policy with --use-tis (or "
        "--use-rollout-logprobs), watching train/train_rollout_kl (--get-mismatch-metrics).")),
    Unsupported("--balance-by-flops", "balance_by_flops", reason=(
        "micro-batches are balanced by tokens, not FLOPs; remove it and use --balance-data (Karmarkar-Karp on "
        "token counts).")),
    Unsupported("--multimodal-keys", "multimodal_keys", (None,), reason=(
        "furlong's data sources, engines and train backends carry text only (no image or video inputs, no "
        "vision tower); remove it and put the text in --input-key.")),
    Unsupported("--update-weight-transfer-mode", "update_weight_transfer_mode", ("broadcast",), reason=(
        "weights reach the engines by broadcast over a process group (or in place when they share the "
        "trainer's process); p2p and disk-delta transfers are not implemented. Remove it (broadcast is the "
        "default).")),
    Unsupported("--use-session-server", "use_session_server", (None,), reason=(
        "furlong has no session server; a multi-turn agent keeps its tokens on the sample through "
        "--custom-generate-function-path (or a generate plugin). Remove it.")),
    Unsupported("--custom-async-data-buffer-path", "custom_async_data_buffer_path", (None,), reason=(
        "the fully_async rollout keeps its finished groups in a queue of its own, with no DataBuffer class to "
        "replace; remove it, and for another dataflow write a rollout plugin (--rollout NAME, or "
        "--rollout-function-path).")),
    # engines release all their memory (weights and KV cache) under --offload-rollout
    Unsupported("--offload-rollout-level", "offload_rollout_level", (["kv_cache", "weight"], ["weight", "kv_cache"]),
                reason=("engines release their weights and KV cache together (the engine contract's "
                        "release_memory); remove it.")),
    # rollout data and agents
    Unsupported("--disable-rollout-global-dataset", "disable_rollout_global_dataset", reason=(
        "the core reads prompts through the data source; to load data your own way give --data-source-path "
        "module.Class (or a data_source plugin) instead, and remove it.")),
    Unsupported("--max-seq-len", "max_seq_len", (None,), reason=(
        "it caps the trajectories a Miles session server assembles, and furlong has no session server; remove it "
        "and cap prompt plus response tokens with --rollout-max-context-len.")),
    Unsupported("--session-server-ip", "session_server_ip", (None,), reason="it addresses --use-session-server; remove it."),
    Unsupported("--session-server-port", "session_server_port", (None,),
                reason="it addresses --use-session-server; remove it."),
    # checkpoints
    Unsupported("--pretrained-checkpoint", "pretrained_checkpoint", (None,), reason=(
        "Megatron-LM's weights to fine-tune from when --load holds no checkpoint; furlong starts such a run from "
        "--ref-load (a torch_dist or Hugging Face directory), else --hf-checkpoint: pass the directory as "
        "--ref-load (it is the KL reference too) and remove it.")),
    # training
    Unsupported("--fsdp-cpu-backend", "fsdp_cpu_backend", ("gloo",), reason=(
        "the executors always give CPU tensors the gloo backend (cpu:gloo,cuda:nccl), the one CPU backend torch "
        "builds everywhere; remove it.")),
)

NO_EFFECT: tuple[Unsupported, ...] = (
    Unsupported("--qkv-format", "qkv_format", ("thd",), reason=(
        "the train backends choose the attention layout per micro-batch themselves (packed thd where the "
        "attention kernel takes it, right-padded otherwise), with the same log-probs and losses either way.")),
    Unsupported("--train-memory-margin-bytes", "train_memory_margin_bytes", (1 << 30,), reason=(
        "--offload-train moves the trainer's tensors to host memory and back (no torch_memory_saver), so there "
        "is no allocator margin to keep; it is a memory setting only.")),
)


def _shown(value) -> str:
    return "" if isinstance(value, bool) or value is None else f" {value}"


def no_effect_warnings(args) -> list[str]:
    """One warning per row of :data:`NO_EFFECT` given with another value: "<flag> <value> changes nothing
    here: <reason>"."""
    given = args.explicit_args
    return [f"{row.flag}{_shown(value)} changes nothing here: {row.reason}" for row in NO_EFFECT
            if row.dest in given and (value := flag_value(args, row.dest)) not in row.supported]


def unsupported_problems(args) -> list[str]:
    """One message per row of :data:`UNSUPPORTED` whose attribute holds another value.

    Only values that were given count (``args.explicit_args``): a value
    another flag implies (``--load-debug-rollout-data`` sets ``debug_train_only``) is
    reported through the flag that was given.
    """
    given = args.explicit_args
    problems = []
    for row in UNSUPPORTED:
        value = flag_value(args, row.dest)
        if value in row.supported or row.dest not in given:
            continue
        if row.reason is not None:
            problems.append(f"{row.flag}{_shown(value)}: {row.reason}")
        elif isinstance(value, bool) or all(v is False or v is None for v in row.supported):
            problems.append(f"{row.flag} is not supported yet; remove it.")
        else:
            shown = ", ".join(str(v) for v in row.supported if v is not None)
            problems.append(f"{row.flag} {value} is not supported yet (supported: {shown}).")
    return problems
