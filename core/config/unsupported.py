"""Flags accepted for Miles compatibility whose feature furlong does not have yet.

One table, so it shrinks in one place as features land: each row names the flag, its
attribute and the values that work today; any other value is a validation error
"<flag> is not supported yet".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["UNSUPPORTED", "Unsupported", "unsupported_problems"]


@dataclass(frozen=True)
class Unsupported:
    """``flag`` (attribute ``dest``) works only with one of ``supported`` values."""

    flag: str
    dest: str
    supported: tuple[Any, ...] = (False,)


UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("--true-on-policy-mode", "true_on_policy_mode"),
    Unsupported("--qkv-format", "qkv_format", ("thd",)),
    Unsupported("--balance-by-flops", "balance_by_flops"),
    Unsupported("--eval-num-gpus", "eval_num_gpus", (0,)),
    Unsupported("--async-save", "async_save"),
    Unsupported("--multimodal-keys", "multimodal_keys", (None,)),
    Unsupported("--update-weight-transfer-mode", "update_weight_transfer_mode", ("broadcast",)),
    Unsupported("--keep-old-actor", "keep_old_actor"),
    Unsupported("--use-session-server", "use_session_server", (None,)),
    Unsupported("--custom-async-data-buffer-path", "custom_async_data_buffer_path", (None,)),
    # engines release all their memory (weights and KV cache) under --offload-rollout
    Unsupported("--offload-rollout-level", "offload_rollout_level", (["kv_cache", "weight"], ["weight", "kv_cache"])),
    Unsupported("--train-memory-margin-bytes", "train_memory_margin_bytes", (1 << 30,)),
    # rollout data and agents
    Unsupported("--disable-rollout-global-dataset", "disable_rollout_global_dataset"),
    Unsupported("--custom-convert-samples-to-train-data-path", "custom_convert_samples_to_train_data_path", (None,)),
    Unsupported("--rollout-data-postprocess-path", "rollout_data_postprocess_path", (None,)),
    Unsupported("--max-seq-len", "max_seq_len", (None,)),
    Unsupported("--session-server-ip", "session_server_ip", (None,)),
    Unsupported("--session-server-port", "session_server_port", (None,)),
    # evaluation: a custom eval rollout and the dedicated eval fleet (--eval-num-gpus)
    Unsupported("--eval-function-path", "eval_function_path", (None,)),
    Unsupported("--eval-num-gpus-per-engine", "eval_num_gpus_per_engine", (1,)),
    Unsupported("--eval-hf-dir", "eval_hf_dir", (None,)),
    Unsupported("--eval-max-in-flight", "eval_max_in_flight", (2,)),
    Unsupported("--eval-overflow-policy", "eval_overflow_policy", ("backpressure",)),
    Unsupported("--eval-keep-snapshots", "eval_keep_snapshots", (2,)),
    # training
    Unsupported("--log-probs-max-tokens-per-gpu", "log_probs_max_tokens_per_gpu", (None,)),
    Unsupported("--fsdp-cpu-backend", "fsdp_cpu_backend", ("gloo",)),
    Unsupported("--no-keep-fp32-master", "keep_fp32_master", (True,)),
    Unsupported("--custom-tis-function-path", "custom_tis_function_path", (None,)),
    Unsupported("--get-mismatch-metrics", "get_mismatch_metrics"),
    Unsupported("--ref-update-interval", "ref_update_interval", (None,)),
)


def unsupported_problems(args) -> list[str]:
    """One message per row of :data:`UNSUPPORTED` whose attribute holds another value.

    Only values that were given count (``args.explicit_args``): a value
    another flag implies (``--load-debug-rollout-data`` sets ``debug_train_only``) is
    reported through the flag that was given.
    """
    given = args.explicit_args
    problems = []
    for row in UNSUPPORTED:
        value = getattr(args, row.dest, row.supported[0])
        if value in row.supported or row.dest not in given:
            continue
        if isinstance(value, bool) or all(v is False or v is None for v in row.supported):
            problems.append(f"{row.flag} is not supported yet; remove it.")
        else:
            shown = ", ".join(str(v) for v in row.supported if v is not None)
            problems.append(f"{row.flag} {value} is not supported yet (supported: {shown}).")
    return problems
