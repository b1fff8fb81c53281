"""Small helpers shared by the flag modules."""

from __future__ import annotations

import argparse
import json

__all__ = ["MEGATRON_ONLY", "json_object", "megatron"]

MEGATRON_ONLY = "megatron_only"


def megatron(group, *names: str, **kwargs) -> argparse.Action:
    """Add a Megatron pass-through flag that the fsdp backend has no use for.

    The action is tagged so ``parse_args`` can list the given ones in
    ``args.megatron_flags_given`` (the fsdp backend warns once, naming them).
    """
    action = group.add_argument(*names, **kwargs)
    setattr(action, MEGATRON_ONLY, True)
    return action


def json_object(text: str) -> dict:
    """argparse ``type``: a JSON object given as text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg} at column {exc.colno}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"k\": 1}}', got {text!r}")
    return value
