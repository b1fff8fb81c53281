"""The ``furlong train`` argument parser: core flags in the Miles groups, plus plugin flags."""

from __future__ import annotations

import argparse
import copy
import shlex
from dataclasses import dataclass, field

from furlong.hooks import ConfigReport, DataParallelRule, PluginError

from . import env
from ._util import finite_float
from .data_parallel import rule_in_words, world_of
from .errors import ConfigError
from .flag_access import flag_value, has_flag

__all__ = ["GROUP_TITLES", "MACHINE_FLAGS", "DeviceDefaults", "FurlongArgumentParser", "build_parser",
           "device_defaults", "machine_defaults", "machine_note"]

# Argument groups in --help order; titles as Miles users know the launch-script arrays.
GROUP_TITLES: tuple[str, ...] = (
    "cluster",
    "model and checkpoints",
    "rollout",
    "eval",
    "performance",
    "algorithm",
    "optimizer",
    "SGLang and router",
    "logging",
    "debugging",
    "plugins",
    "Miles",
)

DESCRIPTION = """\
Run the RL loop: generate, score, filter, compute advantages, optimize, sync weights.
Flags follow Miles' names and groups; --sglang-* and --router-* flags are passed to
SGLang and its router; arguments can be read from a file with @FILE (one or more flags
per line, '#' starts a comment). Every flag of Megatron-LM's parser and of Miles is
accepted too (not listed here; see docs/flags.md): Megatron's go to the train backend,
Miles flags furlong does not implement are refused when given."""


class FurlongArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that raises :class:`ConfigError` instead of exiting on errors
    and reads ``@FILE`` argument files with shell quoting and ``#`` comments.

    ``plugin_flags``: ``dest -> (flag, plugin name)`` of every flag a plugin's
    ``add_arguments`` added (:func:`add_plugin_arguments`).

    Every ``type=float`` flag (core, plugin and table flags) is read by :func:`~._util.finite_float`:
    ``nan``, ``inf`` and ``-inf`` are an error naming the flag. A bound where ``inf`` means "no
    bound" takes ``type=float_or_inf`` (:func:`~._util.float_or_inf`) and says so in its help.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register("type", float, finite_float)  # argparse converts with the type registered for float
        self.plugin_flags: dict[str, tuple[str, str]] = {}

    def error(self, message: str):  # noqa: D401 - argparse API
        # argparse's own messages have no final period; every other flag problem ends with one
        raise ConfigError(message if message.endswith(".") else f"{message}.")

    def convert_arg_line_to_args(self, arg_line: str) -> list[str]:
        """Split one line of an argument file like a shell would; ``#`` starts a comment."""
        return shlex.split(arg_line, comments=True)


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help when X says something (not None/False/[])."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})"


@dataclass(frozen=True)
class DeviceDefaults:
    """Defaults that depend on the machine (docs/flags.md, "Defaults that depend on the machine").

    ``gpus_per_node``: the CUDA devices torch sees (1 without CUDA). Without CUDA: sdpa
    attention, fp32, gloo. ``rollout_backend`` is ``sglang`` only when a furlong plugin
    named ``sglang`` is registered and CUDA and the ``sglang`` package are present, else
    ``embedded``; ``train_backend`` is ``megatron`` only when a furlong plugin named
    ``megatron`` is registered and CUDA and megatron-core are present, else ``fsdp`` (furlong
    registers both plugins itself, so on a CUDA machine the package decides;
    ``--disable-plugins`` removes a plugin and with it the default).
    ``probes`` says, per field, what the value came from (``--print-config``).
    """

    cuda: bool
    gpus_per_node: int
    attn_implementation: str
    bf16: bool
    distributed_backend: str
    rollout_backend: str
    train_backend: str
    probes: dict = field(default_factory=dict, compare=False)


# selection flag -> (its default on a CUDA machine with the plugin's package, its default elsewhere): data, like
# the parser's flag defaults
BACKEND_DEFAULTS: dict[str, tuple[str, str]] = {
    "rollout_backend": ("sglang", "embedded"),
    "train_backend": ("megatron", "fsdp"),
}

# flag attribute -> the DeviceDefaults field its default comes from
MACHINE_FLAGS: tuple[tuple[str, str], ...] = (
    ("actor_num_gpus_per_node", "gpus_per_node"),
    ("num_gpus_per_node", "gpus_per_node"),
    ("attn_implementation", "attn_implementation"),
    ("bf16", "bf16"),
    ("distributed_backend", "distributed_backend"),
    ("rollout_backend", "rollout_backend"),
    ("train_backend", "train_backend"),
)


def device_defaults(pm=None) -> DeviceDefaults:
    """Probe this machine through :mod:`furlong.core.config.env` (monkeypatchable).

    :param pm: the run's plugin manager: a backend plugin counts as installed when it is
        registered there (so ``--disable-plugins`` applies), broken or conflicting
        included (choosing it then says why it cannot load). Without ``pm`` the
        ``furlong`` entry points are read (:func:`env.furlong_plugin_installed`).
    """
    cuda = env.cuda_available()
    count = env.cuda_device_count() if cuda else 0
    gpus = max(count, 1)
    sglang, embedded = BACKEND_DEFAULTS["rollout_backend"]
    megatron, fsdp = BACKEND_DEFAULTS["train_backend"]
    sglang_plugin = _backend_plugin(pm, sglang, "rollout_engine")
    sglang_package = env.sglang_available()
    megatron_plugin = _backend_plugin(pm, megatron, "train_backend")
    megatron_package = env.megatron_available()
    on_cuda = f"torch.cuda.is_available() = {cuda}"
    probes = {
        "gpus_per_node": f"torch.cuda.device_count() = {count}" if cuda else "no CUDA device: 1",
        "attn_implementation": on_cuda,
        "bf16": on_cuda,
        "distributed_backend": on_cuda,
        "rollout_backend": f"furlong plugin '{sglang}' installed: {sglang_plugin}, CUDA: {cuda}, "
                           f"sglang package importable: {sglang_package}",
        "train_backend": f"furlong plugin '{megatron}' installed: {megatron_plugin}, CUDA: {cuda}, "
                         f"megatron.core importable: {megatron_package}",
    }
    return DeviceDefaults(
        cuda=cuda,
        gpus_per_node=gpus,
        attn_implementation="flash_attention_2" if cuda else "sdpa",
        bf16=cuda,
        distributed_backend="nccl" if cuda else "gloo",
        rollout_backend=sglang if sglang_plugin and cuda and sglang_package else embedded,
        train_backend=megatron if megatron_plugin and cuda and megatron_package else fsdp,
        probes=probes,
    )


def _backend_plugin(pm, name: str, hook: str) -> bool:
    """Is a furlong plugin ``name`` (serving ``hook``) installed and enabled?"""
    if pm is None:
        return env.furlong_plugin_installed(name)
    if name in pm.broken or name in pm.conflicts:
        return True
    return pm.get_plugin(name) is not None and hook in pm.hooks_of(name)


# DeviceDefaults field -> its value on a CUDA machine with the megatron and sglang plugins installed
ON_CUDA: dict[str, object] = {
    "gpus_per_node": "torch.cuda.device_count()",
    # neutral: the train backend chosen decides what it does with it (its configure may set another, shown
    # under plugin_defaults), and the core names no plugin
    "attn_implementation": "flash_attention_2 (the flag's default; a train backend that reads the flag may set "
                           "another in its configure, shown under plugin_defaults)",
    "bf16": True,
    "distributed_backend": "nccl",
    "rollout_backend": "sglang (with the furlong sglang plugin and the sglang package)",
    "train_backend": "megatron (with the furlong megatron plugin and megatron-core)",
}


def machine_defaults(args: argparse.Namespace, pm=None, data_parallel: DataParallelRule | None = None) -> dict:
    """``{attribute: {"value": v, "probe": text, "on_cuda": w}}`` for the flags whose value came from the machine.

    A flag counts when it was not given (``args.explicit_args``) and still holds the
    machine-dependent default (a later rule, such as ``--fp16`` turning ``bf16`` off,
    takes it out); ``on_cuda`` is the value a GPU machine would give it when it differs.
    ``data_parallel_size`` is listed when the train backend came from a machine without
    CUDA: the probe says the chosen backend's rule (``data_parallel``, what its
    ``configure`` reported), ``on_cuda`` what the CUDA machine's backend would report for
    these flags. ``executor`` is listed when not given: the first executor that fits, and why.
    Shown by ``furlong train --print-config`` as ``machine_defaults``.
    """
    from ..plugins.executor_fit import default_executor
    from ..plugins.manager import get_plugin_manager

    dev = device_defaults(pm)
    pm = pm if pm is not None else get_plugin_manager()
    given = set(args.explicit_args)
    out = {}
    for dest, name in MACHINE_FLAGS:
        value = getattr(dev, name)
        if dest not in given and has_flag(args, dest) and flag_value(args, dest) == value:
            out[dest] = {"value": value, "probe": dev.probes[name]}
            if not dev.cuda and str(ON_CUDA[name]).split(" ")[0] != str(value):
                out[dest]["on_cuda"] = ON_CUDA[name]
    if "train_backend" in out and not dev.cuda and args.data_parallel_size is not None:
        out["data_parallel_size"] = _dp_note(args, pm, data_parallel)
    if "executor" not in given and hasattr(args, "actor_num_nodes"):
        value, fit = default_executor(args, pm)
        out["executor"] = {"value": value, "probe": fit.why}
    return out


def machine_note(defaults: dict) -> str | None:
    """One sentence for ``--print-config`` when values here differ from a GPU machine's (``on_cuda``), else None."""
    differ = [f"{dest} {d['value']} (on CUDA: {d['on_cuda']})" for dest, d in defaults.items() if "on_cuda" in d]
    if not differ:
        return None
    return ("These values depend on this machine, which has no CUDA; a GPU machine would resolve them otherwise: "
            + "; ".join(differ) + ". Give the flags to pin them.")


def _dp_note(args: argparse.Namespace, pm, rule: DataParallelRule | None) -> dict:
    world = world_of(args)
    note = {"value": args.data_parallel_size,
            "probe": f"--train-backend {args.train_backend}: {rule_in_words(rule, world)}"}
    on_cuda = BACKEND_DEFAULTS["train_backend"][0]
    other = _data_parallel_rule_of(args, pm, on_cuda)
    if other is not None and other.model_size > 1 and world % other.model_size == 0:
        names = " x ".join(name for name, _ in other.model_parallel)
        note["on_cuda"] = f"{world // other.model_size} under {on_cuda} (world {world} / {names} {other.model_size})"
    return note


def _data_parallel_rule_of(args: argparse.Namespace, pm, name: str) -> DataParallelRule | None:
    """The rule train backend ``name``'s ``configure`` reports for these flags (run on a copy), or None."""
    if "configure" not in pm.hooks_of(name):
        return None
    scratch = copy.deepcopy(args)
    scratch.train_backend = name
    report = ConfigReport(plugin=name, flags=("--train-backend",))
    try:
        pm.call_setup("configure", name, args=scratch, report=report)
    except Exception:  # noqa: BLE001 - a backend that cannot run here tells nothing about its rule
        return None
    return report.data_parallel


def build_parser(pm=None, dev: DeviceDefaults | None = None) -> argparse.ArgumentParser:
    """The parser of ``furlong train``: every flag, in the Miles groups (docs/flags.md).

    :param pm: a :class:`furlong.core.plugins.manager.FurlongPluginManager`; when given, every
        plugin's ``add_arguments`` is called (one at a time) so it can add its own group.
    :param dev: the machine-dependent defaults (default: probe this machine, which imports torch).
    :returns: a :class:`FurlongArgumentParser` (``allow_abbrev=False``, ``@FILE`` files).
    A plugin whose ``add_arguments`` redefines a flag, fails or is ``async def`` is set
    aside (see :func:`add_plugin_arguments`).
    """
    from . import flags_algo, flags_cluster, flags_compat, flags_eval, flags_logging, flags_model, flags_optim, flags_perf, flags_plugins, flags_rollout, flags_rollout_extra, flags_sglang

    dev = dev or device_defaults(pm)
    parser = FurlongArgumentParser(
        prog="furlong train",
        usage="%(prog)s [-h] [FLAG ...] [@FILE ...]",
        description=DESCRIPTION,
        allow_abbrev=False,
        fromfile_prefix_chars="@",
        formatter_class=DefaultsFormatter,
    )
    groups = {title: parser.add_argument_group(title) for title in GROUP_TITLES}
    flags_cluster.add(groups["cluster"], dev)
    flags_model.add(groups["model and checkpoints"], dev)
    flags_rollout.add(groups["rollout"], dev)
    flags_rollout_extra.add(groups["rollout"], dev)
    flags_eval.add(groups["eval"], dev)
    flags_perf.add(groups["performance"], dev)
    flags_algo.add(groups["algorithm"], dev)
    flags_optim.add(groups["optimizer"], dev)
    flags_sglang.add(groups["SGLang and router"], dev)
    flags_logging.add_logging(groups["logging"], dev)
    flags_logging.add_debugging(groups["debugging"], dev)
    flags_plugins.add(groups["plugins"], dev)
    if pm is not None:
        add_plugin_arguments(parser, pm)
    # last, so a flag furlong or a plugin defines (--tensorboard-dir) is theirs, not the table's
    flags_compat.add_miles(groups["Miles"], dev)
    flags_compat.add_megatron(parser.add_argument_group("Megatron-LM"), dev)  # hidden from --help
    return parser


def set_aside_bad_plugin_flags(pm) -> None:
    """Set aside the plugins whose ``add_arguments`` cannot join the parser, without probing the machine.

    For ``furlong plugins``: the flags' names do not depend on the machine, only their
    defaults, so the CPU defaults stand in and torch is not imported.
    """
    build_parser(pm, DeviceDefaults(cuda=False, gpus_per_node=1, attn_implementation="sdpa", bf16=False,
                                    distributed_backend="gloo", rollout_backend="embedded", train_backend="fsdp"))


def add_plugin_arguments(parser: argparse.ArgumentParser, pm) -> None:
    """Call each plugin's ``add_arguments`` separately, tracking who added which flag.

    A plugin whose ``add_arguments`` adds a flag furlong core or an earlier plugin already
    defines, raises, or is ``async def`` is set aside
    (:meth:`~furlong.core.plugins.manager.FurlongPluginManager.set_aside`): it adds no flag,
    ``furlong plugins`` lists it as broken with the reason, and only a run that chooses it
    fails. Each plugin first adds its flags to a scratch parser holding the flags defined
    so far, so a clash leaves nothing half-added on ``parser``. Who added which flag is
    kept in ``parser.plugin_flags`` (when ``parser`` is a :class:`FurlongArgumentParser`).
    """
    owner: dict[str, str] = {opt: "furlong core" for opt in parser._option_string_actions}
    added = getattr(parser, "plugin_flags", {})
    for name in [impl.plugin_name for impl in pm.hook.add_arguments.get_hookimpls()]:
        problem = _add_arguments_problem(pm, name, owner)
        if problem:
            pm.set_aside(name, problem)
            continue
        before = set(parser._option_string_actions)
        _call_add_arguments(pm, name, parser)
        for opt in sorted(set(parser._option_string_actions) - before, key=len, reverse=True):
            owner[opt] = name
            action = parser._option_string_actions[opt]
            if not (isinstance(action, argparse.BooleanOptionalAction) and opt.startswith("--no-")):
                added.setdefault(action.dest, (opt, name))  # the longest spelling, --X of a --X/--no-X flag


def _add_arguments_problem(pm, name: str, owner: dict[str, str]) -> str:
    """Why plugin ``name``'s ``add_arguments`` cannot join the flags of ``owner`` (flag -> owner), or ""."""
    scratch = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for i, opt in enumerate(owner):
        scratch.add_argument(opt, dest=f"_defined_{i}")
    try:
        _call_add_arguments(pm, name, scratch)
    except argparse.ArgumentError as exc:
        flags = [opt for opt in (exc.argument_name or "").split("/") if opt in owner] or ["?"]
        flag, first = flags[0], owner.get(flags[0], "another plugin")
        if first == "furlong core":
            return (f"`add_arguments` adds the flag {flag}, which furlong core already defines; a plugin adds only "
                    f"new flags, prefixed with its name (--{name.replace('_', '-')}-...).")
        return (f"`add_arguments` adds the flag {flag}, which plugin '{first}' already adds; a flag may be added "
                f"by one plugin only: uninstall one of them or skip one with --disable-plugins NAME.")
    except PluginError as exc:
        return str(exc).removeprefix(f"plugin '{name}'").removeprefix(":").strip()
    return ""


def _call_add_arguments(pm, name: str, parser: argparse.ArgumentParser) -> None:
    """Run plugin ``name``'s ``add_arguments`` on ``parser`` through the plugin manager's set-up call
    (timed and reported to ``on_hook_call``); argparse's ArgumentError passes through.

    :raises PluginError: the implementation is ``async def`` or raises anything else.
    """
    try:
        pm.call_setup("add_arguments", name, parser=parser)
    except (argparse.ArgumentError, PluginError):
        raise
    except Exception as exc:  # noqa: BLE001 - name the plugin at fault
        raise PluginError(f"plugin '{name}' failed in `add_arguments`: {type(exc).__name__}: {exc}") from exc
