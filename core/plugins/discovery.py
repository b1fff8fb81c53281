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


def unmatched_names(disabled: list[str], records: list[EntryRecord] | None = None) -> list[tuple[str, str]]:
    """The items of ``disabled`` (``NAME`` or ``DIST:NAME``) that no installed entry point matches, each with
    why: no plugin of that name, no distribution of that name, or a distribution without that plugin; with
    the closest installed name when one is close."""
    records = read_entry_points() if records is None else records
    unmatched = []
    for item in disabled:
        if any(is_disabled(record, [item]) for record in records):
            continue
        dist, _, name = item.rpartition(":")
        if dist and not any(r.dist.lower() == dist.lower() for r in records):
            dists = sorted({r.dist for r in records})
            why = f"no installed distribution '{dist}' offers furlong plugins (those that do: {', '.join(dists)})"
            unmatched.append((item, why + _did_you_mean(dist, dists)))
            continue
        names = sorted({r.name for r in records if not dist or r.dist.lower() == dist.lower()})
        why = f"distribution '{dist}' has no plugin '{name}'" if dist else "no installed plugin has that name"
        unmatched.append((item, f"{why} (furlong plugins lists them){_did_you_mean(name, names)}"))
    return unmatched


def _did_you_mean(word: str, choices: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(word, choices, n=1)
    return f". Did you mean '{close[0]}'?" if close else "."


def is_disabled(record: EntryRecord, disabled: list[str]) -> bool:
    """True when ``NAME`` or ``DIST:NAME`` of ``record`` is in ``disabled``."""
    for item in disabled:
        dist, _, name = item.rpartition(":")
        if name == record.name and (not dist or dist.lower() == record.dist.lower()):
            return True
    return False
