"""The launch flags of a ``furlong train`` run with every default (:func:`launch_args`) and its frozen
configuration (:func:`launch_config`), for plugin tests, furlong's tests and the contract kit."""

from __future__ import annotations

from argparse import Namespace

import attrs

from furlong.hooks.run_config import PluginConfig, RunConfig, freeze_value

__all__ = ["DERIVED", "launch_args", "launch_config"]

REQUIRED = {"--num-rollout": "1", "--rollout-batch-size": "1"}

# attributes a run derives (no flag defines them) that a test may still set through ``overrides``
DERIVED = frozenset({"explicit_args", "megatron_flags_given", "megatron_args", "train_mode"})


def launch_args(*argv: str, pm=None, command: str = "train", **overrides) -> Namespace:
    """Parse ``argv`` as ``furlong train`` (or ``command``: ``"train-async"``) does, after the installed plugins
    added their flags, then apply ``overrides``.

    The two flags a run must give (``--num-rollout``, ``--rollout-batch-size``) default
    to 1 here (``--num-rollout`` not when ``--num-epoch`` is given); everything else takes furlong's and the plugins' defaults. Touches no file.

    This is the one way tests build launch flags: every flag the parser defines is there,
    with the value a real run would have, so code that reads ``args.flag`` sees what it sees
    in a run (a hand-built ``Namespace`` holding only the flags a test thought of hides the
    defaults and lets a test set names no flag defines).

    ``overrides`` are set on the parsed Namespace *after* parsing, keyed by the flag's
    attribute name (``lr=1e-2`` for ``--lr``). They are not validated and derive nothing: a
    unit test can set a value the parser's cross-flag rules would refuse together with the
    defaults (e.g. ``tensor_model_parallel_size=2`` without GPUs), and a value the parser
    derives from other flags (``lr_decay_iters`` from ``--num-rollout``, ``global_batch_size``
    from ``--rollout-batch-size``) is not derived again; set it too, or give the flags in
    ``argv`` when the parser's checks and derivations should see them. ``explicit_args``
    lists the flags in ``argv`` only.

    An override must name a flag the parser defines (furlong's or an installed plugin's,
    including Megatron flags the parse leaves unset), or one of :data:`DERIVED`, the
    attributes the parse itself derives that tests set: ``explicit_args`` (the flags given
    on the command line), ``megatron_flags_given`` and ``megatron_args`` (the Megatron flags
    given, as typed and as ``{dest: value}``), and ``train_mode`` (``"sync"`` here, ``"async"``
    under ``furlong train-async``).

    :param argv: launch flags, e.g. ``("--rm-type", "my_reward", "--my-reward-scale", "2")``.
    :param pm: the plugin manager whose plugins add flags (default: every installed plugin).
    :param overrides: ``{attribute: value}`` set after parsing.
    :returns: the ``argparse.Namespace`` the hooks receive as ``args``.
    :raises PluginError: a flag in ``argv`` is unknown or invalid (one message naming every problem).
    :raises TypeError: an override names no flag the parser defines and is not in :data:`DERIVED`.
    """
    from . import build_parser, parse_args
    from ..plugins.manager import get_plugin_manager

    pm = pm if pm is not None else get_plugin_manager()
    given = {token.split("=", 1)[0] for token in argv}
    if "--num-epoch" in given:  # the run derives --num-rollout from it (furlong.core.run.epochs)
        given.add("--num-rollout")
    filled = [item for flag, value in REQUIRED.items() if flag not in given for item in (flag, value)]
    args = parse_args(filled + list(argv), pm, command=command)
    if overrides:
        known = {action.dest for action in build_parser(pm)._actions} | DERIVED
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"launch_args: no flag sets {', '.join(unknown)}; an override names a flag's attribute "
                            f"(e.g. lr for --lr) or one of {', '.join(sorted(DERIVED))}.")
        for name, value in overrides.items():
            setattr(args, name, value)
    return args


def launch_config(*argv: str, pm=None, configure: bool = True, command: str = "train", **overrides) -> RunConfig:
    """The frozen :class:`~furlong.hooks.RunConfig` of a ``furlong train`` (or ``command``) run with flags ``argv``.

    What a run does before its loop starts, touching no model: :func:`launch_args`, the
    selection, every chosen plugin's ``configure`` (unless ``configure=False``), then
    :func:`~furlong.core.config.freeze.freeze_config`. ``overrides`` are applied to the
    frozen result with :meth:`RunConfig.replace`: a field name (``lr=1e-2``) or a plugin's
    flag attribute (``embedded_max_batch_size=8``, set in that plugin's section). Like
    :func:`launch_args`'s, they derive nothing and are not validated against the other flags.

    :raises PluginError: a flag in ``argv`` is unknown or invalid.
    :raises ConfigError: a chosen plugin's ``configure`` refuses the flags.
    :raises TypeError: an override names no field and no plugin flag.
    """
    from ..plugins.manager import get_plugin_manager
    from ..plugins.selection import resolve_selection
    from .configure import configure_plugins
    from .freeze import freeze_config
    from .parser import build_parser

    pm = pm if pm is not None else get_plugin_manager()
    args = launch_args(*argv, pm=pm, command=command)
    derived = configure_plugins(args, pm, resolve_selection(args, pm)).derived if configure else {}
    plugin_flags = build_parser(pm).plugin_flags
    config = freeze_config(args, plugin_flags, derived)
    owners = {dest: plugin for dest, (_flag, plugin) in plugin_flags.items()}
    fields = {field.name for field in attrs.fields(RunConfig)} - {"plugins"}
    unknown = sorted(set(overrides) - fields - set(owners))
    if unknown:
        raise TypeError(f"launch_config: no field or plugin flag is called {', '.join(unknown)}.")
    sections = {name: dict(section) for name, section in config.plugins.items()}
    for dest in set(overrides) - fields:
        sections.setdefault(owners[dest], {})[dest] = overrides[dest]
    changes = {name: value for name, value in overrides.items() if name in fields}
    if sections != {name: dict(section) for name, section in config.plugins.items()}:
        changes["plugins"] = {name: PluginConfig(name, freeze_value(data)) for name, data in sections.items()}
    return config.replace(**changes) if changes else config
