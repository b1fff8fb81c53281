"""The ``configure`` step: every chosen plugin derives and checks its own flags
(docs/architecture.md, "Configure"), after the core validated the flags and resolved the
selection, before any model loads. Core's config knows flags, never algorithm names."""

from __future__ import annotations

import copy
import logging
from argparse import Namespace

import attrs

from furlong.hooks import ConfigReport, DataParallelRule, PluginError

from . import env
from .data_parallel import apply_data_parallel
from .errors import ConfigError
from .parse import names_any
from .megatron_support import report_megatron_flags, report_routing_replay
from ..plugins.manager import OBSERVER_HOOKS, FurlongPluginManager
from ..plugins.miles_paths import MILES_BUILTINS, MILES_FUNCTION_FLAGS
from ..plugins.selection import CHOSEN_HOOKS, Selection, boxed_base, resolve_selection

__all__ = ["Configured", "configure_order", "configure_plugins", "unused_plugin_flags", "with_plugin_problems"]

log = logging.getLogger("furlong.config")


@attrs.define
class Configured:
    """What the ``configure`` step did.

    ``derived``: attribute -> ``{"value": v, "plugin": name}`` for every flag value a
    plugin's ``configure`` set (shown by ``--print-config`` as ``plugin_defaults``).
    ``reports``: one :class:`ConfigReport` per plugin called, in call order.
    ``data_parallel``: the rule the train backend reported (None: it reported none).
    ``machine``: attribute -> ``{"value": v, "probe": why, "plugin": name}`` for the values a
    plugin set from the machine (:meth:`~furlong.hooks.ConfigReport.machine_default`; they are
    in ``derived`` too), shown by ``--print-config`` under ``machine_defaults``.
    """

    derived: dict[str, dict] = attrs.field(factory=dict)
    reports: list[ConfigReport] = attrs.field(factory=list)
    data_parallel: DataParallelRule | None = None
    machine: dict[str, dict] = attrs.field(factory=dict)


def configure_order(args: Namespace, pm: FurlongPluginManager,
                    selection: Selection) -> list[tuple[str, tuple[str, ...]]]:
    """``(plugin name, flags that chose it)`` in the order ``configure`` is called.

    The chosen hooks in :data:`CHOSEN_HOOKS` order, then the filters in flag order, then
    the run-wide reward, then the executor (``selection.chosen["executor"]`` when the
    selection has it, else ``args.executor`` when a plugin of that name is registered).
    A plugin chosen several times appears once, at its first place, with every flag.
    """
    known = [spec.hook for spec in CHOSEN_HOOKS]
    hooks = [h for h in known if h in selection.chosen] + [h for h in selection.chosen if h not in known]
    picks = [selection.chosen[hook] for hook in hooks if hook != "executor"]
    picks.extend(selection.filters)
    if selection.reward:
        picks.append(selection.reward)
    if "executor" in selection.chosen:
        picks.append(selection.chosen["executor"])
    else:
        name = args.executor
        if name and pm.get_plugin(name) is not None:
            picks.append((name, "--executor"))
    order: dict[str, list[str]] = {}
    for name, flag in picks:
        flags = order.setdefault(name, [])
        if flag not in flags:
            flags.append(flag)
    return [(name, tuple(flags)) for name, flags in order.items()]


def configure_plugins(args: Namespace, pm: FurlongPluginManager, selection: Selection, *,
                      after_errors: bool = False, rejected: frozenset[str] = frozenset()) -> Configured:
    """Call ``configure(args, report)`` of every chosen plugin that implements it.

    The chosen train backend's report also lists the Megatron flags given that it does
    not honour (:func:`furlong.core.config.megatron_support.report_megatron_flags`). Its
    data-parallel rule (``report.data_parallel_rule``) sets ``args.data_parallel_size``,
    against which the batch flags are then checked, unless the executor's ``configure``
    refused the trainer's size (:func:`~furlong.core.config.data_parallel.apply_data_parallel`).

    Warnings and notes go to the ``furlong.config`` logger (which ranks other than 0 keep
    quiet); when the run stops on errors only the warnings are logged. A plugin that changes a flag the user gave is an error naming it (the value
    is put back); one that raises is an error naming it (a :class:`PluginError`'s message
    is kept as written).

    :param after_errors: the flags already have reported problems (see
        :func:`with_plugin_problems`): a plugin that raises something other than a
        :class:`PluginError` is taken to trip over them and is not reported again.
    :param rejected: flags whose value was rejected (they hold their defaults): notes and
        warnings naming them are not logged.
    :returns: :class:`Configured`: the values plugins derived, and their reports.
    :raises ConfigError: every error of every plugin, one per line, after the warnings
        were logged.
    """
    implementers = {impl.plugin_name for impl in pm.hook.configure.get_hookimpls()}
    given = set(args.explicit_args)
    machine = env.describe_machine()
    done = Configured()
    errors: list[str] = []
    backend = selection.chosen.get("train_backend", (None, None))[0]
    for name, flags in configure_order(args, pm, selection):
        implements = name in implementers
        if not implements and name != backend:
            continue
        report = ConfigReport(plugin=name, flags=flags, machine=machine)
        before = _snapshot(args)
        try:
            if implements:
                pm.call_setup("configure", name, args=args, report=report)
        except PluginError as exc:
            report.error(str(exc))
        except Exception as exc:  # noqa: BLE001 - name the plugin at fault
            if after_errors:
                log.debug("plugin '%s' failed in `configure` on flags with problems: %r", name, exc)
                continue
            report.error(f"plugin '{name}' ({pm.origin(name)}) failed in `configure`: {type(exc).__name__}: {exc}")
        if name == backend:
            report_megatron_flags(args, name, pm.get_plugin(name), report)
            report_routing_replay(args, name, pm.get_plugin(name), report)
            done.data_parallel = report.data_parallel
        for dest, (old, new) in _changes(before, args).items():
            if dest in given:
                setattr(args, dest, old)
                report.error(f"plugin '{name}' ({pm.origin(name)}) changed {_flag(dest)} in `configure` from "
                             f"{old!r} to {new!r}, but that flag was given; `configure` sets only flags that were "
                             f"not given (args.explicit_args).")
            else:
                done.derived[dest] = {"value": new, "plugin": name}
                if dest in report.machine_defaults:
                    done.machine[dest] = {"value": new, "probe": report.machine_defaults[dest], "plugin": name}
        done.reports.append(report)
        errors.extend(report.errors)
    errors.extend(_critic(args, pm, backend, done.reports))
    executor = selection.chosen.get("executor", (args.executor, None))[0]
    refused = any(report.errors for report in done.reports if report.plugin == executor)
    errors.extend(apply_data_parallel(args, done.data_parallel, check_batches=not refused))
    also_used = {name for report in done.reports for name in report.uses}
    flag_errors, flag_warnings = unused_plugin_flags(args, pm, selection, also_used=also_used, told=errors)
    errors.extend(flag_errors)
    errors.extend(miles_function_flags(args, pm, selection))
    stopped = bool(errors) or after_errors  # a stopped run's errors stand alone: no notes, only warnings
    for report in done.reports:
        for line in report.infos if not stopped else ():
            if not names_any(line, rejected):
                log.info("%s", line)
        for line in report.warnings:
            if not names_any(line, rejected):
                log.warning("%s", line)
    for line in [*flag_warnings, *_critic_flags_unused(args), *_critic_only_run(args)]:
        log.warning("%s", line)
    note = machine_backend_note(args, pm, backend, errors)
    if note:
        log.warning("%s", note)
    if errors:
        raise ConfigError(errors)
    return done


def machine_backend_note(args: Namespace, pm: FurlongPluginManager, backend: str | None,
                         errors: list[str]) -> str | None:
    """One line when an error names ``--train-backend <backend>`` that the user did not give and this
    machine chose instead of the GPU machine's backend (Miles' default, megatron): a Miles script read on a
    laptop is otherwise told what "--train-backend fsdp" cannot do without having asked for it; else None."""
    from .parser import BACKEND_DEFAULTS, device_defaults

    on_gpu = BACKEND_DEFAULTS["train_backend"][0]
    if backend in (None, on_gpu) or "train_backend" in args.explicit_args:
        return None
    if not any(f"--train-backend {backend}" in line for line in errors):
        return None
    probe = device_defaults(pm).probes["train_backend"]
    return (f"--train-backend was not given, so it is {backend}, this machine's default ({probe}); a GPU machine "
            f"with megatron-core chooses {on_gpu}, as Miles does. Give --train-backend {on_gpu} to check the flags "
            "as that run will read them.")


def _critic(args: Namespace, pm: FurlongPluginManager, backend: str | None, reports: list[ConfigReport]) -> list[str]:
    """Set ``args.use_critic`` when a plugin asked for a critic; the problem when the chosen
    ``--train-backend`` cannot build one (it implements no ``critic_backend`` hook), else none."""
    wanted = [report.critic for report in reports if report.critic]
    args.use_critic = bool(wanted)
    if not wanted or backend is None or "critic_backend" in pm.hooks_of(backend):
        return []
    able = sorted(name for name in pm.names_for("critic_backend"))
    choices = f"use --train-backend {' or '.join(able)}" if able else "install a train backend that can"
    return [f"{wanted[0]} trains a critic (value model), but --train-backend {backend} cannot build one (it "
            f"implements no `critic_backend` hook); {choices}."]


CRITIC_FLAGS = {"critic_load": "--critic-load", "critic_save": "--critic-save", "critic_lr": "--critic-lr",
                "critic_lr_warmup_iters": "--critic-lr-warmup-iters", "num_critic_only_steps": "--num-critic-only-steps",
                "value_clip": "--value-clip"}


def _critic_flags_unused(args: Namespace) -> list[str]:
    """A warning naming the critic's flags given to a run that trains no critic (they would do nothing)."""
    given = [flag for dest, flag in CRITIC_FLAGS.items() if dest in args.explicit_args]
    if args.use_critic or not given:
        return []
    return [f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} nothing: this run trains no critic "
            f"(--advantage-estimator {args.advantage_estimator}; --advantage-estimator ppo trains one)."]


def _critic_only_run(args: Namespace) -> list[str]:
    """A warning when a run that trains a critic never trains its actor: ``--num-critic-only-steps`` is
    not below ``--num-rollout`` (the actor trains from rollout ``--num-critic-only-steps`` on). A warning,
    not an error: a run may warm a critic up on purpose, to be resumed with ``--load``."""
    steps, total = args.num_critic_only_steps, args.num_rollout
    if not args.use_critic or not isinstance(total, int) or total <= 0 or steps < total:
        return []
    return [f"--num-critic-only-steps {steps} is not below --num-rollout {total}: this run trains only the critic, "
            f"never the actor (the actor trains from rollout {steps} on; resume with --load and a larger "
            f"--num-rollout to train it)."]


def unused_plugin_flags(args: Namespace, pm: FurlongPluginManager, selection: Selection, *,
                        also_used=frozenset(), told=()) -> tuple[list[str], list[str]]:
    """Errors and warnings for the given flags of plugins this run does not use (``args.plugin_flags_given``).

    A plugin is used when the run chose it (:func:`configure_order`, the base of a
    ``boxed_<name>`` reward included), a chosen plugin runs it (``also_used``: what their
    ``configure`` declared with :meth:`~furlong.hooks.ConfigReport.use_plugin`) or it
    implements an observer hook (observers are broadcast). A flag of any other plugin
    would be read by nothing: an error, naming the flags that would choose the plugin. A
    reward plugin may still be chosen by a sample's ``metadata["rm_type"]`` (a data file
    or an ``--eval-config`` dataset), which the flags cannot tell: its flags get a warning
    instead. A flag that a message of ``told`` (errors already reported) names is left to it.

    :returns: ``(errors, warnings)``, one line each.
    """
    given = args.plugin_flags_given
    if not given:
        return [], []
    used = {name for name, _ in configure_order(args, pm, selection)} | set(also_used)
    if selection.reward:
        used.add(boxed_base(pm, selection.reward[0]) or selection.reward[0])
    errors, warnings = [], []
    for flag, plugin in given.items():
        hooks = set(pm.hooks_of(plugin))
        if plugin in used or hooks & OBSERVER_HOOKS or any(names_any(message, {flag}) for message in told):
            continue
        if "reward" in hooks:
            warnings.append(f"{flag} is a flag of reward plugin '{plugin}' ({pm.origin(plugin)}), which no flag chooses "
                            f"(the run's reward is {selection.reward[0] if selection.reward else 'none'}): it takes "
                            f"effect only for samples whose metadata['rm_type'] is '{plugin}'.")
            continue
        choose = " or ".join(f"{flag_} {plugin}" for flag_ in _choosing_flags(hooks)) or "its hook's flag"
        errors.append(f"{flag} is a flag of plugin '{plugin}' ({pm.origin(plugin)}), which this run does not use: "
                      f"choose the plugin ({choose}) or leave {flag} out.")
    return errors, warnings


def miles_function_flags(args: Namespace, pm: FurlongPluginManager, selection: Selection) -> list[str]:
    """Errors for the given flags that only one of Miles' own functions reads
    (:data:`~furlong.core.plugins.miles_paths.MILES_FUNCTION_FLAGS`: Miles adds them to its parser
    only when that function is chosen), when this run's plugin for that hook is another named
    plugin: they would do nothing. A function of the user's own (a dotted path) may read them."""
    given = set(args.explicit_args or ())
    errors = []
    for flag, (hook, reader) in MILES_FUNCTION_FLAGS.items():
        if flag[2:].replace("-", "_") not in given or hook not in selection.chosen:
            continue
        name, chose = selection.chosen[hook]
        if name == reader or name in pm.path_flags:
            continue
        spec = next(s for s in CHOSEN_HOOKS if s.hook == hook)
        paths = [path for path, entry in MILES_BUILTINS.items() if entry == (hook, reader)]
        miles = f" (Miles: {spec.path_flag} {paths[0]})" if paths and spec.path_flag else ""
        errors.append(f"{flag} is read by {hook} '{reader}'{miles}, and this run's {hook} is '{name}' ({chose}): "
                      f"choose {spec.name_flag} {reader} or leave {flag} out.")
    return errors


def _choosing_flags(hooks: set[str]) -> list[str]:
    """The name flags that can choose a plugin implementing ``hooks``, one per chosen hook among them."""
    flags = [spec.name_flag for spec in CHOSEN_HOOKS if spec.hook in hooks]
    return flags + (["--dynamic-sampling-filter"] if "filter" in hooks else [])


def with_plugin_problems(error: ConfigError, pm: FurlongPluginManager) -> ConfigError:
    """``error`` (from :func:`~furlong.core.config.parse_args`) extended by the problems the
    selection and the chosen plugins' ``configure`` find in the flags that did parse, so one
    report holds every problem (docs/miles.md).

    A problem naming a flag whose value was rejected (``error.bad_flags``) or repeating one
    already listed is left out: it is a consequence of an error already reported.

    :returns: a :class:`ConfigError` (``error`` itself when there is nothing to add).
    """
    args = error.partial
    if args is None:
        return error

    try:
        configure_plugins(args, pm, resolve_selection(args, pm), after_errors=True, rejected=error.bad_flags)
        return error
    except ConfigError as exc:
        more = exc.problems
    except PluginError as exc:
        more = [str(exc)]
    more = [p for p in more if p not in error.problems and not names_any(p, error.bad_flags)]
    return ConfigError(error.problems + more) if more else error


def _snapshot(args: Namespace) -> dict:
    out = {}
    for key, value in vars(args).items():
        try:
            out[key] = copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - an object that cannot be copied is compared by identity
            out[key] = value
    return out


def _changes(before: dict, args: Namespace) -> dict[str, tuple]:
    """``dest -> (old, new)`` for every attribute added or changed since ``before``."""
    missing = object()
    changed = {}
    for key, new in vars(args).items():
        old = before.get(key, missing)
        try:
            same = old is not missing and (old is new or bool(old == new))  # `is`: a nan left as it was
        except Exception:  # noqa: BLE001 - e.g. tensors: compare by identity
            same = old is new
        if not same:
            changed[key] = (None if old is missing else old, new)
    return changed


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")
