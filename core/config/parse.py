"""``parse_args``: argument files, deprecations, pass-through, parsing, validation, overlay."""

from __future__ import annotations

import argparse
import copy
import difflib
import logging
import os
import re
from pathlib import PurePath

from furlong.hooks import PluginError
from furlong.kit.redact import shown

from ..plugins.executor_fit import resolve_executor
from .hf_checkpoint import hf_checkpoint_problems
from ._util import FLOAT_TYPES, MEGATRON_ONLY
from .deprecations import map_deprecated
from .errors import ConfigError
from .overlay import load_overlay
from .parser import build_parser
from .passthrough import split_passthrough, unknown_sglang_problems
from .validate import validate
from .flag_access import flag_value

__all__ = ["config_to_dict", "expand_argsfiles", "names_any", "parse_args", "suggest_flag"]

log = logging.getLogger("furlong.config")


def parse_args(argv: list[str], pm=None, *, command: str | None = None) -> argparse.Namespace:
    """Parse, map deprecated flags, derive and validate the flags of ``furlong train``.

    Order: ``@FILE`` expansion, deprecation mapping, plugin flags
    (``pm``), pass-through split, parse, validation (:func:`validate`), the executor
    (``--executor`` or the first that fits: :func:`~furlong.core.plugins.executor_fit.resolve_executor`),
    then the ``--custom-config-path`` overlay and a second validation of the result. The rules
    of the chosen plugins run later, in their ``configure`` hooks
    (:func:`furlong.core.config.configure.configure_plugins`, after the selection).

    Besides one attribute per flag the Namespace holds ``sglang_passthrough``,
    ``router_passthrough``, ``eval_sglang_passthrough`` (dicts), ``explicit_args``
    (sorted attribute names given on the command line or by the overlay),
    ``plugin_flags_given`` (``{flag: plugin}`` of the given flags a plugin added),
    ``megatron_flags_given`` (Megatron-only flags given, as typed), ``megatron_args``
    (``{dest: value}`` of those) and ``megatron_argv`` (those flags with their values, as
    typed: what a backend hands Megatron-LM's own parser), and derived values
    such as ``sglang_tp_size``, ``engines_in_driver`` and ``data_parallel_size`` (the world
    size here; the train backend's ``configure`` reports its own rule).

    Touches no file except ``@FILE`` argument files and the ``--custom-config-path`` file.

    :param argv: the arguments after ``furlong train``.
    :param pm: plugin manager whose plugins may add flags (``add_arguments``).
    :param command: ``"train"`` or ``"train-async"`` to run the loop-dependent checks
        (train-async rejects ``--colocate``, ...); ``args.train_mode`` is then ``"sync"`` or
        ``"async"`` (plugins' ``configure`` hooks read it), and None without a command.
    :raises ConfigError: every problem found, one per line: unknown flags, stray values,
        bad values, refused flags and validation, all at once.
    """
    parser = build_parser(pm)
    tokens = expand_argsfiles(list(argv), parser)
    tokens, problems = map_deprecated(tokens)
    actions = parser._option_string_actions
    tokens, collected, passed = split_passthrough(tokens, set(actions))
    for line in unknown_sglang_problems(passed):
        log.warning(line)
    tokens = _attach_negative_numbers(tokens, actions)
    parser.fromfile_prefix_chars = None  # files are expanded already
    args, extras, tokens, bad_values, bad_flags = _parse_collecting(parser, tokens)
    unrecognized, meant = _unrecognized(extras, actions)
    problems += bad_values + unrecognized
    explicit, megatron_given, refused, typed = _given(tokens, actions)
    for attr, values in collected.items():
        setattr(args, attr, values)
    args.explicit_args = sorted(explicit)
    args.plugin_flags_given = _plugin_flags_given(parser, explicit, typed)
    args.megatron_flags_given = megatron_given
    args.megatron_args = {actions[f].dest: flag_value(args, actions[f].dest) for f in megatron_given}
    args.megatron_argv = _argv_of(tokens, set(megatron_given))
    args.num_rollout_per_epoch = None  # known once the data is loaded (--num-epoch)
    args.eval_engine = False  # True only in the configuration of an eval fleet engine (core/run/eval_fleet.py)
    args.eval_prompt_data_lone = False  # set by validation when it names a lone --eval-prompt-data PATH 'aime'
    args.custom_config_extras = {}  # the --custom-config-path keys that are no flag (below)
    problems += [f"{flag} is not supported yet; remove it." for flag in refused]
    args.train_mode = None if command is None else "async" if command == "train-async" else "sync"
    raw = copy.deepcopy(args)
    findings = validate(args, command)  # runs on the flags that parsed: all problems are reported at once
    problems += _choose_executor(args, pm)
    if problems or findings.errors:
        # told now rather than only once these are fixed (an overlay may still set it: then not); a path that
        # exists only on the cluster is not a problem for --print-config, so only a missing flag is told there
        if command is not None and not args.custom_config_path and (not args.hf_checkpoint or not args.print_config):
            problems += hf_checkpoint_problems(args.hf_checkpoint)
        _emit(findings, bad_flags, notes=False)  # a stopped run's errors stand alone; its warnings may explain them
        # a rule about a flag whose value was rejected above, or about the flag a misspelling was meant to
        # be (its "did you mean"), would only repeat that problem
        raise ConfigError(problems + [e for e in findings.errors if not names_any(e, bad_flags | meant)],
                          partial=args, bad_flags=frozenset(bad_flags))
    if not args.custom_config_path:
        _emit(findings)
        return args
    overlay = _typed(load_overlay(args.custom_config_path), parser)
    final = copy.deepcopy(raw)
    for key, value in overlay.items():
        if hasattr(raw, key):
            log.info("--custom-config-path sets %s = %r (was %r).", key, shown(key, value),
                     shown(key, flag_value(args, key)))
        setattr(final, key, value)
    final.custom_config_extras = {key: value for key, value in overlay.items() if not hasattr(raw, key)}
    if final.custom_config_extras:
        log.warning("%s", _extras_warning(final.custom_config_extras, actions))
    final.explicit_args = sorted(set(final.explicit_args) | set(overlay))
    final.plugin_flags_given = _plugin_flags_given(parser, final.explicit_args, typed)
    try:
        findings = validate(final, command)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"after --custom-config-path: a value has the wrong type ({exc}).") from None
    for key, value in overlay.items():  # the overlay has the last word, also on derived attributes
        setattr(final, key, value)
    _emit(findings)
    errors = findings.errors + _choose_executor(final, pm)
    if errors:
        raise ConfigError([f"after --custom-config-path: {e}" for e in errors])
    return final


def _extras_warning(extras: dict, actions: dict) -> str:
    """One warning for the ``--custom-config-path`` keys that are no flag, each with its value and, for a
    near-identical flag (:func:`suggest_flag`, as on the command line), that flag's attribute name."""
    parts = []
    for key, value in extras.items():
        close = suggest_flag("--" + key.replace("_", "-"), actions)
        parts.append(f"{key} = {shown(key, value)!r}" + (f" (did you mean {actions[close].dest}?)" if close else ""))
    what = "a key that is not a furlong flag" if len(parts) == 1 else f"{len(parts)} keys that are not furlong flags"
    them = "it" if len(parts) == 1 else "them"
    return f"--custom-config-path sets {what}, kept for the custom functions that read {them}: {', '.join(parts)}."


def _choose_executor(args: argparse.Namespace, pm) -> list[str]:
    """Set ``args.executor`` (its default: the first that fits) and ``args.engines_in_driver``; the problem, if any."""
    from ..plugins.manager import get_plugin_manager

    try:
        resolve_executor(args, pm if pm is not None else get_plugin_manager(), "executor" in args.explicit_args)
    except PluginError as exc:
        args.engines_in_driver = False
        return [str(exc)]
    return []


_NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?|-inf|-nan", re.IGNORECASE)


def _attach_negative_numbers(tokens: list[str], actions: dict) -> list[str]:
    """``--lr -1e-4`` -> ``--lr=-1e-4``: argparse reads ``-1e-4`` as an option, not a value."""
    out: list[str] = []
    for token in tokens:
        prev = out[-1] if out else ""
        action = actions.get(prev)
        if action is not None and action.nargs is None and _NEGATIVE_NUMBER.fullmatch(token):
            out[-1] = f"{prev}={token}"
        else:
            out.append(token)
    return out


def _typed(overlay: dict, parser: argparse.ArgumentParser) -> dict:
    """Convert text values of typed flags (YAML reads ``1e-6`` as text) with the flag's type, the one the
    parser converts with (``finite_float`` for ``type=float``), which also judges a number given to a float
    flag (YAML's ``.nan`` and ``.inf`` are numbers)."""
    types = {a.dest: parser._registry_get("type", a.type, a.type) for a in parser._actions if callable(a.type)}
    out = dict(overlay)
    for key, value in overlay.items():
        number = isinstance(value, float) and types.get(key) in FLOAT_TYPES
        if key in types and (isinstance(value, str) or number):
            try:
                out[key] = types[key](value)
            except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
                raise ConfigError(f"--custom-config-path: {key}: cannot read {value!r} ({exc}).") from None
    return out


def expand_argsfiles(argv: list[str], parser: argparse.ArgumentParser, _within: tuple[str, ...] = ()) -> list[str]:
    """Replace each ``@FILE`` token by the arguments in FILE (recursively).

    Lines are split like a shell would (quotes kept together); ``#`` starts a comment;
    blank lines are ignored.

    :raises ConfigError: a file cannot be read, a line cannot be split (an unbalanced quote, a
        backslash at its end: the message names file and line), or a file names itself through
        ``@FILE`` lines.
    """
    out: list[str] = []
    for token in argv:
        if not token.startswith("@") or len(token) == 1:
            out.append(token)
            continue
        path = token[1:]
        if os.path.realpath(path) in _within:
            raise ConfigError(f"argument file {path}: it is read again from within itself (@{path}); remove that line.")
        try:
            with open(path, encoding="utf-8") as handle:
                lines = handle.read().splitlines()
        except OSError as exc:
            raise ConfigError(f"argument file {path}: cannot read it ({exc.strerror or exc}).") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"argument file {path}: not valid UTF-8 (byte 0x{exc.object[exc.start]:02x}); save it as "
                              "UTF-8.") from None
        inner = [arg for number, line in enumerate(lines, 1) for arg in _split_line(parser, path, number, line)]
        out.extend(expand_argsfiles(inner, parser, (*_within, os.path.realpath(path))))
    return out


_SPLIT_PROBLEMS = {
    "No closing quotation": "a quote is not closed ({}); close it, or escape a quote meant literally with a backslash.",
    "No escaped character": "the line ends with a backslash ({}); each line is read alone: remove the backslash.",
}


def _split_line(parser, path: str, number: int, line: str) -> list[str]:
    """The arguments of line ``number`` of argument file ``path``.

    :raises ConfigError: the line cannot be split like a shell would (``file, line N: ...``).
    """
    try:
        return parser.convert_arg_line_to_args(line)
    except ValueError as exc:
        what = _SPLIT_PROBLEMS.get(str(exc), f"{exc} ({{}}).")
        raise ConfigError(f"{path}, line {number}: " + what.format(line.strip())) from None


def _plugin_flags_given(parser, given, typed: dict[str, str]) -> dict[str, str]:
    """``{flag: plugin name}`` of the flags among ``given`` (attribute names) that a plugin added, each flag
    spelled as typed (``typed``: attribute -> spelling; ``--no-X`` of a ``--X/--no-X`` flag), else as the
    parser lists it (a value an overlay set)."""
    return dict(sorted((typed.get(dest, parser.plugin_flags[dest][0]), parser.plugin_flags[dest][1])
                       for dest in given if dest in parser.plugin_flags))


def config_to_dict(args: argparse.Namespace) -> dict:
    """Every attribute of ``args`` as JSON-serializable values, keys sorted (``--print-config``)."""
    return {key: _jsonable(value) for key, value in sorted(vars(args).items())}


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, PurePath):
        return str(value)
    return repr(value)


_ARGUMENT_ERROR = re.compile(r"argument (--?[\w-]+)(?:/--?[\w-]+)*: ")
# "did you mean": only a near-identical flag (a typo, a letter dropped), never a sibling
# with another last word (--moe-router-dtype is not --moe-router-topk)
SUGGEST_CUTOFF = 0.88


def _parse_collecting(parser, tokens: list[str]) -> tuple[argparse.Namespace, list[str], list[str], list[str],
                                                           set[str]]:
    """``parse_known_args`` that goes on after a bad value: the flag at fault (and its
    values) is taken out and parsing starts again, so every problem is reported at once.

    :returns: ``(args, unknown tokens, tokens parsed, one problem per bad value, the
        option strings of the flags taken out)``.
    """
    problems: list[str] = []
    bad: set[str] = set()
    while True:
        try:
            args, extras = parser.parse_known_args(tokens)
            return args, extras, tokens, problems, bad
        except ConfigError as exc:
            match = _ARGUMENT_ERROR.match(str(exc))
            flag = match.group(1) if match else None
            action = parser._option_string_actions.get(flag) if flag else None
            kept = _without(tokens, set(action.option_strings)) if action else tokens
            bad |= set(action.option_strings) if action else set()
            problems.append(str(exc))
            if kept == tokens:
                raise ConfigError(problems) from None
            tokens = kept


def names_any(message: str, flags) -> bool:
    """Does ``message`` name one of ``flags`` (as a whole flag, not a prefix of a longer one)?"""
    return any(re.search(re.escape(flag) + r"(?![\w-])", message) for flag in flags)


def _without(tokens: list[str], options: set[str]) -> list[str]:
    """``tokens`` less every occurrence of ``options`` and the values that follow each."""
    out: list[str] = []
    skipping = False
    for token in tokens:
        flag = token.split("=", 1)[0]
        if token.startswith("-") and not _is_number(token):
            skipping = flag in options
            if skipping:
                continue
        elif skipping:
            continue
        out.append(token)
    return out


def _argv_of(tokens: list[str], flags: set[str]) -> list[str]:
    """The tokens of ``flags`` (each with the values that follow it), in order."""
    out: list[str] = []
    keeping = False
    for token in tokens:
        if token.startswith("-") and not _is_number(token):
            keeping = token.split("=", 1)[0] in flags
        if keeping:
            out.append(token)
    return out


def suggest_flag(flag: str, actions) -> str | None:
    """The flag among ``actions`` (option strings) near-identical to ``flag`` (a typo, a letter dropped:
    :data:`SUGGEST_CUTOFF`), else None; never a sibling with another last word."""
    close = difflib.get_close_matches(flag, [o for o in actions if o.startswith("--")], n=1, cutoff=SUGGEST_CUTOFF)
    return close[0] if close else None


def _unrecognized(extras: list[str], actions: dict) -> tuple[list[str], set[str]]:
    """One line per unknown flag (with a near-identical flag when there is one), and the flags suggested."""
    problems, suggested = [], set()
    previous_flag = False
    for token in extras:
        if token.startswith("-") and not _is_number(token):
            flag = token.split("=", 1)[0]
            longer = [o for o in actions if o.startswith(flag + "-")]
            abbreviated = len(longer) == 1  # the start of one flag's name
            close = longer[0] if abbreviated else suggest_flag(flag, actions)
            remark = " flags are never abbreviated" if abbreviated else ""  # not for a misspelling
            hint = f" (did you mean {close}?{remark})" if close else ""
            suggested.update([close] if close else [])
            problems.append(f"unrecognized argument {flag}{hint}.")
            previous_flag = True
        elif not previous_flag:
            problems.append(f"unexpected value {token!r}: it follows no flag that takes a value.")
    return problems, suggested


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _given(tokens: list[str], actions: dict) -> tuple[set[str], list[str], list[str], dict[str, str]]:
    """Attributes of the flags present in ``tokens``, the Megatron-only flags among them
    and the Miles flags furlong refuses (both as typed, in order), and ``{attribute: flag as last typed}``."""
    explicit: set[str] = set()
    typed: dict[str, str] = {}
    megatron: list[str] = []
    refused: list[str] = []
    for token in tokens:
        if token == "--":
            break
        action = actions.get(token.split("=", 1)[0]) if token.startswith("-") else None
        if action is None:
            continue
        explicit.add(action.dest)
        flag = token.split("=", 1)[0]
        typed[action.dest] = flag
        if getattr(action, MEGATRON_ONLY, False) and flag not in megatron:
            megatron.append(flag)
        if getattr(action, "miles_refused", False) and flag not in refused:
            refused.append(flag)
    explicit.discard("help")
    return explicit, megatron, refused, typed


def _emit(findings, bad_flags: set[str] = frozenset(), notes: bool = True) -> None:
    """Log the notes (unless ``notes`` is False) and warnings, less those about a flag whose value was
    rejected (it holds its default)."""
    for line in findings.infos if notes else ():
        if not names_any(line, bad_flags):
            log.info("%s", line)
    for line in findings.warnings:
        if not names_any(line, bad_flags):
            log.warning("%s", line)
