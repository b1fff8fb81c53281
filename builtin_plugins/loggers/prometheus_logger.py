"""Prometheus exporter (enabled by ``--use-prometheus``; ``prometheus_client`` is optional:
``pip install "furlong[prometheus]"``).

The first logged event starts an HTTP server on ``--prometheus-port`` (default: the
``PROMETHEUS_PORT`` environment variable, else 9090, as in Miles) serving ``/metrics`` from a
registry of its own. Every numeric metric is a gauge holding its latest value, named
``furlong_`` + the metric name with ``@`` spelled ``_at_`` and every other character outside
``[A-Za-z0-9_]`` made ``_`` (``rollout/raw_reward`` is ``furlong_rollout_raw_reward``,
``passrate/pass@4`` is ``furlong_passrate_pass_at_4``), with the metric's own name as help text
and the label ``run_name`` (``--prometheus-run-name``, else ``--wandb-group``, else ``furlong``).
``furlong_rollout_id`` holds the last rollout logged and ``furlong_train_step`` the last
optimizer step. The server runs until the process ends (a scrape after the last rollout still
sees its values); one port serves every run of the process.
"""

from __future__ import annotations

import atexit
import os
import re

from furlong.hooks import PluginError, RunConfig, hookimpl

from ._common import scalars

__all__ = ["DEFAULT_PORT", "gauge_name", "on_eval_end", "on_rollout_end", "on_train_step_end", "port",
           "stop_servers"]

DEFAULT_PORT = 9090
PREFIX = "furlong_"

_EXPORTERS: dict[int, "_Exporter"] = {}  # port -> its server and gauges


def gauge_name(key: str) -> str:
    """The Prometheus metric name of metric ``key`` (see the module docstring)."""
    return PREFIX + re.sub(r"[^A-Za-z0-9_]", "_", key.replace("@", "_at_"))


def port(config: RunConfig) -> int:
    """``--prometheus-port``, else ``$PROMETHEUS_PORT``, else :data:`DEFAULT_PORT`.

    :raises PluginError: ``PROMETHEUS_PORT`` is not a number.
    """
    if config.prometheus_port is not None:
        return int(config.prometheus_port)
    value = os.environ.get("PROMETHEUS_PORT", str(DEFAULT_PORT))
    if not value.isdigit():
        raise PluginError(f"--use-prometheus: PROMETHEUS_PORT={value!r} is not a port number; set --prometheus-port.")
    return int(value)


@hookimpl
def on_rollout_end(config, rollout_id, metrics):
    """Set the gauges of the rollout's numeric metrics and ``furlong_rollout_id``.

    :raises PluginError: ``prometheus_client`` is missing, or the port cannot be bound (named).
    """
    _set(config, {**scalars(metrics), "rollout_id": float(rollout_id)})


@hookimpl
def on_train_step_end(config, rollout_id, step, metrics):
    """Set the gauges of one optimizer step's metrics and ``furlong_train_step``."""
    _set(config, {**scalars(metrics), "train_step": float(step)})


@hookimpl
def on_eval_end(config, rollout_id, metrics):
    """Set the gauges of the evaluation's metrics."""
    _set(config, scalars(metrics))


def _set(config: RunConfig, values: dict[str, float]) -> None:
    if not config.use_prometheus:
        return
    where = port(config)
    exporter = _EXPORTERS.get(where) or _start(where)
    run_name = config.prometheus_run_name or config.wandb_group or "furlong"
    for key, value in values.items():
        exporter.gauge(key).labels(run_name=run_name).set(value)


class _Exporter:
    """One HTTP server and the gauges it serves."""

    def __init__(self, port_: int) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry()
        started = start_http_server(port_, registry=self.registry)
        self.server = started[0] if isinstance(started, tuple) else None
        self.gauges: dict = {}

    def gauge(self, key: str):
        from prometheus_client import Gauge

        name = gauge_name(key)
        if name not in self.gauges:
            self.gauges[name] = Gauge(name, key, ["run_name"], registry=self.registry)
        return self.gauges[name]

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def _start(port_: int) -> _Exporter:
    try:
        import prometheus_client  # noqa: F401 - checked here for the message
    except ImportError as exc:
        raise PluginError(f"--use-prometheus needs prometheus_client ({type(exc).__name__}: {exc}). Install it with: "
                          'pip install "furlong[prometheus]" (or pip install prometheus_client), or drop '
                          "--use-prometheus.") from exc
    try:
        exporter = _Exporter(port_)
    except OSError as exc:
        raise PluginError(f"--use-prometheus: cannot serve metrics on port {port_} (--prometheus-port): {exc}; "
                          "choose a free port.") from exc
    _EXPORTERS[port_] = exporter
    return exporter


@atexit.register
def stop_servers() -> None:
    """Stop every exporter's HTTP server (at interpreter exit; tests call it to free their ports)."""
    while _EXPORTERS:
        _EXPORTERS.popitem()[1].stop()
