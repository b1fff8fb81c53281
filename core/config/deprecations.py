"""Deprecated and changed flags, as data, and the mapping of old spellings to new ones.

Versioning policy (docs/flags.md): a patch release never changes flags; a minor release
may deprecate a flag, keeping the old spelling as an alias for exactly one minor
release with one startup warning per flag; the alias is removed after that (a major
release removes every remaining alias). At or above ``removed_in`` an old spelling is
an error naming its replacement.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

__all__ = ["DEPRECATIONS", "Deprecation", "furlong_version", "map_deprecated", "renamed"]

log = logging.getLogger("furlong.config")


@dataclass(frozen=True)
class Deprecation:
    """One row of the deprecation table.

    :param old: the flag as users typed it before the change.
    :param new: the replacement flag (``kind == "rename"``) or the new default value
        (``kind == "default"``); None when there is neither.
    :param kind: ``rename`` (old spelling mapped to ``new``), ``default`` (same flag,
        new default), ``required`` (the flag lost its default), ``behavior`` (what the
        flag means or implies changed).
    :param deprecated_in: furlong/Miles version of the change.
    :param removed_in: version from which the old spelling is an error (renames only).
    :param was: the old default or behaviour, for messages and docs.
    """

    old: str
    new: str | None
    kind: str
    deprecated_in: str
    removed_in: str | None
    was: str = ""


DEPRECATIONS: tuple[Deprecation, ...] = (
    Deprecation("--rollout-router-ip", "--sglang-router-ip", "rename", "0.0.9", "0.1.0"),
    Deprecation("--rm-path", "--custom-rm-path", "rename", "0.0.9", "0.1.0"),
    Deprecation("--save-interval", "100", "default", "0.0.8", None, was="10"),
    Deprecation("--num-rollout", None, "required", "0.0.9", None, was="1000"),
    Deprecation("--apply-chat-template", None, "behavior", "0.0.8", None,
                was="implied when a prompt is a list of messages; now never implied"),
)


def renamed() -> list[Deprecation]:
    """The rename rows: the old spellings the parser maps."""
    return [row for row in DEPRECATIONS if row.kind == "rename"]


def furlong_version() -> str:
    """The installed furlong version (``importlib.metadata``); tests monkeypatch this."""
    try:
        return md.version("furlong")
    except md.PackageNotFoundError:
        return "0.0.0"


def map_deprecated(tokens: list[str]) -> tuple[list[str], list[str]]:
    """Rewrite renamed flags to their replacements.

    Below a row's ``removed_in`` the old spelling is rewritten and one WARNING per flag
    is logged on ``furlong.config`` naming the replacement and the removal version. At
    or above it, or when the old and the new spelling are both given, the problem is
    returned (the token is still rewritten so parsing can go on and report the rest).

    :param tokens: command-line tokens, argument files already expanded.
    :returns: ``(tokens, problems)``.
    """
    try:
        current = Version(furlong_version())
    except InvalidVersion:
        current = Version("0.0.0")
    out = list(tokens)
    problems: list[str] = []
    for row in renamed():
        hits = [i for i, tok in enumerate(out) if _flag_of(tok) == row.old]
        if not hits:
            continue
        new_given = any(_flag_of(tok) == row.new for tok in out)
        for i in hits:
            out[i] = row.new + out[i][len(row.old):]
        if row.removed_in is not None and current >= Version(row.removed_in):
            problems.append(f"{row.old} was removed in furlong {row.removed_in}; use {row.new} instead.")
        elif new_given:
            problems.append(
                f"{row.old} and {row.new} are both given; {row.old} is a deprecated alias of {row.new}: "
                f"pass only {row.new}."
            )
        else:
            log.warning(
                "%s is deprecated since %s and will be removed in furlong %s; use %s instead.",
                row.old, row.deprecated_in, row.removed_in, row.new,
            )
    return out, problems


def _flag_of(token: str) -> str:
    return token.split("=", 1)[0] if token.startswith("--") else ""
