"""Reading the ``furlong`` entry-point group, without pluggy's duplicate-dropping loader."""

from __future__ import annotations

import importlib.metadata as md
import os

import attrs

from furlong.hooks import PROJECT, PluginError

__all__ = ["DISABLE_ENV", "DISABLE_FLAG", "EntryRecord", "check_disabled", "disabled_from_env", "disabled_problems",
           "is_disabled", "read_entry_points"]

DISABLE_ENV = "FURLONG_DISABLE_PLUGINS"
DISABLE_FLAG = "--disable-plugins"


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
    is counted once; one whose metadata cannot be read is left out.
    """
    records: list[EntryRecord] = []
    seen: set[tuple[str, str, str]] = set()
    for dist in md.distributions():
        try:
            dist_name = dist.metadata["Name"] or "?"
        except OSError:  # a *.dist-info without its METADATA (a broken install, or pip writing one right now)
            continue
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
    why: an empty ``DIST`` or ``NAME`` around the ``:``, no plugin of that name, no distribution of that name, or
    a distribution without that plugin; with the closest installed name when one is close."""
    records = read_entry_points() if records is None else records
    unmatched = []
    for item in disabled:
        dist, colon, name = item.rpartition(":")
        if colon and not dist:
            unmatched.append((item, f"no distribution before ':'; write {name} (the plugin of that name in every "
                                    f"distribution) or DIST:{name}."))
            continue
        if colon and not name:
            unmatched.append((item, f"no plugin name after ':'; write {dist}:NAME."))
            continue
        if any(is_disabled(record, [item]) for record in records):
            continue
        if dist and not any(r.dist.lower() == dist.lower() for r in records):
            dists = sorted({r.dist for r in records})
            why = f"no installed distribution '{dist}' offers furlong plugins (those that do: {', '.join(dists)})"
            unmatched.append((item, why + _did_you_mean(dist, dists)))
            continue
        names = sorted({r.name for r in records if not dist or r.dist.lower() == dist.lower()})
        why = f"distribution '{dist}' has no plugin '{name}'" if dist else "no installed plugin has that name"
        unmatched.append((item, f"{why} (furlong plugins lists them){_did_you_mean(name, names)}"))
    return unmatched


def disabled_problems(flag_items: list[str], records: list[EntryRecord] | None = None) -> list[str]:
    """One line per item of ``flag_items`` (``--disable-plugins``) and of ``FURLONG_DISABLE_PLUGINS`` that no
    installed entry point matches (:func:`unmatched_names`), naming where it came from: a typo there would
    leave the plugin meant loaded."""
    records = read_entry_points() if records is None else records
    return [f"{source} {item}: {why}" for source, items in ((DISABLE_FLAG, flag_items), (DISABLE_ENV, disabled_from_env()))
            for item, why in unmatched_names(items, records)]


def check_disabled(flag_items: list[str]) -> None:
    """Refuse a ``--disable-plugins`` or ``FURLONG_DISABLE_PLUGINS`` item that matches no installed plugin.

    :raises PluginError: one line per such item (:func:`disabled_problems`).
    """
    problems = disabled_problems(flag_items)
    if problems:
        raise PluginError("\n".join(problems))


def _did_you_mean(word: str, choices: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(word, choices, n=1)
    return f". Did you mean '{close[0]}'?" if close else "."


def is_disabled(record: EntryRecord, disabled: list[str]) -> bool:
    """True when ``NAME`` or ``DIST:NAME`` of ``record`` is in ``disabled``."""
    for item in disabled:
        dist, colon, name = item.rpartition(":")
        if name == record.name and (dist.lower() == record.dist.lower() if colon else True):
            return True
    return False
