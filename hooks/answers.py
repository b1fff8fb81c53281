"""Answer extraction helpers shared by the core's ``boxed_<name>`` rule and reward plugins."""

from __future__ import annotations

__all__ = ["last_boxed", "last_boxed_content"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> tuple[int, int, str] | None:
    """Find the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text`` with balanced braces.

    Also accepts ``\\boxed 5`` (a space and one token, as some models write it).

    :returns: ``(start, end, content)`` of the last complete box, or None when there is
        none or its braces never close (a truncated response).
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    while start >= 0:
        found = _parse_box_at(text, start)
        if found is not None:
            return found
        start = max(text.rfind(cmd, 0, start) for cmd in _BOX_COMMANDS)
    return None


def last_boxed_content(text: str) -> str | None:
    """Content of the last complete ``\\boxed{}``/``\\fbox{}`` of ``text``, or None."""
    found = last_boxed(text)
    return None if found is None else found[2]


def _parse_box_at(text: str, start: int) -> tuple[int, int, str] | None:
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    if text.startswith(" ", i):
        rest = text[i + 1 :]
        token = rest.split("$", 1)[0].split()[0] if rest.strip() else ""
        return (start, i + 1 + len(token), token) if token else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return start, j + 1, text[i + 1 : j]
    return None
