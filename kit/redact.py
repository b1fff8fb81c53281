"""The flags whose values are credentials, and the one way furlong keeps them out of what it prints or logs
(``--print-config``, the wandb and mlflow loggers' copies of the run configuration)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "SECRET_FLAGS", "SECRET_PASSED_ON", "is_secret", "redact"]

SECRET_FLAGS = frozenset({"wandb_key"})
"""Attribute names of furlong's flags that hold a credential (``--wandb-key``: the W&B API key)."""

SECRET_PASSED_ON = frozenset({"api_key", "admin_api_key"})
"""Names, in ``config.sglang_passthrough``, ``eval_sglang_passthrough`` and ``router_passthrough``, of the
SGLang server's and router's arguments that hold a credential (``--sglang-api-key``, ``--router-api-key``...)."""

REDACTED = "***"
"""What a secret's value becomes."""


def is_secret(name: str) -> bool:
    """Does the attribute ``name`` (a flag's, or a pass-through argument's) hold a credential?"""
    return name in SECRET_FLAGS or name in SECRET_PASSED_ON


def redact(values: Mapping[str, Any], drop: bool = False) -> dict[str, Any]:
    """A copy of ``values`` (attribute name -> value) whose secrets' values are :data:`REDACTED`, in the
    nested mappings too (the pass-through arguments); a secret left unset (None) stays None.

    :param drop: leave the top-level secrets out instead, set or not (a logger's copy of the configuration).
    """
    out: dict[str, Any] = {}
    for name, value in values.items():
        if is_secret(str(name)):
            if not drop:
                out[name] = None if value is None else REDACTED
        elif isinstance(value, Mapping):
            out[name] = redact(value)
        else:
            out[name] = value
    return out
