"""The ``sglang`` rollout engine: SGLang servers (or ``furlong serve``) behind sglang-router, over HTTP.

``--rollout-backend sglang``. Each engine is a client of one server and of the router:
generation through the router, control calls and weight updates to its own server
(SGLang's native API, docs/sglang.md). Servers are started by furlong (one per engine,
in the engine's process: a Ray actor, or the driver under ``--executor local``) or, with
``--rollout-external``, attached to. The router is started when the run is configured,
on the driver's host, unless ``--sglang-router-ip``/``--sglang-router-port`` name a
running one; either way ``config.sglang_router_ip``/``config.sglang_router_port`` hold its
address for the whole run (custom generate functions post to it).
"""

from __future__ import annotations

import logging
import random
import socket

from furlong.hooks import PluginError, RunConfig, hookimpl

from .engine import SGLangEngine
from .launch import ServerPlace, server_command, sglang_server_args
from .router import NEEDS_ROUTER, router_module, start_router, stop_routers

__all__ = ["SGLangEngine", "add_arguments", "configure", "rollout_engine", "server_command",
           "sglang_server_args", "stop_routers"]

log = logging.getLogger("furlong.engines.sglang")

SERVABLE = False  # furlong serve refuses this engine: it is a client of servers, not one
PLUGIN = "sglang"
ROUTER_PORTS = (3000, 4000)  # furlong's router takes a free port here unless --sglang-router-port


@hookimpl
def add_arguments(parser):
    """Add the ``sglang engine`` group: ``--sglang-server-impl``, ``--sglang-server-restarts``."""
    group = parser.add_argument_group("sglang engine")
    group.add_argument("--sglang-server-impl", choices=["sglang", "furlong"], default="sglang",
                       help="Server each engine starts: 'sglang' (python -m sglang.launch_server) or 'furlong' "
                            "(furlong serve: the embedded engine behind SGLang's HTTP API, for CPUs and tests).")
    group.add_argument("--sglang-server-restarts", type=int, default=3,
                       help="Times one engine restarts its server after it died (--executor local; under Ray "
                            "the engine actor is replaced instead, --ray-engine-restarts).")


@hookimpl
def configure(args, report):
    """Check the server and router flags; start the router unless one is given.

    Derived: ``rollout_num_gpus`` from ``--rollout-external-engine-addrs`` (one engine per
    address), ``sglang_router_ip``/``sglang_router_port`` of the router furlong starts,
    ``sglang_engines_per_process``. The router starts here because its address must be in
    the flags before the executor hands them to the engines and the rollout side.
    """
    _engine_gpus(args, report)
    per_engine = int(args.rollout_num_gpus_per_engine or 1)
    addrs = list(args.rollout_external_engine_addrs or [])
    if args.rollout_external and not addrs:
        report.error("--rollout-external needs --rollout-external-engine-addrs HOST:PORT ... (one per server).")
    if addrs and not args.rollout_external:
        report.error("--rollout-external-engine-addrs is used only with --rollout-external; add it.")
    bad = [a for a in addrs if not _host_port(a)]
    if bad:
        report.error(f"--rollout-external-engine-addrs {' '.join(bad)}: each address must be HOST:PORT.")
    if args.rollout_external and addrs:
        given = args.explicit_args
        if "rollout_num_gpus" in given and args.rollout_num_gpus != len(addrs) * per_engine:
            report.error(f"--rollout-num-gpus {args.rollout_num_gpus} does not match the {len(addrs)} external "
                         f"server(s) of --rollout-external-engine-addrs x --rollout-num-gpus-per-engine {per_engine}.")
        args.rollout_num_gpus = len(addrs) * per_engine
    embedded = [flag for flag, owner in args.plugin_flags_given.items() if owner == "embedded"]  # as typed
    if embedded and (args.rollout_external or args.sglang_server_impl != "furlong"):
        report.error(f"{' and '.join(embedded)} {'set' if len(embedded) > 1 else 'sets'} the embedded engine, which "
                     "SGLang servers do not run (they reach "
                     "`furlong serve` with --sglang-server-impl furlong); SGLang's own are --sglang-enable-torch-compile "
                     "and --sglang-max-running-requests.")
    if args.sglang_server_impl == "furlong" and not args.rollout_external:
        report.use_plugin("embedded")  # furlong serve runs the embedded engine, with its flags
    if args.sglang_server_restarts < 0:
        report.error(f"--sglang-server-restarts must be at least 0, got {args.sglang_server_restarts}.")
    if not args.rollout_external and args.sglang_server_impl == "sglang":
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            needs = ('--sglang-server-impl sglang needs SGLang: pip install "furlong[sglang]" on a GPU machine '
                     "(or --sglang-server-impl furlong to serve the model with furlong's own engine).")
            # --print-config checks a cluster's script on any machine: what the cluster has is not judged here
            if args.print_config:
                report.warn(f"{needs} (not needed for --print-config)")
            else:
                report.error(needs)
    per_node = int(args.num_gpus_per_node)  # its default is this machine's GPU count: not judged under --print-config
    if per_engine > per_node and not args.rollout_external and not args.print_config:
        report.error(f"--rollout-num-gpus-per-engine {per_engine} is more than --num-gpus-per-node {per_node}: an "
                     "SGLang server spanning nodes is not supported yet; use at most "
                     f"{per_node} GPUs per engine (or start the servers yourself: --rollout-external).")
    if per_engine > 1 and not args.engines_in_driver and not args.rollout_external and not report.errors:
        # an engine actor holds a share of one bundle, and Ray shows it that bundle's GPU alone
        report.error(f"--rollout-num-gpus-per-engine {per_engine} under --executor {args.executor}: an engine actor "
                     "sees only "
                     "its first GPU, so a tensor-parallel SGLang server is not supported yet there; use "
                     "--executor local on one machine, or --rollout-external with servers you start.")
    eval_per = int(args.eval_num_gpus_per_engine or 1)
    if args.eval_num_gpus and args.rollout_external:
        report.error("--eval-num-gpus starts SGLang servers of its own for the eval fleet, but --rollout-external "
                     "attaches to servers you started; drop --rollout-external, or evaluate on the rollout servers "
                     "(--eval-num-gpus 0).")
    elif args.eval_num_gpus and eval_per > 1 and not args.engines_in_driver:
        report.error(f"--eval-num-gpus-per-engine {eval_per} under --executor {args.executor}: an engine actor sees "
                     "only its first GPU, so a tensor-parallel eval server is not supported yet there; use "
                     "--executor local on one machine, or --eval-num-gpus-per-engine 1.")
    if args.sglang_server_impl == "furlong" and not args.rollout_external and args.sglang_passthrough:
        shown = " ".join("--sglang-" + k.replace("_", "-") for k in args.sglang_passthrough)
        report.warn(f"{shown}: furlong serve takes no SGLang server arguments; they are not passed on.")
    if (args.sglang_router_ip is None) != (args.sglang_router_port is None) and args.sglang_router_ip is not None:
        report.error("--sglang-router-ip needs --sglang-router-port (the running router's port).")
    engines = max(1, int(args.rollout_num_gpus or per_engine) // per_engine)
    args.sglang_engines_per_process = engines if args.engines_in_driver else 1
    args.sglang_router_given = args.sglang_router_ip is not None
    if args.sglang_router_given or report.errors or args.print_config:
        return
    if router_module() is None:
        report.error(NEEDS_ROUTER)
        return
    host = "127.0.0.1" if args.engines_in_driver else _routable_address()
    port = args.sglang_router_port or _free_port_in(host, *ROUTER_PORTS)
    start_router(args, "127.0.0.1" if host == "127.0.0.1" else "0.0.0.0", port, _free_port())
    args.sglang_router_ip, args.sglang_router_port = host, port
    report.info(f"router started at http://{host}:{port} (stops with this run)")


@hookimpl
async def rollout_engine(config, engine_index):
    """Engine ``engine_index``: start (or attach to) its server, register it with the router.

    Flags read: ``--hf-checkpoint`` (the tokenizer; the model of a started server),
    ``--sglang-server-impl``, ``--rollout-external``, ``--rollout-external-engine-addrs``,
    ``--sglang-router-ip``/``--sglang-router-port``, ``--sglang-router-policy``,
    ``--sglang-server-concurrency``, ``--sglang-router-request-timeout-secs``,
    ``--rollout-num-gpus-per-engine``, ``--seed``, ``--offload-rollout``, ``--fp16``,
    ``--use-rollout-routing-replay`` (every request asks for its routed experts; the model's MoE
    layers are read from ``--hf-checkpoint``'s config), the ``--sglang-*`` pass-through flags.

    :returns: a started :class:`SGLangEngine`.
    :raises PluginError: the server did not start or is not reachable, or the router did
        not take it (the message names the server and the cause); ``--use-rollout-routing-replay``
        with a model that has no mixture-of-experts layer.
    """
    from furlong.kit.hf import load_tokenizer

    index = int(engine_index)
    if not config.hf_checkpoint:
        raise PluginError("--rollout-backend sglang needs --hf-checkpoint (the tokenizer, and the model to serve).")
    if config.sglang_router_ip is None:
        raise PluginError("sglang engine: no router address (--sglang-router-ip/--sglang-router-port); the run's "
                          "configure step starts one.")
    tokenizer = load_tokenizer(config.hf_checkpoint)
    routing = _routing(config)
    router_url = f"http://{config.sglang_router_ip}:{config.sglang_router_port}"
    if config.rollout_external:
        host, port = _host_port(config.rollout_external_engine_addrs[index])
        place = None
    else:
        host = "127.0.0.1" if config.engines_in_driver else _host_address()
        port = _free_port()
        place = ServerPlace(index, host, port, nccl_port=_free_port(), dist_init_addr=f"{host}:{_free_port()}",
                            base_gpu_id=_base_gpu_id(config, index))
    register = not (config.rollout_external and config.plugin_config(PLUGIN).sglang_router_given)
    if config.eval_engine:  # an eval fleet engine is asked directly, off the rollout engines' router
        router_url, register = f"http://{host}:{port}", False
    engine = SGLangEngine(config, index, f"http://{host}:{port}", router_url, place, register, tokenizer, routing)
    try:
        await engine.start()
    except BaseException:
        await engine.shutdown()
        raise
    return engine


def _routing(config: RunConfig):
    """The routing layout of ``--hf-checkpoint`` under ``--use-rollout-routing-replay``, else None."""
    from furlong.kit.moe import checkpoint_routing_layout

    if not config.use_rollout_routing_replay:
        return None
    layout = checkpoint_routing_layout(config.hf_checkpoint)
    if layout is None:
        raise PluginError(f"--use-rollout-routing-replay: the model of --hf-checkpoint {config.hf_checkpoint} has no "
                          "mixture-of-experts layer, so there is no routing to record; run without the flag.")
    return layout


def _engine_gpus(args, report) -> None:
    """``--rollout-num-gpus`` for servers furlong starts on GPUs of their own (not ``--colocate``).

    Required on CUDA with SGLang's server; ``furlong serve`` (or no CUDA) gets one engine
    when it is not given. Always a multiple of ``--rollout-num-gpus-per-engine``.
    """
    per_engine = args.rollout_num_gpus_per_engine
    own_gpus = not args.colocate and not args.debug_train_only and not args.rollout_external
    if own_gpus and args.rollout_num_gpus is None:
        if args.sglang_server_impl == "furlong" or not _cuda_available():
            args.rollout_num_gpus = per_engine
            report.info(f"--rollout-num-gpus not given: one engine ({per_engine} slot; "
                        "engines = --rollout-num-gpus / --rollout-num-gpus-per-engine).")
        else:
            report.error("--rollout-num-gpus is required with --rollout-backend sglang (GPUs for the engines), "
                         "unless --colocate puts the engines on the trainer's GPUs.")
    if args.rollout_num_gpus and per_engine >= 1 and args.rollout_num_gpus % per_engine:
        report.error(f"--rollout-num-gpus ({args.rollout_num_gpus}) must be a multiple of "
                     f"--rollout-num-gpus-per-engine ({per_engine}): every engine gets the same number of GPUs.")


def _cuda_available() -> bool:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def _base_gpu_id(config: RunConfig, index: int) -> int:
    """The first GPU of engine ``index``'s server, as its process numbers them.

    Engines in the driver's process (``config.engines_in_driver``, ``--executor local``): the
    trainer (this process) uses the first ``--actor-num-nodes x --actor-num-gpus-per-node``
    GPUs unless ``--colocate``; engine ``i`` takes the ``--rollout-num-gpus-per-engine`` GPUs
    after those of the engines before it (an eval fleet engine, ``config.eval_engine``, after every rollout
    engine's, ``--rollout-num-gpus``). An engine in a process of its own (a Ray actor)
    is shown its own GPU alone: 0.
    """
    if not config.engines_in_driver:
        return 0
    per_engine = int(config.rollout_num_gpus_per_engine or 1)
    trainer = 0 if config.colocate else int(config.actor_num_nodes) * int(config.actor_num_gpus_per_node)
    if config.eval_engine:  # the eval fleet's GPUs follow the rollout engines'
        trainer += int(config.rollout_num_gpus or 0)
    return trainer + index * per_engine


def _host_port(address: str) -> tuple[str, int] | None:
    host, sep, port = address.removeprefix("http://").rstrip("/").rpartition(":")
    return (host, int(port)) if sep and host and port.isdigit() else None


def _host_address() -> str:
    from furlong.kit.dist import host_address

    return host_address()


def _routable_address() -> str:
    """This host's address as engines on other hosts reach it: ``FURLONG_HOST_IP``, the host name's
    address unless it is loopback, else the address of the interface of the default route."""
    address = _host_address()
    if not address.startswith("127."):
        return address
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            return s.getsockname()[0]
    except OSError:
        return address


def _free_port() -> int:
    from furlong.kit.dist import free_port

    return free_port()


def _free_port_in(host: str, low: int, high: int) -> int:
    """A port in ``[low, high)`` free on ``host`` now, tried in random order."""
    ports = list(range(low, high))
    random.shuffle(ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
                return port
            except OSError:
                continue
    raise PluginError(f"no free port in [{low}, {high}) on {host} for the router; give --sglang-router-port.")

