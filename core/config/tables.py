"""Flag tables of the programs a Miles launch script talks to, kept as data.

``core/config/data/`` holds three JSON files, each recording where its facts came from
(repository, commit or version) and one row per flag: option strings, attribute, argparse
action kind, arity, value type, default, group.

- ``megatron_args.json``: Megatron-LM's whole parser (the fork and commit Miles pins).
- ``miles_args.json``: Miles' own flags, by argument group (the Miles commit).
- ``sglang_server_args.json``: SGLang's server arguments (the version Miles builds on),
  used by the ``--sglang-*`` pass-through to know how many values each flag takes.

A row is only facts: what furlong does with a flag is decided in the modules that read
the tables (:mod:`.flags_compat`, :mod:`.passthrough`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["FLAG_KINDS", "FlagRow", "FlagTable", "add_row", "megatron_table", "miles_table", "sglang_table"]

DATA = Path(__file__).resolve().parent / "data"

# action kinds that take no value
FLAG_KINDS = frozenset({"store_true", "store_false", "bool_optional", "store_const"})


@dataclass(frozen=True)
class FlagRow:
    """One flag of a table: ``flags`` (option strings), ``dest``, ``kind`` (argparse action),
    ``nargs`` (None: one value; 0: none; ``"?"``, ``"+"``, ``"*"`` or a count), ``type``
    (the converter's name), ``default`` and ``group``."""

    flags: tuple[str, ...]
    dest: str
    kind: str
    nargs: Any
    type: str | None
    default: Any
    group: str

    @property
    def takes_value(self) -> bool:
        return self.kind not in FLAG_KINDS and self.nargs != 0

    @property
    def is_list(self) -> bool:
        """Takes any number of values (``nargs`` ``+``, ``*`` or a count above 1)."""
        return self.nargs in ("+", "*") or (isinstance(self.nargs, int) and self.nargs > 1)


@dataclass(frozen=True)
class FlagTable:
    """A table file: its ``header`` (source, commit or version) and its ``rows``."""

    header: dict
    rows: tuple[FlagRow, ...]

    def by_option(self) -> dict[str, FlagRow]:
        return {opt: row for row in self.rows for opt in row.flags}

    def by_dest(self) -> dict[str, FlagRow]:
        return {row.dest: row for row in self.rows}


@lru_cache(maxsize=None)
def _load(name: str) -> FlagTable:
    data = json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))
    header = {k: v for k, v in data.items() if k not in ("rows", "columns")}
    rows = tuple(FlagRow(tuple(r[0]), *r[1:]) for r in data["rows"])
    return FlagTable(header, rows)


def megatron_table() -> FlagTable:
    """Megatron-LM's parser (``megatron_args.json``)."""
    return _load("megatron_args")


def miles_table() -> FlagTable:
    """Miles' own flags (``miles_args.json``)."""
    return _load("miles_args")


def sglang_table() -> FlagTable:
    """SGLang's server arguments (``sglang_server_args.json``)."""
    return _load("sglang_server_args")


_TYPES = {"int": int, "float": float}


def add_row(group, row: FlagRow, defined: set[str], **extra) -> argparse.Action | None:
    """Add ``row``'s option strings not in ``defined`` to argument group ``group``, with the
    row's arity (None when every one is defined already). Two rows may share an attribute
    (Megatron's aliases), as in the program they come from.

    Values are converted with ``int``/``float`` when the row says so; any other converter
    keeps the text as given (the backend that uses the flag reads it).
    ``extra`` goes to ``add_argument`` (``help``...).
    """
    if defined & set(row.flags):
        return None
    opts = [o for o in row.flags if not (row.kind == "bool_optional" and o.startswith("--no-"))]
    kwargs: dict[str, Any] = {"dest": row.dest, "default": row.default, **extra}
    if row.kind == "bool_optional":
        kwargs["action"] = argparse.BooleanOptionalAction
    elif row.kind in FLAG_KINDS or row.nargs == 0:
        kwargs["action"] = "store_false" if row.kind == "store_false" else "store_true"
    else:
        if row.kind == "append":
            kwargs["action"] = "append"
        if row.nargs is not None:
            kwargs["nargs"] = row.nargs
        kwargs["type"] = _TYPES.get(row.type or "", str)
    return group.add_argument(*opts, **kwargs)
