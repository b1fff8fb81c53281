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
    Unsupported("--use-routing-replay", "use_routing_replay"),
    Unsupported("--use-rollout-routing-replay", "use_rollout_routing_replay"),
    Unsupported("--true-on-policy-mode", "true_on_policy_mode"),
    Unsupported("--qkv-format", "qkv_format", ("thd",)),
    Unsupported("--opd-type", "opd_type", (None, "megatron")),
    Unsupported("--balance-by-flops", "balance_by_flops"),
    Unsupported("--eval-num-gpus", "eval_num_gpus", (0,)),
    Unsupported("--async-save", "async_save"),
    Unsupported("--save-hf", "save_hf", (None,)),
    Unsupported("--use-mlflow", "use_mlflow"),
    Unsupported("--use-prometheus", "use_prometheus"),
    Unsupported("--multimodal-keys", "multimodal_keys", (None,)),
    Unsupported("--rollout-external", "rollout_external"),
    Unsupported("--update-weight-transfer-mode", "update_weight_transfer_mode", ("broadcast",)),
    Unsupported("--keep-old-actor", "keep_old_actor"),
    Unsupported("--use-session-server", "use_session_server", (None,)),
    Unsupported("--custom-async-data-buffer-path", "custom_async_data_buffer_path", (None,)),
)


def unsupported_problems(args) -> list[str]:
    """One message per row of :data:`UNSUPPORTED` whose attribute holds another value."""
    problems = []
    for row in UNSUPPORTED:
        value = getattr(args, row.dest, row.supported[0])
        if value in row.supported:
            continue
        if all(v is False or v is None for v in row.supported):
            problems.append(f"{row.flag} is not supported yet; remove it.")
        else:
            shown = ", ".join(str(v) for v in row.supported if v is not None)
            problems.append(f"{row.flag} {value} is not supported yet (supported: {shown}).")
    return problems
