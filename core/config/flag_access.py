"""Reading a flag whose attribute name is data: the one place core does it.

Code that walks a table of flags (the refused flags, the batch knobs, the hooks chosen by
name) holds attribute names, not attributes. It reads them with :func:`flag_value`, which
has no default: a name that the parser did not define is an ``AttributeError`` naming it,
never a silent ``None``. Everywhere else core reads ``args.<name>`` or ``config.<name>``
(tests/test_guards.py checks both).
"""

from __future__ import annotations

from typing import Any

__all__ = ["flag_value", "has_flag"]


def flag_value(args: Any, dest: str) -> Any:
    """The value of the flag attribute ``dest`` on ``args`` (an ``argparse.Namespace`` or a ``RunConfig``).

    :raises AttributeError: ``args`` has no attribute ``dest`` (the message names it).
    """
    try:
        return getattr(args, dest)
    except AttributeError:
        raise AttributeError(f"no flag attribute {dest!r} on the parsed arguments") from None


def has_flag(args: Any, dest: str) -> bool:
    """Whether ``args`` has the flag attribute ``dest`` (a Megatron-LM-only flag not given has none)."""
    return hasattr(args, dest)
