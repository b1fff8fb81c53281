"""Small helpers shared by the flag modules."""

from __future__ import annotations

import argparse
import json
import math

__all__ = ["FLOAT_TYPES", "MEGATRON_ONLY", "finite_float", "float_or_inf", "json_object", "megatron", "port_number"]

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


def finite_float(text) -> float:
    """argparse ``type`` of every ``type=float`` flag (:class:`~.parser.FurlongArgumentParser` registers it in
    place of ``float``, for core and plugin flags alike): a number, never ``nan``, ``inf`` or ``-inf``.

    :raises ValueError: not a number (argparse says ``invalid float value``).
    :raises argparse.ArgumentTypeError: a number that is not finite.
    """
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def float_or_inf(text) -> float:
    """argparse ``type`` of a bound where ``inf`` means "no bound" (``--value-clip inf``): a finite number or
    ``inf``, never ``nan`` or ``-inf``.

    :raises ValueError: not a number (argparse says ``invalid float_or_inf value``).
    :raises argparse.ArgumentTypeError: ``nan`` or ``-inf``.
    """
    value = float(text)
    if math.isnan(value) or value == -math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number or inf (no bound), got {text!r}")
    return value


def port_number(text) -> int:
    """argparse ``type`` of a TCP port flag (``furlong serve --port``, ``--prometheus-port``,
    ``--sglang-router-port``): an integer in 1..65535, so a bad port is a usage error before
    anything starts (0, "any free port" to ``bind``, would leave clients no port to reach).

    :raises argparse.ArgumentTypeError: not an integer, or outside 1..65535.
    """
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a TCP port (1 to 65535), got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1 to 65535, got {value}")
    return value


FLOAT_TYPES = (finite_float, float_or_inf)
"""The converters of float flags: they also judge a float given as a number (a ``--custom-config-path`` value)."""
