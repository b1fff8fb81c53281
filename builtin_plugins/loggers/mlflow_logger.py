"""MLflow logger (enabled by ``--use-mlflow``; the MLflow client is optional: ``pip install "furlong[mlflow]"``).

Flags (defined by the core, ``logging`` group): ``--mlflow-tracking-uri`` (default: the
``MLFLOW_TRACKING_URI`` environment variable, else a local file store,
``file://<--save or --log-dir, else the working folder>/mlruns``), ``--mlflow-experiment-name``
(created when missing), ``--mlflow-run-name`` (default ``--wandb-group``), ``--mlflow-run-id``
(log into that existing run). MLflow 3.x keeps its file store in maintenance mode and refuses it
unless ``MLFLOW_ALLOW_FILE_STORE=true``: this plugin sets that (unless set) when the store it
writes is a local folder; a database store (``sqlite:///mlflow.db``) needs the full ``mlflow``
package.

A new run gets the run configuration as parameters (values as strings, cut to MLflow's length
limit; ``--wandb-key`` never). Metrics use MLflow's ``step``: ``rollout/`` and ``perf/`` values
at the rollout id (``rollout_id * S`` with ``--wandb-always-use-train-step``), ``train/`` values
at the optimizer step ``rollout_id * S + s``, ``eval/`` values at the rollout id;
``on_rollout_end`` skips the ``train/`` values it repeats. Keys keep letters, digits and
``_-./`` and spaces; any other character becomes ``_`` (``passrate/pass@4`` is ``passrate/pass_4``).
The run is marked finished after the run's last event (``loggers._common``) and at
interpreter exit otherwise.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import time

from furlong.hooks import PluginError, RunConfig, hookimpl
from furlong.kit.redact import redact

from ._common import is_last_event, rollout_axis_step, run_dir, scalars

__all__ = ["metric_key", "on_eval_end", "on_rollout_end", "on_train_step_end", "tracking_uri"]

log = logging.getLogger("furlong.loggers.mlflow")

_RUNS: dict[int, tuple] = {}  # id(config) -> (config, MlflowClient, run id); holding config keeps its id unique
_LAST_ROLLOUT_SEEN: set[int] = set()
_BATCH = 100  # log_batch takes at most 100 parameters (and 1000 metrics) per call


def metric_key(key: str) -> str:
    """``key`` with every character MLflow refuses in a metric name replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", key)


def tracking_uri(config: RunConfig) -> str:
    """Where the run logs (see the module docstring)."""
    uri = config.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return "file://" + os.path.abspath(os.path.join(run_dir(config) or ".", "mlruns"))


@hookimpl
def on_rollout_end(config, rollout_id, metrics):
    """Log the rollout's ``rollout/``, ``perf/`` (and other non-``train/``) values at the rollout step.

    :raises PluginError: the ``mlflow`` package is missing, or the store refused the run (named).
    """
    step = rollout_axis_step(config, rollout_id, config.wandb_always_use_train_step)
    _log(config, "on_rollout_end", rollout_id, scalars(metrics, ("train/",)), step)


@hookimpl
def on_train_step_end(config, rollout_id, step, metrics):
    """Log one optimizer step's ``train/`` values at step ``step``."""
    _log(config, "on_train_step_end", rollout_id, scalars(metrics), int(step))


@hookimpl
def on_eval_end(config, rollout_id, metrics):
    """Log the evaluation's values at the rollout step."""
    step = rollout_axis_step(config, rollout_id, config.wandb_always_use_train_step)
    _log(config, "on_eval_end", rollout_id, scalars(metrics), step)


def _log(config: RunConfig, hook: str, rollout_id: int, values: dict[str, float], step: int) -> None:
    if not config.use_mlflow:
        return
    key = id(config)
    _, client, run_id = _RUNS[key] if key in _RUNS else _start(config, key)
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(metric_key(k), v, now, int(step)) for k, v in values.items()]
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i:i + 1000])
    if hook == "on_rollout_end" and rollout_id >= config.num_rollout - 1:
        _LAST_ROLLOUT_SEEN.add(key)
    if is_last_event(hook, config, rollout_id, key in _LAST_ROLLOUT_SEEN):
        _finish(key)


def _start(config: RunConfig, key: int) -> tuple:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise PluginError(f"--use-mlflow needs the MLflow client ({type(exc).__name__}: {exc}). Install it with: "
                          'pip install "furlong[mlflow]" (or pip install mlflow), or drop --use-mlflow.') from exc
    uri = tracking_uri(config)
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    try:
        client = MlflowClient(tracking_uri=uri)
        run_id = config.mlflow_run_id or _new_run(client, config)
    except Exception as exc:  # noqa: BLE001 - the store's own error, with the flags that chose it
        raise PluginError(f"--use-mlflow: could not start a run in experiment '{config.mlflow_experiment_name}' at "
                          f"{uri} (--mlflow-tracking-uri): {type(exc).__name__}: {exc}") from exc
    _RUNS[key] = (config, client, run_id)
    return _RUNS[key]


def _new_run(client, config: RunConfig) -> str:
    """Create the run (and its experiment when missing) with the configuration as parameters; return its id."""
    from mlflow.entities import Param

    name = config.mlflow_experiment_name
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
    run = client.create_run(experiment_id, run_name=config.mlflow_run_name or config.wandb_group)
    params = [Param(k, v) for k, v in _params(config).items()]
    for i in range(0, len(params), _BATCH):
        client.log_batch(run.info.run_id, params=params[i:i + _BATCH])
    return run.info.run_id


def _params(config: RunConfig) -> dict[str, str]:
    """The run configuration as MLflow parameters: ``str`` values cut to MLflow's limit, never a credential
    (:func:`furlong.kit.redact.redact`: ``wandb_key`` left out, pass-through API keys ``***``)."""
    try:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
    except ImportError:
        limit = 500
    return {name: str(value)[:limit] for name, value in sorted(redact(vars(config.namespace()), drop=True).items())}


def _finish(key: int) -> None:
    entry = _RUNS.pop(key, None)
    _LAST_ROLLOUT_SEEN.discard(key)
    if entry is not None:
        entry[1].set_terminated(entry[2], "FINISHED")


@atexit.register
def _finish_all() -> None:
    for key in list(_RUNS):
        try:
            _finish(key)
        except Exception as exc:  # noqa: BLE001 - at exit the store may be gone; the metrics are already written
            log.warning("--use-mlflow: could not mark the run finished at exit: %s: %s", type(exc).__name__, exc)
