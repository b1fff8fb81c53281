"""The ``furlong`` command: ``plugins``, ``train``, ``train-async``, ``serve``, ``plot``, ``new-plugin``,
``quantize-fp8``, ``--version``."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import importlib.metadata as md
import json
import logging
import os
import sys
import time
import traceback

from furlong.hooks import PluginError, specs
from furlong.kit.dist import launched_processes
from furlong.kit.redact import redact

from ..config.errors import ConfigError
from ..plugins.discovery import check_disabled, split_names
from ..plugins.manager import FurlongPluginManager, get_plugin_manager

__all__ = ["error_lines", "main"]

log = logging.getLogger("furlong")

SECONDARY_RANK_WAIT_S = 30.0
"""Seconds a torchrun rank other than 0 waits, on a flag problem, before it prints it and exits (rank
0 prints it, and torchrun stops the other ranks when rank 0 exits)."""

USAGE = """usage: furlong [--version] COMMAND [ARGS]

commands:
  train        run the synchronous RL loop (rollout, train, weight sync)
  train-async  run the loop with rollout k+1 overlapping training of rollout k
  serve        serve a rollout engine over HTTP with SGLang's native API
  plugins      list installed plugins: name, hooks, distribution, version
  plot         draw runs' metrics.jsonl into one PNG (several runs overlaid)
  new-plugin   write a plugin package: furlong new-plugin NAME --hook HOOK [--hook ...]
  quantize-fp8 write the fine-grained FP8 version of a BF16 model: furlong quantize-fp8 SRC_DIR DST_DIR

'furlong COMMAND --help' describes a command's flags."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``furlong`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config_log = logging.getLogger("furlong.config")
    level = config_log.level
    if _secondary_rank():  # rank 0 reports the same launch flags and their problems
        config_log.setLevel(logging.ERROR)
    try:
        return _command(argv)
    finally:  # a caller that goes on (a test, an embedding program) keeps its logging as it was
        config_log.setLevel(level)


def _command(argv: list[str]) -> int:
    """Run ``furlong ARGV``: the command's handler, its errors as ``error:`` lines; the exit code."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"furlong {md.version('furlong')}")
        return 0
    command, rest = argv[0], argv[1:]
    handlers = {"plugins": _plugins, "train": _train, "train-async": _train, "plot": _plot,
                "new-plugin": _new_plugin, "serve": _serve, "quantize-fp8": _quantize_fp8}
    if command not in handlers:
        close = difflib.get_close_matches(command, handlers, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"error: unknown command '{command}'{hint}.\n{USAGE}", file=sys.stderr)
        return 2
    debug = "--debug" in rest
    try:
        return handlers[command](command, rest)
    except PluginError as exc:
        if debug:
            traceback.print_exc()
        if isinstance(exc, ConfigError) and _secondary_rank():
            # Rank 0 reports the same flags' problems. Exiting first would let torchrun stop rank 0
            # before it prints them, so wait: torchrun stops this rank once rank 0 has exited, and a
            # rank 0 slower than the wait still leaves this rank's own report.
            time.sleep(SECONDARY_RANK_WAIT_S)
        for line in error_lines(exc):
            print(line, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`furlong plugins | head`): stop quietly.
        sys.stdout = open(os.devnull, "w")
        return 0


def error_lines(exc: PluginError) -> list[str]:
    """The lines the CLI prints for ``exc``: every line starts with ``error:``, also the continuation
    lines of a multi-line problem (they keep their indentation after the prefix), so a reader (or
    ``grep error:``) never sees a line of the report without it."""
    problems = exc.problems if isinstance(exc, ConfigError) else [str(exc)]
    return [f"error: {line}" for problem in problems for line in (str(problem).splitlines() or [""])]


STOP_SIGNALS = {"SIGINT": "Ctrl-C", "SIGTERM": "SIGTERM"}
"""The signals that stop a run or a server, with the words the note on a blocked mask uses for them."""


def _exit_on_signals(what: str = "the run") -> None:
    """SIGTERM raises SystemExit(143) and SIGINT (Ctrl-C) KeyboardInterrupt, also when they land inside a
    finalizer, so the run's clean-up and atexit handlers run (servers, temporary files).

    Whatever signal state the parent left (docs/checkpoints.md, "Stopping a run"): a signal inherited as
    ignored (SIG_IGN: a non-interactive shell's background job has SIGINT so) gets the handler too, and
    one the parent blocked is unblocked, with one line on stderr naming it (``what`` is what it stops).
    A handler already installed in this process (an embedding program's, a test's) is kept.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    ours = (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler)
    stop = {getattr(signal, name): words for name, words in STOP_SIGNALS.items()}
    for signum in stop:
        if signal.getsignal(signum) in ours:
            signal.signal(signum, _raise_where_it_propagates)
    blocked = sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []) & stop.keys())
    if blocked and not _secondary_rank():  # rank 0 says it for every rank
        names = " and ".join(signal.Signals(s).name for s in blocked)
        words = " and ".join(stop[s] for s in blocked)
        one = len(blocked) == 1
        print(f"note: {names} {'was' if one else 'were'} blocked by the parent process; furlong unblocks "
              f"{'it' if one else 'them'} so {words} {'stops' if one else 'stop'} {what}", file=sys.stderr)
    # after the handlers: a signal that arrived while blocked is delivered now, to them
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)


def _raise_where_it_propagates(signum: int, frame) -> None:
    """Raise KeyboardInterrupt for SIGINT, else SystemExit(128 + signum), unless the interrupted code runs
    inside a ``__del__``: Python ignores an exception raised there (a garbage collection can run one between
    any two bytecodes; Ray's object references run one each), so the signal would be lost. The signal is then
    sent again 50 ms later, when the finalizer is done."""
    import signal
    import threading

    while frame is not None:
        if frame.f_code.co_name == "__del__":
            again = threading.Timer(0.05, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()
            return
        frame = frame.f_back
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    sys.exit(128 + signum)


async def until_stopped(main):
    """Await ``main`` on a loop that reports a stop once.

    SIGTERM and Ctrl-C raise SystemExit and KeyboardInterrupt inside whichever task runs when they land
    (:func:`_raise_where_it_propagates`). asyncio re-raises the exception out of the loop, so the run stops
    through its clean-up, and also keeps it in that task: when the task is collected, asyncio would print
    "Task exception was never retrieved" and a traceback for a stop that went as asked. Reports of
    SystemExit and KeyboardInterrupt (a signal's, or a ``sys.exit`` in a task, which stops the run the same
    way) are dropped; every other report reaches asyncio's handler.
    """
    asyncio.get_running_loop().set_exception_handler(_drop_stop_signals)
    return await main


def _drop_stop_signals(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    if isinstance(context.get("exception"), (SystemExit, KeyboardInterrupt)):
        return
    loop.default_exception_handler(context)


def _secondary_rank() -> bool:
    """A trainer rank other than 0 under ``torchrun`` (which sets ``RANK`` and ``WORLD_SIZE``)."""
    return launched_processes() > 1 and int(os.environ.get("RANK", "0") or 0) > 0


def _plugins(command: str, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="furlong plugins", allow_abbrev=False,
                                     description="List installed furlong plugins.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--hook", help="only plugins implementing this hook")
    parser.add_argument("--disable-plugins", action="append", default=[], help="NAME or DIST:NAME to skip")
    opts = parser.parse_args(argv)
    disable = split_names(opts.disable_plugins)
    check_disabled(disable)
    pm = get_plugin_manager(disable)
    from ..config.parser import set_aside_bad_plugin_flags

    set_aside_bad_plugin_flags(pm)
    rows = pm.describe()
    if opts.hook:
        if not hasattr(pm.hook, opts.hook):
            raise PluginError(f"--hook '{opts.hook}': no such hook. Hooks: {', '.join(_hook_names(pm))}.")
        rows = [r for r in rows if opts.hook in r["hooks"] or r["status"] != "ok"]
    if opts.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(_table(rows))
    return 0


def _hook_names(pm: FurlongPluginManager) -> list[str]:
    """The hooks of the plugin contract (not the adapters' own hooks of core/plugins/path_specs.py)."""
    return sorted(name for name in vars(pm.hook) if name in specs.__all__)


def _table(rows: list[dict]) -> str:
    header = ("NAME", "HOOKS", "DISTRIBUTION", "VERSION", "STATUS")
    lines = [(r["name"], ",".join(r["hooks"]) or "-", r["distribution"], r["version"],
              r["status"] if r["status"] == "ok" else f"{r['status']}: {r['detail']}") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    return "\n".join(fmt.format(*line) for line in [header, *lines])


def warn_broken(pm: FurlongPluginManager) -> None:
    """One warning per broken or conflicting plugin, at the start of every run."""
    for name, (record, error) in sorted(pm.broken.items()):
        where = record.label if record else "?"
        log.warning("plugin '%s' (%s) is broken and cannot be chosen: %s", name, where, error)
    for name, records in sorted(pm.conflicts.items()):
        log.warning("plugin name '%s' is registered by %s; choose one with --disable-plugins DIST:%s",
                    name, " and ".join(r.label for r in records), name)


def _disable_list(argv: list[str]) -> list[str]:
    """``--disable-plugins`` values, read before the parser exists (it needs the plugins)."""
    found = []
    for i, token in enumerate(argv):
        if token == "--disable-plugins" and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif token.startswith("--disable-plugins="):
            found.append(token.split("=", 1)[1])
    return split_names(found)


def _train(command: str, argv: list[str]) -> int:
    from ..config import config_to_dict, parse_args
    from ..config.notes import held_notes
    from ..config.parser import machine_defaults, machine_note
    from ..config.configure import configure_plugins, with_plugin_problems
    from ..config.fp8_sources import precision_summary
    from ..config.freeze import freeze_config
    from ..config.parser import build_parser
    from ..plugins.selection import resolve_selection

    _exit_on_signals()  # before the plugins load and the flags parse (seconds: torch is imported): no signal lost
    pm = get_plugin_manager(_disable_list(argv))
    with held_notes():  # a run that selection or a plugin's configure rejects prints its errors alone
        try:
            args = parse_args(argv, pm, command=command)
        except ConfigError as exc:
            raise with_plugin_problems(exc, pm) from None
        args.train_mode = "async" if command == "train-async" else "sync"
        selection = resolve_selection(args, pm)
        configured = configure_plugins(args, pm, selection)
    config = freeze_config(args, build_parser(pm).plugin_flags, configured.derived)
    if config.print_config:
        machine = {**machine_defaults(args, pm, configured.data_parallel), **configured.machine}
        plugin_set = {dest: value for dest, value in configured.derived.items() if dest not in configured.machine}
        print(json.dumps({"args": redact(config_to_dict(args)), "plugins": selection.as_dict(),
                          "precision": precision_summary(args),
                          "machine_defaults": config_to_dict(argparse.Namespace(**machine)),
                          "machine_note": machine_note(machine),
                          "plugin_defaults": config_to_dict(argparse.Namespace(**plugin_set))},
                         indent=2, sort_keys=True))
        return 0
    warn_broken(pm)
    from ..run.loop import run

    asyncio.run(until_stopped(run(config, pm, selection)))
    return 0


def _plot(command: str, argv: list[str]) -> int:
    from .plot import main as plot_main

    return plot_main(argv)


def _new_plugin(command: str, argv: list[str]) -> int:
    from .scaffold import main as scaffold_main

    return scaffold_main(argv)


def _quantize_fp8(command: str, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="furlong quantize-fp8", allow_abbrev=False,
        description="Write the fine-grained FP8 version (e4m3 weights, 128 x 128 weight_scale_inv blocks, dynamic "
                    "activation scales: transformers' FineGrainedFP8Config, SGLang's fp8) of a BF16 Hugging Face "
                    "model directory, for --hf-checkpoint of an FP8 rollout engine (docs/fp8.md).")
    parser.add_argument("src", help="the BF16 (or float16, float32) Hugging Face model directory")
    parser.add_argument("dst", help="the new FP8 model directory (must not exist, or be empty)")
    opts = parser.parse_args(argv)
    from furlong.kit.fp8_io import quantize_checkpoint

    done = quantize_checkpoint(opts.src, opts.dst)
    print(f"{opts.dst}: {len(done['quantized'])} linear layers in FP8, kept in their dtype: "
          f"{', '.join(done['not_converted']) or 'none'}")
    return 0


def _serve(command: str, argv: list[str]) -> int:
    from ..serve import serve

    _exit_on_signals("the server")  # until it listens; then its own handlers end it cleanly (exit code 0)
    return serve(argv)
