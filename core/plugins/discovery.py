"""Reading the ``furlong`` entry-point group, without pluggy's duplicate-dropping loader."""

from __future__ import annotations

import importlib.metadata as md
import os

import attrs

from furlong.hooks import PROJECT

__all__ = ["EntryRecord", "disabled_from_env", "is_disabled", "read_entry_points"]

DISABLE_ENV = "FURLONG_DISABLE_PLUGINS"


@attrs.define(frozen=True)
class EntryRecord:
    """One entry point of group ``furlong``: ``name = value`` from distribution ``dist``."""

    name: str
    value: str
    dist: str
    version: str
    entry_point: md.EntryPoint = attrs.field(eq=False, repr=False)

    @property
    def label(self) -> str:
        return f"{self.dist} {self.version}"


def read_entry_points(group: str = PROJECT) -> list[EntryRecord]:
    """Every entry point of ``group`` from every installed distribution, duplicates kept.

    A distribution found twice on ``sys.path`` (an editable install beside a stale copy)
    is counted once.
    """
    records: list[EntryRecord] = []
    seen: set[tuple[str, str, str]] = set()
    for dist in md.distributions():
        dist_name = dist.metadata["Name"] or "?"
        for ep in dist.entry_points:
            if ep.group != group:
                continue
            key = (dist_name.lower(), ep.name, ep.value)
            if key in seen:
                continue
            seen.add(key)
            records.append(EntryRecord(ep.name, ep.value, dist_name, dist.version or "?", ep))
    records.sort(key=lambda r: (r.name, r.dist))
    return records


def disabled_from_env() -> list[str]:
    """Names from ``FURLONG_DISABLE_PLUGINS`` (comma separated, ``NAME`` or ``DIST:NAME``)."""
    return split_names(os.environ.get(DISABLE_ENV, ""))


def split_names(text: str | list[str] | None) -> list[str]:
    if not text:
        return []
    parts = text if isinstance(text, list) else [text]
    return [p.strip() for part in parts for p in part.split(",") if p.strip()]


def unmatched_names(disabled: list[str], records: list[EntryRecord] | None = None) -> list[tuple[str, str | None]]:
    """The items of ``disabled`` (``NAME`` or ``DIST:NAME``) that no installed entry point matches, each
    with the closest installed plugin name (None when none is close)."""
    import difflib

    records = read_entry_points() if records is None else records
    names = sorted({r.name for r in records})
    unmatched = []
    for item in disabled:
        if not any(is_disabled(record, [item]) for record in records):
            close = difflib.get_close_matches(item.rpartition(":")[2], names, n=1)
            unmatched.append((item, close[0] if close else None))
    return unmatched


def is_disabled(record: EntryRecord, disabled: list[str]) -> bool:
    """True when ``NAME`` or ``DIST:NAME`` of ``record`` is in ``disabled``."""
    for item in disabled:
        dist, _, name = item.rpartition(":")
        if name == record.name and (not dist or dist.lower() == record.dist.lower()):
            return True
    return False
