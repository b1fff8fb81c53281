"""The plugin manager: discovery, selection by name, and the core's calling rules.

pluggy supplies the specs, markers, registration and validation; this module calls the
implementations itself (PLUGINS.md, "How plugins work"), in one of two ways: from async
code (:meth:`~FurlongPluginManager.call_chosen`, :meth:`~FurlongPluginManager.broadcast`,
:meth:`~FurlongPluginManager.notify`, :meth:`~FurlongPluginManager.run_filters`), which awaits
coroutines, or from set-up code (:meth:`~FurlongPluginManager.call_setup`, for
``add_arguments`` and ``configure``), which calls plain functions only. Both time every
non-observer call and report it to ``on_hook_call``. No other module calls plugin code.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import os
import time
from typing import Any, Iterable

import pluggy

from furlong.hooks import PROJECT, FilterResult, PluginError, specs
from furlong.hooks.old_form import old_form_args, warn_old_form
from furlong.hooks.contract import (argument_name_problems, check_filter_result, no_hookimpl_problem,
                                    unknown_hook_problems)

from . import path_specs
from .discovery import (DISABLE_ENV, DISABLE_FLAG, EntryRecord, disabled_from_env, is_disabled, read_entry_points,
                        split_names)

__all__ = ["FurlongPluginManager", "get_plugin_manager", "OBSERVER_HOOKS", "WARN_ONLY_HOOKS"]

log = logging.getLogger("furlong.plugins")

OBSERVER_HOOKS = frozenset(
    {"on_rollout_end", "on_train_step_end", "on_eval_end", "on_checkpoint_saved", "on_hook_call"}
)
WARN_ONLY_HOOKS = OBSERVER_HOOKS | {"abort"}
TRACE_ENV = "FURLONG_TRACE_HOOKS"


class FurlongPluginManager(pluggy.PluginManager):
    """A pluggy ``PluginManager`` that knows where each plugin came from.

    ``records`` maps a registered plugin name to its entry point; ``broken`` maps a name
    to the error that kept it from loading; ``conflicts`` maps a name registered by two or
    more distributions to their records (none of them is loaded); ``disabled`` maps a name
    whose entry point ``--disable-plugins`` or ``FURLONG_DISABLE_PLUGINS`` skipped to that
    record, the source (the flag or the variable) and the item that matched it.
    """

    def __init__(self) -> None:
        super().__init__(PROJECT)
        self.add_hookspecs(specs)
        self.add_hookspecs(path_specs)
        self.records: dict[str, EntryRecord] = {}
        self.broken: dict[str, tuple[EntryRecord | None, str]] = {}
        self.conflicts: dict[str, list[EntryRecord]] = {}
        self.disabled: dict[str, tuple[EntryRecord, str, str]] = {}
        self.path_flags: dict[str, str] = {}
        self.set_aside_names: set[str] = set()
        self.trace_calls = os.environ.get(TRACE_ENV, "") not in ("", "0")

    # --- describing plugins ------------------------------------------------------------

    def hooks_of(self, name: str) -> list[str]:
        """Names of the hooks plugin ``name`` implements, sorted."""
        plugin = self.get_plugin(name)
        if plugin is None:
            return []
        return sorted(caller.name for caller in self.get_hookcallers(plugin) or [])

    def origin(self, name: str) -> str:
        """``"dist version"`` of plugin ``name``, or where an in-process plugin came from."""
        record = self.records.get(name)
        if record:
            return record.label
        if name in self.path_flags:
            return f"from {self.path_flags[name]}"
        return "registered in-process"

    def names_for(self, hook: str) -> list[str]:
        """Enabled plugin names implementing ``hook``, sorted."""
        caller = getattr(self.hook, hook)
        return sorted({impl.plugin_name for impl in caller.get_hookimpls()})

    def describe(self) -> list[dict]:
        """One row per plugin (loaded, broken or conflicting), for ``furlong plugins``."""
        rows = []
        for name in sorted(set(self.list_name_plugin_names()) | set(self.broken) | set(self.conflicts)):
            if name in self.conflicts:
                for rec in self.conflicts[name]:
                    rows.append(_row(name, [], rec.dist, rec.version, "conflict", rec.value))
            elif name in self.broken:
                rec, error = self.broken[name]
                rows.append(_row(name, [], rec.dist if rec else "?", rec.version if rec else "?", "broken", error))
            else:
                rec = self.records.get(name)
                rows.append(
                    _row(name, self.hooks_of(name), rec.dist if rec else "-", rec.version if rec else "-", "ok",
                         rec.value if rec else "")
                )
        return rows

    def list_name_plugin_names(self) -> list[str]:
        return [name for name, _ in self.list_name_plugin()]

    # --- selecting ---------------------------------------------------------------------

    def chosen_impl(self, hook: str, name: str, flag: str) -> pluggy.HookImpl:
        """The implementation of ``hook`` in plugin ``name``, chosen by ``flag``.

        :raises PluginError: unknown name (lists the available ones and a "did you mean"; for a
            plugin that ``--disable-plugins`` or ``FURLONG_DISABLE_PLUGINS`` turned off, says which),
            a name two distributions register, a plugin that failed to import, or a plugin
            that does not implement ``hook`` (lists the hooks it does implement).
        """
        if name in self.conflicts:
            raise PluginError(conflict_message(name, self.conflicts[name]))
        if name in self.broken:
            record, error = self.broken[name]
            where = f"entry point '{record.name} = {record.value}' of {record.label}" if record else "it"
            verb = "was set aside" if name in self.set_aside_names else "failed to load"
            raise PluginError(f"{flag} '{name}': plugin '{name}' is broken: {where} {verb}: {error}")
        plugin = self.get_plugin(name)
        if plugin is None:
            raise PluginError(self._unknown_message(hook, name, flag))
        for impl in getattr(self.hook, hook).get_hookimpls():
            if impl.plugin_name == name:
                return impl
        implemented = ", ".join(self.hooks_of(name))
        raise PluginError(
            f"{flag} '{name}': plugin '{name}' ({self.origin(name)}) does not implement `{hook}`; "
            + (f"it implements: {implemented}." if implemented else "it implements no hook.")
        )

    def _unknown_message(self, hook: str, name: str, flag: str) -> str:
        if name in self.disabled:
            record, source, item = self.disabled[name]
            return (f"{flag} '{name}': plugin '{name}' ({record.label}) is installed but turned off by {source} "
                    f"{item}; remove '{item}' from {source} to use it.")
        available = self.names_for(hook)
        listing = ", ".join(f"{n} ({self.origin(n)})" for n in available) or "none"
        lines = [f"{flag} '{name}': no installed plugin of that name implements `{hook}`.", f"  Available: {listing}."]
        close = difflib.get_close_matches(name, available, n=1)
        hint = f"  Did you mean '{close[0]}'? " if close else "  "
        lines.append(hint + f"List them with: furlong plugins --hook {hook}")
        return "\n".join(lines)

    # --- calling -----------------------------------------------------------------------
    # Two ways in: ``_call`` from async code (awaits what an implementation returns) and
    # ``_call_setup`` from set-up code (plain functions only). Both time the call, trace it
    # and tell the ``on_hook_call`` observers through one ``_ObservedCall``.

    async def call_chosen(self, hook: str, name: str, flag: str, /, **kwargs: Any) -> Any:
        """Call plugin ``name``'s implementation of ``hook``; await it if it is a coroutine.

        :raises PluginError: the plugin cannot be chosen (see :meth:`chosen_impl`) or
            returned None from a hook whose spec returns something.
        """
        impl = self.chosen_impl(hook, name, flag)
        result = await self._call(hook, impl, kwargs)
        if result is None and self._returns_result(hook):
            expected = ("expected FilterResult or bool" if hook == "filter"
                        else f"a chosen `{hook}` must return its result")
            raise PluginError(f"plugin '{name}' ({self.origin(name)}) returned None from `{hook}` (chosen by {flag}); "
                              f"{expected}.")
        return result

    def _returns_result(self, hook: str) -> bool:
        spec = getattr(self.hook, hook).spec
        return spec is None or inspect.signature(spec.function).return_annotation not in (None, "None")

    async def broadcast(self, hook: str, /, **kwargs: Any) -> list[Any]:
        """Call every implementation of ``hook`` separately; return their results.

        For ``abort`` and observers a failure is logged as a warning. For other hooks every
        implementation still runs, then the first failure is raised as a PluginError
        naming its plugin.
        """
        results, failures = [], []
        for impl in getattr(self.hook, hook).get_hookimpls():
            try:
                results.append(await self._call(hook, impl, kwargs))
            except Exception as exc:  # noqa: BLE001 - one plugin must not stop the others
                failures.append((impl.plugin_name, exc))
                if hook in WARN_ONLY_HOOKS:
                    _warn_failed(impl, hook, exc)
        if failures and hook not in WARN_ONLY_HOOKS:
            name, exc = failures[0]
            raise PluginError(f"plugin '{name}' ({self.origin(name)}) failed in `{hook}`: {type(exc).__name__}: {exc}") from exc
        return results

    async def notify(self, hook: str, /, **kwargs: Any) -> None:
        """Broadcast an observer hook (failures are warnings)."""
        await self.broadcast(hook, **kwargs)

    async def run_filters(self, names: Iterable[str], flag: str, /, **kwargs: Any) -> FilterResult:
        """Run filters one by one in the given order; the first that rejects gives the reason."""
        for name in names:
            try:
                result = await self.call_chosen("filter", name, flag, **kwargs)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(f"filter plugin '{name}' ({self.origin(name)}) failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
            result = check_filter_result(result, f"plugin '{name}' ({self.origin(name)})")
            if not result.keep:
                return result
        return FilterResult(keep=True)

    def call_setup(self, hook: str, name: str, /, **kwargs: Any) -> Any:
        """Call plugin ``name``'s implementation of set-up hook ``hook`` (``add_arguments``, ``executor_fit``,
        ``configure``) from synchronous code, and return what it returns.

        Set-up hooks are plain functions: they run while the parser is built and the flags
        are configured, before the run's event loop starts, and nothing awaits them.

        :raises PluginError: plugin ``name`` does not implement ``hook``, or its
            implementation is ``async def`` (returned an awaitable; nothing of it ran).
            What the implementation raises passes through unchanged.
        """
        for impl in getattr(self.hook, hook).get_hookimpls():
            if impl.plugin_name == name:
                return self._call_setup(hook, impl, kwargs)
        raise PluginError(f"plugin '{name}' ({self.origin(name)}) does not implement `{hook}`.")

    async def _call(self, hook: str, impl: pluggy.HookImpl, kwargs: dict) -> Any:
        call = _ObservedCall(hook, impl.plugin_name, kwargs, self.trace_calls)
        try:
            with call:
                result = impl.function(**_select(impl, kwargs))
                if inspect.isawaitable(result):
                    result = await result
                return call.returned(result)
        finally:
            if call.event is not None:
                await self.broadcast("on_hook_call", **call.event)

    def _call_setup(self, hook: str, impl: pluggy.HookImpl, kwargs: dict) -> Any:
        call = _ObservedCall(hook, impl.plugin_name, kwargs, self.trace_calls)
        try:
            with call:
                result = impl.function(**_select(impl, kwargs))
                if inspect.isawaitable(result):
                    result = _old_async_configure(hook, impl, result)
                return call.returned(result)
        finally:
            if call.event is not None:
                self._notify_setup(call.event)

    def _notify_setup(self, event: dict) -> None:
        """Tell the ``on_hook_call`` observers of a set-up call; an ``async def`` observer is awaited when no event
        loop is running, else scheduled on the running loop (no second loop, no thread)."""
        for impl in self.hook.on_hook_call.get_hookimpls():
            try:
                result = impl.function(**_select(impl, event))
                if inspect.isawaitable(result):
                    _finish_observer(impl, result)
            except Exception as exc:  # noqa: BLE001 - an observer must not stop set-up
                _warn_failed(impl, "on_hook_call", exc)

    # --- registration --------------------------------------------------------------------

    def register_checked(self, plugin: object, name: str, record: EntryRecord | None = None) -> bool:
        """Register ``plugin`` under ``name``; on a validation error mark it broken and return False.

        :raises PluginError: ``name`` is already registered (the registered plugin stays).
        """
        if self.get_plugin(name) is not None:
            raise PluginError(f"plugin name '{name}' is already registered ({self.origin(name)}).")
        other = self.get_name(plugin)
        if other is not None:
            self.broken[name] = (record, f"it is the object already registered as plugin '{other}'; "
                                         "give each name its own object (entry point 'module:object')")
            return False
        try:
            self.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            self.broken[name] = (record, argument_name_problems(self, plugin) or f"{type(exc).__name__}: {exc}")
            if self.get_plugin(name) is plugin:
                self.unregister(name=name)
            return False
        internal = tuple(path_specs.PATH_HOOKS) if getattr(plugin, "dotted_path_adapter", False) else ()
        problem = unknown_hook_problems(self, plugin, internal) or no_hookimpl_problem(self, plugin)
        if problem:
            self.unregister(name=name)
            self.broken[name] = (record, problem)
            return False
        if record is not None:
            self.records[name] = record
        return True

    def set_aside(self, name: str, reason: str) -> None:
        """Unregister plugin ``name`` and list it as broken for ``reason`` (it can no longer be chosen)."""
        if self.get_plugin(name) is not None:
            self.unregister(name=name)
        self.broken[name] = (self.records.pop(name, None), reason)
        self.set_aside_names.add(name)

def conflict_message(name: str, records: list[EntryRecord]) -> str:
    owners = "; ".join(f"{r.label} -> {r.value}" for r in records)
    pick = records[-1]
    return (
        f"plugin name '{name}' is registered twice in entry-point group '{PROJECT}':\n"
        f"  {owners}.\n"
        f"  Uninstall one, or pick one with --disable-plugins {pick.dist}:{name}."
    )


def get_plugin_manager(disable: str | list[str] | None = None) -> FurlongPluginManager:
    """A fresh manager with every enabled entry point of group ``furlong`` registered.

    :param disable: ``NAME`` or ``DIST:NAME`` items (a list, or comma-separated text) not to
        load, added to those of ``FURLONG_DISABLE_PLUGINS``.
    """
    pm = FurlongPluginManager()
    sources = ((DISABLE_FLAG, split_names(disable)), (DISABLE_ENV, disabled_from_env()))
    by_name: dict[str, list[EntryRecord]] = {}
    for record in read_entry_points():
        skipped = [(source, item) for source, items in sources for item in items if is_disabled(record, [item])]
        if skipped:
            pm.disabled.setdefault(record.name, (record, *skipped[0]))
        else:
            by_name.setdefault(record.name, []).append(record)
    for name, records in by_name.items():
        if len(records) > 1:
            pm.conflicts[name] = records
            continue
        record = records[0]
        try:
            plugin = record.entry_point.load()
        except Exception as exc:  # noqa: BLE001 - any import failure marks the plugin broken
            pm.broken[name] = (record, f"{type(exc).__name__}: {exc}")
            continue
        pm.register_checked(plugin, name, record)
    pm.check_pending()
    return pm


def _select(impl: pluggy.HookImpl, kwargs: dict) -> dict:
    """The arguments ``impl`` asks for; an implementation that asks for ``args`` where the core
    passes ``config`` gets ``config.namespace()``: an old-form plugin (accepted until the next minor
    version, with a warning) or an adapter handing it to a Miles-style function (``dotted_path_adapter``)."""
    chosen = {name: kwargs[name] for name in impl.argnames if name in kwargs}
    if "args" in impl.argnames and "args" not in kwargs and "config" in kwargs:
        if not getattr(impl.plugin, "dotted_path_adapter", False):  # an adapter of a Miles-style function
            _warn_old_form(impl)
        chosen["args"] = old_form_args(kwargs)
    return chosen


def _old_async_configure(hook: str, impl: pluggy.HookImpl, result: Any) -> Any:
    """Run an ``async def configure`` to its end, with a ``DeprecationWarning``, when no event loop is running
    (the old form, accepted until the next minor version); any other awaitable from a set-up hook is refused.

    :raises PluginError: ``hook`` is not ``configure``, or an event loop is running.
    """
    import asyncio

    try:
        asyncio.get_running_loop()
        running = True
    except RuntimeError:
        running = False
    if hook != "configure" or running:
        getattr(result, "close", lambda: None)()  # never awaited on purpose: no "never awaited" warning
        raise PluginError(f"plugin '{impl.plugin_name}': `{hook}` may not be async def; set-up hooks "
                          f"run before the event loop starts (make it a plain def).")
    warn_old_form(impl.plugin_name, "configure", "`async def configure`",
                  "make it a plain def (set-up hooks run before the event loop starts)")

    async def finish():
        return await result

    return asyncio.run(finish())


def _warn_old_form(impl: pluggy.HookImpl) -> None:
    hook = impl.function.__name__
    warn_old_form(impl.plugin_name, hook, f"`{hook}(args, ...)`", "take `config` (a furlong.hooks.RunConfig) instead")


class _ObservedCall:
    """One call of one implementation: its wall-clock time, its error, the trace line of its result.

    ``event`` is the ``on_hook_call`` keyword arguments once the call ended (None for an
    observer hook, which is never timed).
    """

    def __init__(self, hook: str, plugin: str, kwargs: dict, trace: bool):
        self.hook, self.plugin, self.kwargs, self.trace = hook, plugin, kwargs, trace
        self.event: dict | None = None

    def __enter__(self) -> "_ObservedCall":
        self.start = time.perf_counter()
        return self

    def returned(self, result: Any) -> Any:
        if self.trace:
            log.info("hook %s[%s](%s) -> %r", self.hook, self.plugin, _brief(self.kwargs), result)
        return result

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.hook not in OBSERVER_HOOKS:
            self.event = {"hook": self.hook, "plugin": self.plugin, "seconds": time.perf_counter() - self.start,
                          "error": None if exc is None else f"{type(exc).__name__}: {exc}"}
        return False


def _finish_observer(impl: pluggy.HookImpl, awaitable) -> None:
    """Await an ``on_hook_call`` observer's coroutine from synchronous code without a second event
    loop: run it now when no loop is running, else schedule it on the running loop."""
    import asyncio

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(_observer_done(impl, awaitable))
        return
    task = loop.create_task(_observer_done(impl, awaitable))
    _PENDING_OBSERVERS.add(task)
    task.add_done_callback(_PENDING_OBSERVERS.discard)


_PENDING_OBSERVERS: set = set()


async def _observer_done(impl: pluggy.HookImpl, awaitable) -> None:
    try:
        await awaitable
    except Exception as exc:  # noqa: BLE001 - an observer's failure is a warning
        _warn_failed(impl, "on_hook_call", exc)


def _warn_failed(impl: pluggy.HookImpl, hook: str, exc: BaseException) -> None:
    log.warning("plugin '%s' failed in `%s`: %s: %s", impl.plugin_name, hook, type(exc).__name__, exc)


def _brief(kwargs: dict) -> str:
    return ", ".join(f"{k}={type(v).__name__}" for k, v in kwargs.items())


def _row(name, hooks, dist, version, status, detail) -> dict:
    return {"name": name, "hooks": hooks, "distribution": dist, "version": version, "status": status, "detail": detail}
