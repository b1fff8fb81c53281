"""Command lines of the servers and the router furlong starts, and the processes running them.

``sglang.launch_server`` gets the arguments README.md lists: furlong forces the ones that
place the server and tie it to the run (:data:`FORCED`), sets the ones the launch flags
decide, then passes every ``--sglang-<X>`` the user gave that is not forced. ``furlong
serve`` (``--sglang-server-impl furlong``) takes the model, address and seed only.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import tempfile
import weakref
from typing import Any

from furlong.hooks import PluginError, RunConfig

__all__ = ["FORCED", "ManagedProcess", "ServerPlace", "router_command", "server_command", "server_env",
           "sglang_server_args"]

log = logging.getLogger("furlong.engines.sglang")

# SGLang server arguments furlong always sets itself; a --sglang-<X> for one of them is ignored (with a warning)
FORCED = ("model_path", "trust_remote_code", "random_seed", "enable_memory_saver", "host", "port", "nnodes",
          "node_rank", "dist_init_addr", "gpu_id_step", "base_gpu_id", "nccl_port", "skip_server_warmup",
          "tp_size")


class ServerPlace:
    """Where one engine's server runs: address, ports, GPUs (``base_gpu_id``) and rank."""

    def __init__(self, index: int, host: str, port: int, nccl_port: int, dist_init_addr: str,
                 base_gpu_id: int = 0) -> None:
        self.index, self.host, self.port, self.nccl_port = index, host, port, nccl_port
        self.dist_init_addr, self.base_gpu_id = dist_init_addr, base_gpu_id

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def sglang_server_args(config: RunConfig, place: ServerPlace) -> list[str]:
    """The argument list of ``python -m sglang.launch_server`` for engine ``place.index``.

    Forced: ``--model-path`` (``--hf-checkpoint``), ``--trust-remote-code``, ``--random-seed``
    (``--seed`` + engine index), ``--tp-size`` (``--rollout-num-gpus-per-engine``),
    ``--enable-memory-saver`` (``--offload-rollout``), ``--host``, ``--port``, ``--nccl-port``,
    ``--nnodes``/``--node-rank``/``--dist-init-addr``, ``--base-gpu-id``, ``--gpu-id-step 1``,
    ``--skip-server-warmup``. Set unless given: ``--enable-metrics``, ``--dtype float16`` under
    ``--fp16``, ``--enable-return-routed-experts`` under ``--use-rollout-routing-replay``. Then
    every other ``--sglang-<X>`` as given (a bare flag stays bare).
    """
    per_engine = int(config.rollout_num_gpus_per_engine or 1)
    forced: dict[str, Any] = {
        "model_path": config.hf_checkpoint, "trust_remote_code": True,
        "random_seed": int(config.seed or 0) + place.index, "tp_size": per_engine,
        "enable_memory_saver": bool(config.offload_rollout),
        "host": place.host, "port": place.port, "nccl_port": place.nccl_port,
        # nnodes 1: a server spanning nodes is refused when the run is configured
        "nnodes": 1, "node_rank": 0, "dist_init_addr": place.dist_init_addr,
        "base_gpu_id": place.base_gpu_id, "gpu_id_step": 1, "skip_server_warmup": True,
    }
    given = dict(config.sglang_passthrough or {})
    ignored = sorted(k for k in given if k in FORCED)
    if ignored:
        log.warning("%s: furlong sets these SGLang arguments itself; the values given are ignored.",
                    ", ".join("--sglang-" + k.replace("_", "-") for k in ignored))
    defaults: dict[str, Any] = {"enable_metrics": True}
    if config.fp16:
        defaults["dtype"] = "float16"
    if config.deterministic_mode:  # batch-invariant kernels; each request's sampling_seed honoured
        defaults["enable_deterministic_inference"] = True
    if config.use_rollout_routing_replay:
        defaults["enable_return_routed_experts"] = True
    values = {**forced, **{k: v for k, v in defaults.items() if k not in given},
              **{k: v for k, v in given.items() if k not in FORCED}}
    return _as_argv(values)


def server_command(config: RunConfig, place: ServerPlace) -> list[str]:
    """The command that starts engine ``place.index``'s server (``--sglang-server-impl``)."""
    if config.plugin_config("sglang").sglang_server_impl == "furlong":  # furlong serve runs the embedded engine
        embedded_flags = config.plugin_config("embedded")
        embedded = ["--embedded-max-batch-size", str(embedded_flags.embedded_max_batch_size)] if (
            embedded_flags.embedded_max_batch_size) else []
        if embedded_flags.embedded_torch_compile:
            embedded.append("--embedded-torch-compile")
        if config.use_rollout_routing_replay:
            embedded.append("--enable-return-routed-experts")
        return [sys.executable, "-m", "furlong.core", "serve", "--hf-checkpoint", config.hf_checkpoint,
                "--host", place.host, "--port", str(place.port), "--seed", str(int(config.seed or 0) + place.index),
                *embedded]
    return [sys.executable, "-m", "sglang.launch_server", *sglang_server_args(config, place)]


def server_env(config: RunConfig) -> dict:
    """The server's environment: this process's, plus a clean proxy bypass for loopback and the run's hosts."""
    env = dict(os.environ)
    hosts = {"127.0.0.1", "localhost", str(config.sglang_router_ip or "")}
    hosts |= set(env.get("no_proxy", "").split(","))
    env["no_proxy"] = env["NO_PROXY"] = ",".join(sorted(h for h in hosts if h))
    return env


def router_command(args: Any, module: str, host: str, port: int, prometheus_port: int) -> list[str]:
    """``python -m <module>`` (sglang_router or smg's ``launch_router``) with the run's router arguments.

    ``--policy`` from ``--sglang-router-policy``, ``--request-timeout-secs`` from
    ``--sglang-router-request-timeout-secs``, a free ``--prometheus-port`` (the default,
    29000, collides between two routers on one host) unless ``--router-prometheus-port``,
    then every ``--router-<X>`` as given.
    """
    values: dict[str, Any] = {"host": host, "port": port,
                              "request_timeout_secs": int(args.sglang_router_request_timeout_secs),
                              "prometheus_port": prometheus_port}
    if args.sglang_router_policy:
        values["policy"] = args.sglang_router_policy
    values.update({k: v for k, v in (getattr(args, "router_passthrough", None) or {}).items()
                   if k not in ("host", "port")})
    return [sys.executable, "-m", module, *_as_argv(values)]


def _as_argv(values: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        else:
            argv += [flag, str(value)]
    return argv


class ManagedProcess:
    """A server or router process furlong started: its output goes to a log file; it dies with its parent.

    Started in a session of its own, with the parent-death signal set (Linux), so the
    process goes when the process that started it goes, even when that one is killed;
    :meth:`kill` ends it and every process it started.
    """

    def __init__(self, name: str, command: list[str], env: dict | None = None) -> None:
        self.name, self.command = name, command
        fd, self.log_path = tempfile.mkstemp(prefix=f"furlong-{name.replace(' ', '-')}-", suffix=".log")
        with os.fdopen(fd, "wb") as out:
            self.popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, start_new_session=True, preexec_fn=_die_with_parent)
        _STARTED.add(self)
        log.info("%s: started pid %d (log %s): %s", name, self.popen.pid, self.log_path, " ".join(command))

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> str | None:
        """Why the process is gone (its exit code and the end of its log), or None while it runs."""
        code = self.popen.poll()
        if code is None:
            return None
        return f"{self.name} (pid {self.pid}) exited with code {code}; the end of its log {self.log_path}:\n" \
               f"{self.log_tail()}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:]).rstrip()
        except OSError:
            return ""

    def kill(self, grace_s: float = 5.0) -> None:
        """Terminate the process and its descendants; SIGKILL what is left after ``grace_s``.

        The log file is removed when the process was still running (its end was asked
        for); the log of a process that died on its own is kept for the user.
        """
        import psutil

        if self.popen.poll() is None:
            try:
                os.unlink(self.log_path)
            except OSError:
                pass

        try:
            root = psutil.Process(self.popen.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for proc in tree:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(tree, timeout=grace_s)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=grace_s)
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            raise PluginError(f"{self.name} (pid {self.pid}) did not exit after SIGKILL.") from None


_STARTED: weakref.WeakSet = weakref.WeakSet()  # every ManagedProcess of this process


@atexit.register
def _stop_running() -> None:
    """At exit (also after SIGTERM, which furlong turns into SystemExit) stop what still runs; its log goes too."""
    for process in list(_STARTED):
        if process.popen.poll() is None:
            try:
                process.kill(grace_s=2.0)
            except Exception:  # noqa: BLE001 - exiting: the parent-death signal ends it anyway
                pass


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent thread exits (prctl PR_SET_PDEATHSIG; Linux only)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass
