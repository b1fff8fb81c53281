"""``--sglang-*``, ``--router-*`` and ``--eval-sglang-*`` pass-through flags.

Any flag with one of these prefixes that core does not define itself is collected into
a dict (key: the rest of the flag in snake_case) instead of being parsed:
``--sglang-X=V`` always gives ``"V"``. For ``--sglang-X`` and ``--eval-sglang-X`` the
arity comes from SGLang's server-argument table (``data/sglang_server_args.json``): a
list-valued argument (``--cuda-graph-bs 1 2 4``) takes every value up to the next flag
(a list of strings), a switch takes none (``True``). Otherwise (the router, or a flag
the table lacks) a bare flag takes the next token as its value unless that token starts
with ``--`` (or there is none), in which case the value is ``True``. Values stay strings:
SGLang and the router parse their own arguments.

An ``--sglang-X`` or ``--eval-sglang-X`` flag whose ``--X`` is not in the table gets a
warning at parse time, with the closest known flag when there is one (a misspelt flag
would otherwise surface only when the server refuses it on the cluster); it is still
passed on, since a Miles script may target an SGLang older or newer than the table.
``FURLONG_ALLOW_UNKNOWN_SGLANG_ARGS=1`` silences the warning.
"""

from __future__ import annotations

import difflib
import os
from functools import lru_cache

from .tables import FlagRow, sglang_table

__all__ = ["ALLOW_UNKNOWN_SGLANG_ENV", "PREFIXES", "split_passthrough", "unknown_sglang_problems"]

ALLOW_UNKNOWN_SGLANG_ENV = "FURLONG_ALLOW_UNKNOWN_SGLANG_ARGS"

# (prefix, Namespace attribute); longest prefix first.
PREFIXES: tuple[tuple[str, str], ...] = (
    ("--eval-sglang-", "eval_sglang_passthrough"),
    ("--sglang-", "sglang_passthrough"),
    ("--router-", "router_passthrough"),
)


def split_passthrough(tokens: list[str], known: set[str]) -> tuple[list[str], dict[str, dict], list[str]]:
    """Take pass-through flags out of ``tokens``.

    :param tokens: command-line tokens (argument files expanded, deprecations mapped).
    :param known: option strings the parser defines (``--sglang-router-ip`` stays a
        real flag).
    :returns: ``(rest, collected, given)``: the tokens left for argparse; ``collected``
        maps each attribute of :data:`PREFIXES` to its dict; ``given`` lists the
        pass-through flags in order, as typed (without values).
    """
    collected: dict[str, dict] = {attr: {} for _, attr in PREFIXES}
    given: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        flag, eq, value = token.partition("=")
        match = _match(flag) if token.startswith("--") and flag not in known else None
        if match is None:
            rest.append(token)
            i += 1
            continue
        prefix, attr = match
        key = flag[len(prefix):].replace("-", "_")
        given.append(flag)
        row = _sglang_rows().get("--" + flag[len(prefix):]) if attr != "router_passthrough" else None
        values = _values_after(tokens, i + 1)
        if eq:
            collected[attr][key] = value
            i += 1
        elif row is not None and not row.takes_value:
            collected[attr][key] = True
            i += 1
        elif row is not None and row.is_list and values:
            collected[attr][key] = values
            i += 1 + len(values)
        elif values:
            collected[attr][key] = values[0]
            i += 2
        else:
            collected[attr][key] = True
            i += 1
    return rest, collected, given


def unknown_sglang_problems(given: list[str]) -> list[str]:
    """One warning per ``--sglang-*`` / ``--eval-sglang-*`` flag of ``given`` (as typed) that SGLang's
    server-argument table lacks; none when ``FURLONG_ALLOW_UNKNOWN_SGLANG_ARGS=1``."""
    if os.environ.get(ALLOW_UNKNOWN_SGLANG_ENV, "") == "1":
        return []
    rows = _sglang_rows()
    problems = []
    for flag in given:
        match = _match(flag)
        if match is None or match[1] == "router_passthrough" or "--" + flag[len(match[0]):] in rows:
            continue
        prefix = match[0]
        close = difflib.get_close_matches("--" + flag[len(prefix):], list(rows), n=1, cutoff=0.8)
        hint = f" (did you mean {prefix}{close[0][2:]}?)" if close else ""
        problems.append(f"{flag} is not an argument of SGLang {sglang_table().header.get('version', '?')}{hint}; "
                        f"it is passed to the server as given (an SGLang that lacks it refuses to start); "
                        f"{ALLOW_UNKNOWN_SGLANG_ENV}=1 silences this warning.")
    return problems


def _values_after(tokens: list[str], start: int) -> list[str]:
    """The tokens from ``start`` up to the next flag (``--...``)."""
    end = start
    while end < len(tokens) and not tokens[end].startswith("--"):
        end += 1
    return tokens[start:end]


@lru_cache(maxsize=1)
def _sglang_rows() -> dict[str, FlagRow]:
    return sglang_table().by_option()


def _match(flag: str) -> tuple[str, str] | None:
    for prefix, attr in PREFIXES:
        if flag.startswith(prefix) and len(flag) > len(prefix):
            return prefix, attr
    return None
