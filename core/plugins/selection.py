"""Which plugin serves each hook, from the launch flags (PLUGINS.md, "At a glance")."""

from __future__ import annotations

import logging
from argparse import Namespace

import attrs

from furlong.hooks import PluginError, RunConfig

from .adapters import agent_abort_adapter, make_adapter
from .path_specs import PATH_HOOKS
from .data_choice import data_source_for
from .miles_paths import CORE_DOES_IT, miles_builtin, unmapped_miles_path
from .manager import FurlongPluginManager
from ..config.flag_access import flag_value

__all__ = ["CHOSEN_HOOKS", "Selection", "chosen_reducer", "plugins_of_this_process", "resolve_selection"]

log = logging.getLogger("furlong.config")


@attrs.define(frozen=True)
class ChosenHook:
    """A hook chosen by a name flag, optionally replaced by a dotted-path flag.

    ``path_value``: a name-flag value that only says "the dotted-path flag chooses"
    (Miles' ``--loss-type custom_loss``); without the path it is an error.
    """

    hook: str
    name_attr: str
    name_flag: str
    path_attr: str | None = None
    path_flag: str | None = None
    path_value: str | None = None
    optional: bool = False


CHOSEN_HOOKS = (
    ChosenHook("executor", "executor", "--executor"),
    ChosenHook("data_source", "data_source", "--data-source", "data_source_path", "--data-source-path"),
    ChosenHook("rollout_engine", "rollout_backend", "--rollout-backend"),
    ChosenHook("train_backend", "train_backend", "--train-backend"),
    ChosenHook("rollout", "rollout", "--rollout", "rollout_function_path", "--rollout-function-path"),
    ChosenHook("generate", "generate", "--generate", "custom_generate_function_path", "--custom-generate-function-path"),
    ChosenHook("buffer_pop", "buffer_filter", "--buffer-filter", "buffer_filter_path", "--buffer-filter-path"),
    ChosenHook("advantage", "advantage_estimator", "--advantage-estimator",
               "custom_advantage_function_path", "--custom-advantage-function-path"),
    ChosenHook("loss", "loss_type", "--loss-type", "custom_loss_function_path", "--custom-loss-function-path",
               "custom_loss"),
    ChosenHook("loss_reducer", "loss_reducer", "--loss-reducer", "custom_pg_loss_reducer_function_path",
               "--custom-pg-loss-reducer-function-path", optional=True),
)


@attrs.define
class Selection:
    """The resolved choice for every hook: ``chosen[hook] = (plugin name, flag that chose it)``.

    ``filters``: ``(name, flag)`` in flag order. ``reward``: the run-wide default reward
    ``(name, flag)`` or None (samples may still name one in ``metadata["rm_type"]``).
    ``paths``: ``paths[hook] = (dotted path, flag)`` for the hooks of
    :mod:`furlong.core.plugins.path_specs` whose flag was given.
    """

    chosen: dict[str, tuple[str, str]] = attrs.field(factory=dict)
    filters: list[tuple[str, str]] = attrs.field(factory=list)
    reward: tuple[str, str] | None = None
    paths: dict[str, tuple[str, str]] = attrs.field(factory=dict)

    def name(self, hook: str) -> str:
        return self.chosen[hook][0]

    def flag(self, hook: str) -> str:
        return self.chosen[hook][1]

    def as_dict(self) -> dict:
        """``{hook: name}`` (filters as a list) for ``--print-config``."""
        out = {hook: name for hook, (name, _) in self.chosen.items()}
        out["filter"] = [name for name, _ in self.filters]
        out["reward"] = self.reward[0] if self.reward else None
        return out


def resolve_selection(args: Namespace, pm: FurlongPluginManager, hooks: tuple[str, ...] | None = None) -> Selection:
    """Resolve every chosen plugin, registering dotted-path adapters; fail before any model loads.

    :param hooks: restrict to these hooks (default: all).
    :raises PluginError: an unknown, broken, conflicting or hook-less plugin, or a bad
        dotted path (see :meth:`FurlongPluginManager.chosen_impl`).
    """
    errors: list[str] = []
    selection = Selection()
    for spec in CHOSEN_HOOKS:
        if hooks is not None and spec.hook not in hooks:
            continue
        try:
            choice = _by_file(args, pm) if spec.hook == "data_source" else None
            choice = choice or _resolve_one(args, pm, spec)
            if choice is not None:
                selection.chosen[spec.hook] = choice
        except PluginError as exc:
            errors.append(str(exc))
    if hooks is None or "filter" in hooks:
        try:
            selection.filters = _resolve_filters(args, pm)
        except PluginError as exc:
            errors.append(str(exc))
    if hooks is None or "reward" in hooks:
        try:
            selection.reward = resolve_default_reward(args, pm)
        except PluginError as exc:
            errors.append(str(exc))
    for hook, attr in PATH_HOOKS.items():
        path = flag_value(args, attr)
        if path and (hooks is None or hook in hooks):
            flag = "--" + attr.replace("_", "-")
            if miles_builtin(path, hook) == CORE_DOES_IT:
                log.info("%s %s: furlong's core does this by itself; nothing to call.", flag, path)
                continue
            try:
                selection.paths[hook] = (register_path(pm, hook, path, flag), flag)
            except PluginError as exc:
                errors.append(str(exc))
    if args.custom_agent_function_path and (hooks is None or "abort" in hooks):
        try:
            _register_agent_abort(args.custom_agent_function_path, pm)
        except PluginError as exc:
            errors.append(str(exc))
    if errors:
        raise PluginError("\n".join(errors))
    return selection


def plugins_of_this_process(config: RunConfig, hooks: tuple[str, ...] | None = None) -> FurlongPluginManager:
    """The plugin manager of a process the executor started (a Ray actor): seeded, with the run's selection.

    Seeds the process's generators from ``--seed``, loads the installed plugins (less
    ``--disable-plugins``) and registers the dotted-path adapters of ``hooks`` (all by
    default), as the driver did for the run.
    """
    from .manager import get_plugin_manager
    from ..run.seeding import seed_everything

    seed_everything(config.seed, config.deterministic_mode)
    pm = get_plugin_manager(config.disable_plugins)
    resolve_selection(config, pm, hooks)
    return pm


def register_path(pm: FurlongPluginManager, hook: str, path: str, flag: str, rm_type: str | None = None) -> str:
    """Register the adapter for dotted ``path`` under the path itself; return that name.

    Miles' own paths to functions furlong has as built-in plugins
    (:data:`furlong.core.plugins.miles_paths.MILES_BUILTINS`) return the plugin's name instead,
    when that plugin is installed and enabled (``rm_type``: ``--rm-type``, for Miles'
    ``async_rm``).
    """
    builtin = miles_builtin(path, hook, rm_type)
    if builtin is not None and pm.get_plugin(builtin) is not None:
        log.info("%s %s: furlong's built-in plugin '%s' does this; using it.", flag, path, builtin)
        return builtin
    unmapped = unmapped_miles_path(path, hook, flag) if builtin is None else None
    if unmapped:
        raise PluginError(unmapped)
    if pm.get_plugin(path) is None:
        pm.register_checked(make_adapter(hook, path, flag), path)
        pm.path_flags[path] = flag
    return path


def _resolve_one(args: Namespace, pm: FurlongPluginManager, spec: ChosenHook) -> tuple[str, str] | None:
    """``(name, flag)`` of the plugin serving ``spec.hook``; None for an optional hook no flag chose."""
    path = flag_value(args, spec.path_attr) if spec.path_attr else None
    if path:
        name, flag = register_path(pm, spec.hook, path, spec.path_flag), spec.path_flag
    else:
        name, flag = flag_value(args, spec.name_attr), spec.name_flag
        if spec.optional and not name:
            return None
        if spec.path_value is not None and name == spec.path_value:
            raise PluginError(f"{flag} {name} needs {spec.path_flag} module.function.")
    try:
        pm.chosen_impl(spec.hook, name, flag)
    except PluginError as exc:
        if path or spec.name_attr in args.explicit_args:
            raise
        raise PluginError(f"{exc}\n  ({flag} was not given; '{name}' is its default here.)") from None
    return name, flag


def _by_file(args: Namespace, pm: FurlongPluginManager) -> tuple[str, str] | None:
    """The data source chosen by the ``--prompt-data`` file (no data source flag given), checked; or None."""
    choice = data_source_for(args, pm, args.prompt_data, "--prompt-data")
    if choice is not None:
        pm.chosen_impl("data_source", *choice)
    return choice


def chosen_reducer(args: Namespace, pm: FurlongPluginManager) -> tuple[str, str] | None:
    """``(name, flag)`` of the ``loss_reducer`` plugin the flags choose (its adapter registered), or None."""
    spec = next(s for s in CHOSEN_HOOKS if s.hook == "loss_reducer")
    return _resolve_one(args, pm, spec)


def _resolve_filters(args: Namespace, pm: FurlongPluginManager) -> list[tuple[str, str]]:
    filters = [(name, "--dynamic-sampling-filter") for name in (args.dynamic_sampling_filter or [])]
    for path in _as_list(args.dynamic_sampling_filter_path):
        filters.append((register_path(pm, "filter", path, "--dynamic-sampling-filter-path"), "--dynamic-sampling-filter-path"))
    errors = []
    for name, flag in filters:
        try:
            pm.chosen_impl("filter", name, flag)
        except PluginError as exc:
            errors.append(str(exc))
    if errors:
        raise PluginError("\n".join(errors))
    return filters


def resolve_default_reward(args: Namespace, pm: FurlongPluginManager) -> tuple[str, str] | None:
    """The run-wide reward: ``--custom-rm-path`` over ``--rm-type``; checked, boxed rule included."""
    if args.custom_rm_path:
        return register_path(pm, "reward", args.custom_rm_path, "--custom-rm-path", args.rm_type), "--custom-rm-path"
    if args.rm_type:
        check_reward_name(pm, args.rm_type, "--rm-type")
        return args.rm_type, "--rm-type"
    return None


def check_reward_name(pm: FurlongPluginManager, name: str, flag: str) -> None:
    """Raise PluginError unless ``name`` (or the base of ``boxed_<name>``) implements ``reward``."""
    base = boxed_base(pm, name)
    if base is None:
        pm.chosen_impl("reward", name, flag)
        return
    try:
        pm.chosen_impl("reward", base, flag)
    except PluginError as exc:
        raise PluginError(f"{flag} '{name}' grades the last \\boxed{{}} with reward plugin '{base}':\n  {exc}") from exc


def boxed_base(pm: FurlongPluginManager, name: str) -> str | None:
    """For ``boxed_<base>`` with no plugin of that exact name, return ``<base>``; else None."""
    if name.startswith("boxed_") and pm.get_plugin(name) is None:
        return name[len("boxed_"):]
    return None


def _register_agent_abort(path: str, pm: FurlongPluginManager) -> None:
    name = f"{path}:abort"
    if pm.get_plugin(name) is None:
        adapter = agent_abort_adapter(path)
        if adapter is not None:
            pm.register_checked(adapter, name)
            pm.path_flags[name] = "--custom-agent-function-path"


def _as_list(value) -> list:
    if not value:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
