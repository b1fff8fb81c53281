"""A contract test kit for plugin authors: call a plugin's hooks the way the core does, check what comes back.

Use it in your plugin's own tests::

    from furlong.hooks.testing import check_plugin
    import my_plugin

    def test_my_plugin_meets_the_furlong_contract():
        report = check_plugin(my_plugin, "my_plugin")
        assert "reward" in report.checked

:func:`check_plugin` registers the plugin in a pluggy manager holding furlong's hookspecs
(so a misspelled hook or argument fails here, as it would when furlong loads it), then
calls every hook it implements that the kit can exercise without a model or a cluster,
with realistic inputs: :class:`~furlong.hooks.Sample` objects, a tiny deterministic
engine (:class:`TinyEngine`) for ``generate``, and ``AdvantageInput``/``LossInput``
tensors of the right shapes. What comes back is checked with the same functions the core
applies where a plugin's output enters it (:mod:`furlong.hooks.contract`), plus a few
rules the core cannot afford to check on every call (finite advantages and losses, a
loss that carries grad, the token budget across turns). A broken rule raises
:class:`ContractViolation` naming the plugin, the hook and the rule.

The hooks get the run configuration the caller builds with
``furlong.core.config.launch_args.launch_config(...)`` (``configure`` gets its
``namespace()``, the mutable set-up view), as in a run::

    from furlong.core.config.launch_args import launch_config

    report = check_plugin(my_plugin, "my_plugin", config=launch_config("--rm-type", "my_plugin"))

Not exercised (they need a model, files or a cluster): ``rollout``, ``rollout_engine``,
``train_backend``, ``executor``; ``data_source`` only when a ``dataset``
(:class:`~furlong.hooks.DatasetSpec`) is given. They are listed in :attr:`ContractReport.not_exercised`; test them with a
short ``furlong train`` in a subprocess (:mod:`.processes` starts one in a known signal state,
for tests that stop it with a signal).
"""

from __future__ import annotations

from typing import Any

import attrs
import pluggy

from .. import specs
from ..contract import argument_name_problems, no_hookimpl_problem, unknown_hook_problems
from ..errors import PluginError
from ..markers import PROJECT
from ..run_config import RunConfig
from ..types import DatasetSpec
from .checks import CHECKS, NOT_EXERCISED, ORDER, Caller, ContractViolation, KitRun, NoConfigGiven
from .inputs import CharTokenizer, TinyEngine, advantage_input, loss_input, sample_group

__all__ = ["CharTokenizer", "ContractReport", "ContractViolation", "NoConfigGiven", "TinyEngine", "advantage_input",
           "check_plugin", "loss_input", "sample_group"]


@attrs.define
class ContractReport:
    """What :func:`check_plugin` did: ``checked`` hooks, in order, and ``not_exercised`` ``{hook: why}``."""

    plugin: str
    checked: list[str] = attrs.field(factory=list)
    not_exercised: dict[str, str] = attrs.field(factory=dict)


def check_plugin(plugin: object, name: str, config: RunConfig | None = None, engine: Any = None,
                 dataset: DatasetSpec | None = None) -> ContractReport:
    """Check every hook ``plugin`` implements against furlong's hook contract.

    :param plugin: the plugin object (usually the module your entry point names).
    :param name: its entry-point name (flags it adds should start with ``--<name>-``; its
        section of the configuration is ``config.plugin_config(name)``).
    :param config: the run configuration the hooks get, built through the parser:
        ``furlong.core.config.launch_args.launch_config(...)`` (the plugin installed, or
        ``pm=`` a plugin manager that holds it, so its flags parse). May be left out when no
        hook the kit calls reads it (``add_arguments`` never does).
    :param engine: the engine ``generate`` gets (default a :class:`TinyEngine`).
    :param dataset: what ``data_source`` reads; without it ``data_source`` is not exercised.
    :returns: a :class:`ContractReport`.
    :raises ContractViolation: the first broken rule (plugin, hook and rule named).
    :raises NoConfigGiven: (a TypeError) a hook the kit calls reads the run configuration and ``config`` is None.
    """
    pm = _register(plugin, name)
    hooks = [caller.name for caller in pm.get_hookcallers(plugin)]
    ordered = [h for h in specs.__all__ if h in hooks]
    report = ContractReport(plugin=name)
    run = KitRun(config=config, engine=engine, dataset=dataset)
    for hook in sorted(ordered, key=lambda h: (ORDER.index(h) if h in ORDER else len(ORDER), ordered.index(h))):
        if hook in NOT_EXERCISED or (hook == "data_source" and dataset is None):
            report.not_exercised[hook] = NOT_EXERCISED.get(hook, "needs a dataset (a furlong.hooks.DatasetSpec)")
            continue
        impl = next(i for i in getattr(pm.hook, hook).get_hookimpls() if i.plugin is plugin)
        check = CHECKS[hook]
        try:
            check(Caller(impl, name, hook), run)
        except PluginError as exc:  # a rule of furlong.hooks.contract, the one the core applies
            rule = str(exc).removeprefix(f"plugin '{name}'").removeprefix(":").strip()
            raise ContractViolation(f"plugin '{name}' breaks the `{hook}` contract: {rule}") from None
        except (ContractViolation, NoConfigGiven):
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a data source method that raises
            raise ContractViolation(f"plugin '{name}': what `{hook}` returned raised on the kit's realistic "
                                    f"input: {type(exc).__name__}: {exc}") from exc
        report.checked.append(hook)
    return report


def _register(plugin: object, name: str) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(specs)
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        problem = argument_name_problems(pm, plugin) or str(exc)
        raise ContractViolation(f"plugin '{name}' does not register: {problem}") from None
    problem = unknown_hook_problems(pm, plugin) or no_hookimpl_problem(pm, plugin)
    if problem:
        raise ContractViolation(f"plugin '{name}' does not register: {problem}")
    return pm
