"""The flags whose values are credentials, and the one way furlong keeps them out of what it prints or logs
(``--print-config``, the wandb and mlflow loggers' copies of the run configuration)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "SECRET_FLAGS", "SECRET_PASSED_ON", "is_secret", "redact", "shown"]

SECRET_FLAGS = frozenset({"wandb_key"})
"""Attribute names of furlong's flags that hold a credential (``--wandb-key``: the W&B API key)."""

SECRET_PASSED_ON = frozenset({"api_key", "admin_api_key"})
"""Names, in ``config.sglang_passthrough``, ``eval_sglang_passthrough`` and ``router_passthrough``, of the
SGLang server's and router's arguments that hold a credential (``--sglang-api-key``, ``--router-api-key``...)."""

REDACTED = "***"
"""What a secret's value becomes."""


_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/:@\s]*:)[^/@\s]+@")


def is_secret(name: str) -> bool:
    """Does the attribute ``name`` (a flag's, a pass-through argument's, or a ``--custom-config-path`` key such
    as ``sglang_api_key``) hold a credential?"""
    return name in SECRET_FLAGS or any(name == s or name.endswith("_" + s) for s in SECRET_PASSED_ON)


def shown(name: str, value: Any) -> Any:
    """``value`` as it may be printed or logged under attribute ``name``: :data:`REDACTED` for a credential
    (None stays None), a URL's password (``scheme://user:password@host``) replaced, anything else as it is."""
    if is_secret(str(name)):
        return None if value is None else REDACTED
    if isinstance(value, str) and "@" in value:
        return _URL_PASSWORD.sub(lambda m: m.group("head") + REDACTED + "@", value)
    return value


def redact(values: Mapping[str, Any], drop: bool = False) -> dict[str, Any]:
    """A copy of ``values`` (attribute name -> value) whose secrets' values are :data:`REDACTED`, in the
    nested mappings too (the pass-through arguments, ``--custom-config-path`` keys), and URLs' passwords too
    (:func:`shown`); a secret left unset (None) stays None.

    :param drop: leave the top-level secrets out instead, set or not (a logger's copy of the configuration).
    """
    out: dict[str, Any] = {}
    for name, value in values.items():
        if is_secret(str(name)):
            if not drop:
                out[name] = shown(name, value)
        elif isinstance(value, Mapping):
            out[name] = redact(value)
        else:
            out[name] = shown(name, value)
    return out
