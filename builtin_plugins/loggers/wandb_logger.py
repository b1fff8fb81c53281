"""Weights & Biases logger (enabled by ``--use-wandb``; the ``wandb`` package is optional).

Flags (defined by the core, ``logging`` group): ``--wandb-project`` (default ``furlong``),
``--wandb-team`` (entity), ``--wandb-group`` (also the run name; a random 6-character suffix
is added unless ``--disable-wandb-random-suffix``), ``--wandb-mode`` (``online``, ``offline``
- no network needed - or ``disabled``), ``--wandb-dir`` (default ``--save`` or ``--log-dir``;
wandb writes its ``wandb/`` folder there), ``--wandb-run-id`` (resume that run:
``resume="allow"``), ``--wandb-key`` / ``--wandb-host`` (``wandb.login`` before an online run),
``--wandb-always-use-train-step``.

Every row carries its step key as a value and ``define_metric`` ties each prefix to it:
``train/*`` to ``train/step`` (``rollout_id * S + s``); ``rollout/*`` and ``perf/*`` to
``rollout/step``; ``eval/*`` to ``eval/step``. Rollout and eval steps are the rollout id, or
``rollout_id * S`` with ``--wandb-always-use-train-step``. ``on_rollout_end``
skips the ``train/`` values it repeats from the rollout's last step. The run is finished
after the run's last event (see ``loggers._common``) and at interpreter exit otherwise.
"""

from __future__ import annotations

import atexit
import os
import secrets

from furlong.hooks import PluginError, RunConfig, hookimpl
from furlong.kit.redact import redact

from ._common import is_last_event, rollout_axis_step, run_dir, scalars

__all__ = ["init_kwargs", "on_eval_end", "on_rollout_end", "on_train_step_end"]

MODES = ("online", "offline", "disabled")
_STEP_OF_PREFIX = (("train/*", "train/step"), ("rollout/*", "rollout/step"), ("perf/*", "rollout/step"),
                   ("eval/*", "eval/step"))

_RUNS: dict[int, tuple] = {}  # id(config) -> (config, open wandb run); holding config keeps its id unique
_LAST_ROLLOUT_SEEN: set[int] = set()


def init_kwargs(config: RunConfig) -> dict:
    """Keyword arguments of ``wandb.init`` for these flags (see the module docstring).

    :raises PluginError: ``--wandb-mode`` is not one of ``online``, ``offline``, ``disabled``.
    """
    mode = config.wandb_mode
    if mode is not None and mode not in MODES:
        raise PluginError(f"--wandb-mode '{mode}': not a W&B mode. Choose one of: {', '.join(MODES)}.")
    group = config.wandb_group
    name = group
    if group and not config.disable_wandb_random_suffix:
        name = f"{group}-{secrets.token_hex(3)}"
    run_id = config.wandb_run_id
    kwargs = {
        "project": config.wandb_project or "furlong",
        "entity": config.wandb_team,
        "group": name,
        "name": name,
        "mode": mode,
        "dir": config.wandb_dir or run_dir(config),
        "id": run_id,
        "resume": "allow" if run_id else None,
        "config": _config(config),
        "reinit": "create_new",
    }
    return {k: v for k, v in kwargs.items() if v is not None}


@hookimpl
def on_rollout_end(config, rollout_id, metrics):
    """Log the rollout's ``rollout/`` and ``perf/`` values with ``rollout/step``.

    :raises PluginError: ``wandb`` is not installed (install it: ``pip install wandb``), or a
        bad ``--wandb-mode``.
    """
    step = rollout_axis_step(config, rollout_id, config.wandb_always_use_train_step)
    _log(config, "on_rollout_end", rollout_id, {**scalars(metrics, ("train/",)), "rollout/step": step})


@hookimpl
def on_train_step_end(config, rollout_id, step, metrics):
    """Log one optimizer step's ``train/`` values with ``train/step`` = ``step``."""
    _log(config, "on_train_step_end", rollout_id, {**scalars(metrics), "train/step": int(step)})


@hookimpl
def on_eval_end(config, rollout_id, metrics):
    """Log the evaluation's values with ``eval/step`` (and ``rollout/step`` for ``perf/eval_time``)."""
    step = rollout_axis_step(config, rollout_id, config.wandb_always_use_train_step)
    _log(config, "on_eval_end", rollout_id, {**scalars(metrics), "eval/step": step, "rollout/step": step})


def _log(config: RunConfig, hook: str, rollout_id: int, row: dict) -> None:
    if not config.use_wandb:
        return
    key = id(config)
    run = _RUNS[key][1] if key in _RUNS else _start(config, key)
    run.log(row)
    if hook == "on_rollout_end" and rollout_id >= config.num_rollout - 1:
        _LAST_ROLLOUT_SEEN.add(key)
    if is_last_event(hook, config, rollout_id, key in _LAST_ROLLOUT_SEEN):
        _finish(key)


def _start(config: RunConfig, key: int):
    kwargs = init_kwargs(config)
    try:
        import wandb
    except ImportError as exc:
        raise PluginError(f"--use-wandb needs the wandb package ({type(exc).__name__}: {exc}). "
                          'Install it with: pip install wandb (or pip install "furlong[wandb]"), '
                          "or drop --use-wandb.") from exc
    if kwargs.get("dir"):
        os.makedirs(kwargs["dir"], exist_ok=True)
    key_flag, host = config.wandb_key, config.wandb_host
    if (key_flag or host) and kwargs.get("mode") not in ("offline", "disabled"):
        wandb.login(key=key_flag, host=host)
    run = wandb.init(**kwargs)
    for step_key in ("train/step", "rollout/step", "eval/step"):
        run.define_metric(step_key)
    for pattern, step_key in _STEP_OF_PREFIX:
        run.define_metric(pattern, step_metric=step_key)
    _RUNS[key] = (config, run)
    return run


def _finish(key: int) -> None:
    entry = _RUNS.pop(key, None)
    _LAST_ROLLOUT_SEEN.discard(key)
    if entry is not None:
        entry[1].finish()


def _config(config: RunConfig) -> dict:
    """The run configuration as W&B config: JSON-like values kept, anything else as its ``str``; never a
    credential (:func:`furlong.kit.redact.redact`: ``wandb_key`` left out, pass-through API keys ``***``)."""
    out = {}
    for name, value in sorted(redact(vars(config.namespace()), drop=True).items()):
        out[name] = value if isinstance(value, (bool, int, float, str, list, tuple, dict, type(None))) else str(value)
    return out


@atexit.register
def _finish_all() -> None:
    for key in list(_RUNS):
        _finish(key)
