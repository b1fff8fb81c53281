"""TensorBoard logger: every metric as a scalar against its step key (enabled by ``--use-tensorboard``).

Writes with ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package:
``pip install "furlong[tensorboard]"``). Steps follow ``metrics.jsonl``'s step keys: rollout
and ``perf/`` metrics at ``rollout/step`` = rollout id, optimizer-step metrics at
``train/step`` = ``rollout_id * S + s``, eval metrics at ``eval/step`` = rollout id. The
``train/`` values that ``on_rollout_end`` repeats (the rollout's last step) are skipped there,
so each ``train/`` tag has one point per optimizer step.

Folder: ``--tensorboard-dir``, else ``--tb-project-name`` (Miles' TensorBoard folder flag), else
the ``TENSORBOARD_DIR`` environment variable, else ``<--save or --log-dir>/tensorboard``;
``--tb-experiment-name`` adds a sub-folder (one run in a shared folder). The writer flushes on
every call and closes after the run's last event (see ``loggers._common``); an event after
that opens a new event file in the same folder.
"""

from __future__ import annotations

import atexit
import os

from furlong.hooks import PluginError, RunConfig, hookimpl

from ._common import is_last_event, run_dir, scalars

__all__ = ["add_arguments", "log_dir", "on_eval_end", "on_rollout_end", "on_train_step_end"]

_WRITERS: dict[str, object] = {}  # log folder -> open SummaryWriter
_LAST_ROLLOUT_SEEN: set[str] = set()  # log folders whose final rollout was logged


@hookimpl
def add_arguments(parser):
    """Add ``--tensorboard-dir`` (group ``tensorboard``)."""
    group = parser.add_argument_group("tensorboard")
    group.add_argument("--tensorboard-dir", default=None, metavar="DIR",
                       help="TensorBoard event folder (with --use-tensorboard; default: --tb-project-name, "
                            "else $TENSORBOARD_DIR, else <--save or --log-dir>/tensorboard).")


def log_dir(config: RunConfig) -> str:
    """The event folder of this run (see the module docstring).

    :raises PluginError: no ``--tensorboard-dir``, ``--tb-project-name``, ``TENSORBOARD_DIR``,
        ``--save`` or ``--log-dir``.
    """
    base = (config.plugin_config("tensorboard").tensorboard_dir or config.tb_project_name
            or os.environ.get("TENSORBOARD_DIR"))
    if not base:
        out = run_dir(config)
        if not out:
            raise PluginError("--use-tensorboard: no folder to write events to. Pass --tensorboard-dir DIR "
                              "(or set TENSORBOARD_DIR), or --save / --log-dir DIR (events then go to "
                              "DIR/tensorboard).")
        base = os.path.join(out, "tensorboard")
    experiment = config.tb_experiment_name
    return os.path.join(base, experiment) if experiment else base


@hookimpl
def on_rollout_end(config, rollout_id, metrics):
    """Write the rollout's ``rollout/`` and ``perf/`` scalars at step ``rollout_id``.

    :param metrics: ``dict[str, float]``; non-finite and non-numeric values are skipped.
    :raises PluginError: the ``tensorboard`` package is missing, or no folder (see :func:`log_dir`).
    """
    _write(config, "on_rollout_end", rollout_id, scalars(metrics, ("train/",)), rollout_id)


@hookimpl
def on_train_step_end(config, rollout_id, step, metrics):
    """Write one optimizer step's ``train/`` scalars at step ``step`` (``rollout_id * S + s``)."""
    _write(config, "on_train_step_end", rollout_id, scalars(metrics), step)


@hookimpl
def on_eval_end(config, rollout_id, metrics):
    """Write the evaluation's ``eval/`` (and ``perf/eval_time``) scalars at step ``rollout_id``."""
    _write(config, "on_eval_end", rollout_id, scalars(metrics), rollout_id)


def _write(config: RunConfig, hook: str, rollout_id: int, values: dict[str, float], step: int) -> None:
    if not config.use_tensorboard:
        return
    path = log_dir(config)
    writer = _WRITERS.get(path) or _open(path)
    for tag, value in values.items():
        writer.add_scalar(tag, value, global_step=int(step))
    writer.flush()
    if hook == "on_rollout_end" and rollout_id >= config.num_rollout - 1:
        _LAST_ROLLOUT_SEEN.add(path)
    if is_last_event(hook, config, rollout_id, path in _LAST_ROLLOUT_SEEN):
        _close(path)


def _open(path: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise PluginError(f"--use-tensorboard needs the tensorboard package ({type(exc).__name__}: {exc}). "
                          'Install it with: pip install tensorboard (or pip install "furlong[tensorboard]").') from exc
    os.makedirs(path, exist_ok=True)
    writer = SummaryWriter(log_dir=path)
    _WRITERS[path] = writer
    return writer


def _close(path: str) -> None:
    writer = _WRITERS.pop(path, None)
    _LAST_ROLLOUT_SEEN.discard(path)
    if writer is not None:
        writer.close()


@atexit.register
def _close_all() -> None:
    for path in list(_WRITERS):
        _close(path)
