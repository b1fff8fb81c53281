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
from argparse import Namespace

from furlong.hooks import PluginError, hookimpl

from ._common import is_last_event, rollout_axis_step, run_dir, scalars

__all__ = ["init_kwargs", "on_eval_end", "on_rollout_end", "on_train_step_end"]

MODES = ("online", "offline", "disabled")
_STEP_OF_PREFIX = (("train/*", "train/step"), ("rollout/*", "rollout/step"), ("perf/*", "rollout/step"),
                   ("eval/*", "eval/step"))

_RUNS: dict[int, tuple] = {}  # id(args) -> (args, open wandb run); holding args keeps its id unique
_LAST_ROLLOUT_SEEN: set[int] = set()


def init_kwargs(args: Namespace) -> dict:
    """Keyword arguments of ``wandb.init`` for these flags (see the module docstring).

    :raises PluginError: ``--wandb-mode`` is not one of ``online``, ``offline``, ``disabled``.
    """
    mode = getattr(args, "wandb_mode", None)
    if mode is not None and mode not in MODES:
        raise PluginError(f"--wandb-mode '{mode}': not a W&B mode. Choose one of: {', '.join(MODES)}.")
    group = getattr(args, "wandb_group", None)
    name = group
    if group and not getattr(args, "disable_wandb_random_suffix", False):
        name = f"{group}-{secrets.token_hex(3)}"
    run_id = getattr(args, "wandb_run_id", None)
    kwargs = {
        "project": getattr(args, "wandb_project", None) or "furlong",
        "entity": getattr(args, "wandb_team", None),
        "group": name,
        "name": name,
        "mode": mode,
        "dir": getattr(args, "wandb_dir", None) or run_dir(args),
        "id": run_id,
        "resume": "allow" if run_id else None,
        "config": _config(args),
        "reinit": "create_new",
    }
    return {k: v for k, v in kwargs.items() if v is not None}


@hookimpl
def on_rollout_end(args, rollout_id, metrics):
    """Log the rollout's ``rollout/`` and ``perf/`` values with ``rollout/step``.

    :raises PluginError: ``wandb`` is not installed (install it: ``pip install wandb``), or a
        bad ``--wandb-mode``.
    """
    step = rollout_axis_step(args, rollout_id, getattr(args, "wandb_always_use_train_step", False))
    _log(args, "on_rollout_end", rollout_id, {**scalars(metrics, ("train/",)), "rollout/step": step})


@hookimpl
def on_train_step_end(args, rollout_id, step, metrics):
    """Log one optimizer step's ``train/`` values with ``train/step`` = ``step``."""
    _log(args, "on_train_step_end", rollout_id, {**scalars(metrics), "train/step": int(step)})


@hookimpl
def on_eval_end(args, rollout_id, metrics):
    """Log the evaluation's values with ``eval/step`` (and ``rollout/step`` for ``perf/eval_time``)."""
    step = rollout_axis_step(args, rollout_id, getattr(args, "wandb_always_use_train_step", False))
    _log(args, "on_eval_end", rollout_id, {**scalars(metrics), "eval/step": step, "rollout/step": step})


def _log(args: Namespace, hook: str, rollout_id: int, row: dict) -> None:
    if not getattr(args, "use_wandb", False):
        return
    key = id(args)
    run = _RUNS[key][1] if key in _RUNS else _start(args, key)
    run.log(row)
    if hook == "on_rollout_end" and rollout_id >= getattr(args, "num_rollout", 0) - 1:
        _LAST_ROLLOUT_SEEN.add(key)
    if is_last_event(hook, args, rollout_id, key in _LAST_ROLLOUT_SEEN):
        _finish(key)


def _start(args: Namespace, key: int):
    kwargs = init_kwargs(args)
    try:
        import wandb
    except ImportError as exc:
        raise PluginError(f"--use-wandb needs the wandb package ({type(exc).__name__}: {exc}). "
                          'Install it with: pip install wandb (or pip install "furlong[wandb]"), '
                          "or drop --use-wandb.") from exc
    if kwargs.get("dir"):
        os.makedirs(kwargs["dir"], exist_ok=True)
    key_flag, host = getattr(args, "wandb_key", None), getattr(args, "wandb_host", None)
    if (key_flag or host) and kwargs.get("mode") not in ("offline", "disabled"):
        wandb.login(key=key_flag, host=host)
    run = wandb.init(**kwargs)
    for step_key in ("train/step", "rollout/step", "eval/step"):
        run.define_metric(step_key)
    for pattern, step_key in _STEP_OF_PREFIX:
        run.define_metric(pattern, step_metric=step_key)
    _RUNS[key] = (args, run)
    return run


def _finish(key: int) -> None:
    entry = _RUNS.pop(key, None)
    _LAST_ROLLOUT_SEEN.discard(key)
    if entry is not None:
        entry[1].finish()


def _config(args: Namespace) -> dict:
    """The launch flags as W&B config: JSON-like values kept, anything else as its ``str``."""
    out = {}
    for name, value in sorted(vars(args).items()):
        if name == "wandb_key":
            continue  # never store the API key in the run's config
        out[name] = value if isinstance(value, (bool, int, float, str, list, tuple, dict, type(None))) else str(value)
    return out


@atexit.register
def _finish_all() -> None:
    for key in list(_RUNS):
        _finish(key)
