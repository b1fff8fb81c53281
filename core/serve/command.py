"""``furlong serve``: its flags, the engine it builds through the plugin manager, and the server's life.

The engine comes from the ``rollout_engine`` hook of the plugin ``--rollout-backend``
names (default ``embedded``), exactly as a training run builds it; only that plugin's
``add_arguments`` flags are added, so every flag ``furlong serve --help`` lists does
something here.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket

from furlong.hooks import PluginError, RunConfig

from ..plugins.discovery import check_disabled, split_names
from ..config._util import port_number
from ..config.parser import FurlongArgumentParser
from ..config.hf_checkpoint import hf_checkpoint_problems
from ..plugins.manager import get_plugin_manager

__all__ = ["build_serve_parser", "check_port_free", "engine_config", "parse_serve_args", "serve"]

log = logging.getLogger("furlong.serve")

DESCRIPTION = """Serve a rollout engine over HTTP with SGLang's native API (the subset RL
trainers use and routers probe): POST /generate, /abort_request, /pause_generation,
/continue_generation, /flush_cache, weight updates (distributed, from disk, version),
memory release/resume, /health, /health_generate, /server_info, /model_info, /v1/models.
A CPU or small-GPU stand-in for SGLang while developing agents, evals and furlong's
sglang client; see README "furlong serve" for what differs from SGLang."""


def build_serve_parser(pm=None, backend: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``furlong serve``: its own flags plus the ``--rollout-backend`` plugin's.

    :param pm: plugin manager; with ``backend``, that plugin's ``add_arguments`` runs.
    :raises PluginError: the plugin's ``add_arguments`` fails or adds a flag serve defines.
    """
    # as furlong train's: a usage error is one "error:" line (exit 2), a float flag refuses nan and inf
    parser = FurlongArgumentParser(prog="furlong serve", description=DESCRIPTION, allow_abbrev=False,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = parser.add_argument_group("serve")
    g.add_argument("--hf-checkpoint", required=True, help="Hugging Face model directory to serve (weights, "
                   "config, tokenizer).")
    g.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface).")
    g.add_argument("--port", type=port_number, default=30000, help="TCP port to listen on, 1 to 65535 "
                   "(SGLang's default).")
    g.add_argument("--rollout-backend", default="embedded", help="Plugin whose `rollout_engine` hook builds the "
                   "engine (furlong plugins --hook rollout_engine lists them).")
    g.add_argument("--served-model-name", default=None, help="Model name in /v1/models and /model_info "
                   "(default: the --hf-checkpoint path, as SGLang).")
    g.add_argument("--weight-version", default="default", help="Weight version reported until a weight update "
                   "sets one (SGLang's default: 'default').")
    g.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="Weights' dtype on CUDA (auto = bfloat16); CPU always runs float32.")
    g.add_argument("--seed", type=int, default=1234, help="Seeds the engine's per-request sampling seeds "
                   "(a request's sampling_seed overrides it).")
    g.add_argument("--enable-return-routed-experts", action="store_true", help="Record the experts every token "
                   "is routed to (a mixture-of-experts model), so /generate answers them in "
                   "meta_info.routed_experts when a request sets return_routed_experts (SGLang's flag).")
    g.add_argument("--incremental-streaming-output", action="store_true", help="Streamed chunks carry only the "
                   "new text, ids and logprobs (SGLang's flag); default: each chunk carries everything so far.")
    g.add_argument("--disable-plugins", action="append", default=[], help="NAME or DIST:NAME to skip.")
    g.add_argument("--debug", action="store_true", help="Print tracebacks of errors.")
    if pm is not None and backend:
        _add_backend_arguments(parser, pm, backend)
    return parser


def _add_backend_arguments(parser: argparse.ArgumentParser, pm, backend: str) -> None:
    if backend not in pm.names_for("add_arguments"):
        return
    try:
        pm.call_setup("add_arguments", backend, parser=parser)
    except argparse.ArgumentError as exc:
        raise PluginError(f"--rollout-backend '{backend}': its add_arguments adds a flag furlong serve already "
                          f"defines ({exc.argument_name}).") from exc


def _backend_of(argv: list[str]) -> str:
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--rollout-backend", default="embedded")
    return probe.parse_known_args(argv)[0].rollout_backend


def serve(argv: list[str]) -> int:
    """Run ``furlong serve`` until SIGTERM or SIGINT; returns the exit code.

    :raises PluginError: a ``--disable-plugins`` or ``FURLONG_DISABLE_PLUGINS`` item matches no installed
        plugin, the backend cannot be chosen, ``--hf-checkpoint`` is not a model
        directory, ``--host``/``--port`` cannot be listened on, or the engine cannot be built
        (the message names the flag).
    """
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--disable-plugins", action="append", default=[])
    disable = split_names(pre.parse_known_args(argv)[0].disable_plugins)
    check_disabled(disable)  # before anything else: a typo there leaves the plugin meant loaded
    pm = get_plugin_manager(disable)
    args = parse_serve_args(argv, pm)
    problems = hf_checkpoint_problems(args.hf_checkpoint)
    if problems:
        raise PluginError("\n".join(problems))
    check_port_free(args.host, args.port)
    return asyncio.run(_serve(args, pm))


def check_port_free(host: str, port: int) -> None:
    """Fail before the model loads when ``host:port`` cannot be listened on.

    :raises PluginError: the port is taken or the address is not this host's (names ``--port``/``--host``).
    """
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp listens
            s.bind((host, port))
    except OSError as exc:
        raise PluginError(f"furlong serve: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                          "choose another --port or --host.") from exc


def parse_serve_args(argv: list[str], pm) -> argparse.Namespace:
    """Parse ``furlong serve``'s flags; derive what engine plugins read.

    ``--dtype`` becomes ``bf16``/``fp16`` (the flags a ``rollout_engine`` reads in a
    training run); ``--served-model-name`` defaults to ``--hf-checkpoint``.

    :raises PluginError: ``--rollout-backend`` names no plugin implementing ``rollout_engine``
        or one whose module sets ``SERVABLE = False`` (an HTTP client of other servers);
        ``--hf-checkpoint`` is not a model directory.
    :raises ConfigError: a usage error (an unknown flag, a bad value such as a ``--port`` outside 1..65535).
    """
    backend = _backend_of(argv)
    impl = pm.chosen_impl("rollout_engine", backend, "--rollout-backend")
    if not getattr(impl.plugin, "SERVABLE", True):
        servable = [n for n in pm.names_for("rollout_engine") if getattr(pm.get_plugin(n), "SERVABLE", True)]
        raise PluginError(f"furlong serve --rollout-backend {backend}: that engine is an HTTP client of other servers "
                          "(it sends every request to servers it starts or attaches to), so there is nothing for "
                          "furlong serve to run; serve the model with those servers directly. Engines furlong serve "
                          f"can run: {', '.join(servable) or 'none installed'}.")
    args = build_serve_parser(pm, backend).parse_args(argv)
    args.bf16 = args.dtype in ("auto", "bfloat16")
    args.fp16 = args.dtype == "float16"
    args.served_model_name = args.served_model_name or args.hf_checkpoint
    return args


async def _serve(args: argparse.Namespace, pm) -> int:
    from aiohttp import web

    from ..rollout.engines import checked_engine
    from .app import make_app
    from .state import ServeState

    name, flag = args.rollout_backend, "--rollout-backend"
    engine = await pm.call_chosen("rollout_engine", name, flag, config=engine_config(args, pm), engine_index=0)
    engine = checked_engine(engine, name, flag)
    state = ServeState(engine, args)
    # handler_cancellation: a client that goes away cancels its request, and the engine drops it (as SGLang)
    runner = web.AppRunner(make_app(state), access_log=None, shutdown_timeout=5, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
    except OSError as exc:
        await runner.cleanup()
        raise PluginError(f"furlong serve: cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); "
                          "choose another --port or --host.") from exc
    logging.getLogger("aiohttp.server").addFilter(_quiet_http2_probes)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("furlong serve: %s (%s) on http://%s:%d", args.hf_checkpoint, args.rollout_backend, args.host, args.port)
    await stop.wait()
    log.info("furlong serve: shutting down")
    await state.shut_down()
    await runner.cleanup()
    return 0


def engine_config(args: argparse.Namespace, pm) -> RunConfig:
    """The run configuration the engine plugin gets: a ``furlong train`` run's defaults with the
    server's engine flags (``--hf-checkpoint``, ``--rollout-backend``, ``--seed``, ``--dtype`` as
    ``bf16``/``fp16``, ``--enable-return-routed-experts`` as ``use_rollout_routing_replay``, and the
    backend plugin's own flags) in place.

    :raises TypeError: a value does not fit its field (a defect of the serve parser).
    """
    from ..config.freeze import freeze_config
    from ..config.launch_args import launch_args
    from ..config.parser import build_parser

    plugin_flags = build_parser(pm).plugin_flags
    own = {dest: value for dest, value in vars(args).items() if dest in plugin_flags}
    train = launch_args(pm=pm, hf_checkpoint=args.hf_checkpoint, rollout_backend=args.rollout_backend,
                        seed=args.seed, bf16=args.bf16, fp16=args.fp16,
                        use_rollout_routing_replay=args.enable_return_routed_experts, **own)
    return freeze_config(train, plugin_flags)


def _quiet_http2_probes(record: logging.LogRecord) -> bool:
    """Drop aiohttp's traceback for an HTTP/2 connection preface ("PRI * HTTP/2.0").

    sglang-router and smg open one when they register a worker, to find out whether it
    speaks gRPC; they then use HTTP/1.1. Any other bad request is still logged.
    """
    exc = record.exc_info[1] if record.exc_info else None
    return not (exc is not None and type(exc).__name__ == "BadHttpMessage" and "PRI" in str(exc))
