"""Freezing the launch flags into the run's :class:`~furlong.hooks.RunConfig`, once every chosen plugin configured itself."""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Mapping
from typing import Any

import attrs

from furlong.hooks.run_config import FrozenMap, PluginConfig, RunConfig, freeze_value

__all__ = ["field_problems", "freeze_config"]

PLUGINS_FIELD = "plugins"

SET_WHEN_THEY_APPLY = {"packed_by_default": None}
"""Derived fields the parse sets only when they apply (``--print-config`` shows them only then), with their
value otherwise."""


def freeze_config(args: argparse.Namespace, plugin_flags: Mapping[str, tuple[str, str]],
                  derived: Mapping[str, Mapping[str, Any]] = FrozenMap()) -> RunConfig:
    """The frozen configuration of a run whose flags are ``args``.

    :param args: the Namespace after parsing and every chosen plugin's ``configure``.
    :param plugin_flags: ``{dest: (flag, plugin)}`` of the flags plugins added (the parser's
        ``plugin_flags``).
    :param derived: ``{attribute: {"value": v, "plugin": name}}`` of what plugins' ``configure``
        set (:class:`~furlong.core.config.configure.Configured`): an attribute that is no field
        and no plugin flag goes to that plugin's section.
    :returns: the :class:`RunConfig`; lists become tuples, dicts read-only maps, an int given
        for a float field a float.
    :raises TypeError: a field ``args`` lacks, a value whose type does not match its field,
        or an attribute that is no field, no plugin flag and nothing a plugin derived (each
        is a defect of whoever built ``args``; the message names them all).
    """
    values = {**SET_WHEN_THEY_APPLY, **vars(args)}
    fields = _field_types()
    sections: dict[str, dict] = {}
    for dest, (_flag, plugin) in plugin_flags.items():
        if dest in values:
            sections.setdefault(plugin, {})[dest] = freeze_value(values[dest])
    for dest, record in derived.items():
        if dest not in fields and dest not in plugin_flags:
            sections.setdefault(record["plugin"], {})[dest] = freeze_value(record["value"])
    missing = sorted(name for name in fields if name not in values)
    stray = sorted(name for name in values
                   if name not in fields and name not in plugin_flags and name not in derived
                   and name not in args_megatron_dests(args) and name not in _overlay_extras(args))
    kwargs = {name: _typed(values[name], fields[name]) for name in fields if name in values}
    problems = field_problems(kwargs)
    if missing:
        problems.append(f"missing: {', '.join(missing)}")
    if stray:
        problems.append(f"no flag, derived field or plugin value: {', '.join(stray)}")
    if problems:
        raise TypeError("cannot freeze the run configuration: " + "; ".join(problems))
    kwargs[PLUGINS_FIELD] = FrozenMap({name: PluginConfig(name, data) for name, data in sorted(sections.items())})
    return RunConfig(**kwargs)


def _overlay_extras(args: argparse.Namespace) -> set[str]:
    """The ``--custom-config-path`` keys that are no flag (held in ``custom_config_extras`` too)."""
    return set(vars(args).get("custom_config_extras") or ())


def args_megatron_dests(args: argparse.Namespace) -> set[str]:
    """The attributes of the Megatron-LM-only flags given (held in ``megatron_args`` too)."""
    return set(vars(args).get("megatron_args") or ())  # a Namespace that lacks it is reported as missing


def field_problems(values: Mapping[str, Any]) -> list[str]:
    """``"name: expected T, got V"`` for each value that does not match its field's type."""
    fields = _field_types()
    return [f"{name}: expected {_show(fields[name])}, got {value!r}" for name, value in values.items()
            if name in fields and not _fits(value, fields[name])]


def _field_types() -> dict[str, Any]:
    if not hasattr(_field_types, "cache"):
        hints = typing.get_type_hints(RunConfig)
        _field_types.cache = {f.name: hints[f.name] for f in attrs.fields(RunConfig) if f.name != PLUGINS_FIELD}
    return _field_types.cache


def _typed(value: Any, tp: Any) -> Any:
    value = freeze_value(value)
    if isinstance(value, int) and not isinstance(value, bool) and float in _options(tp) and int not in _options(tp):
        return float(value)
    return value


def _options(tp: Any) -> tuple:
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def _fits(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, float)
    if tp is str:
        return isinstance(value, str)
    if origin is tuple:
        item = typing.get_args(tp)[0]
        return isinstance(value, tuple) and all(_fits(v, item) for v in value)
    if origin is Mapping or tp is Mapping:
        return isinstance(value, Mapping)
    return isinstance(value, tp) if isinstance(tp, type) else True


def _show(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "").replace("collections.abc.", "")
