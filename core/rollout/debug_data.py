"""Rollouts written to files and read back: ``--save-debug-rollout-data``, ``--load-debug-rollout-data``.

A path template holds ``{rollout_id}`` (``/data/rollout_{rollout_id}.pt``); evaluation
rollouts are written with ``eval_<id>`` in its place. One file per rollout, written with
``torch.save``: ``{"rollout_id": int, "metadata": dict, "samples": [Sample.to_dict(), ...]}``,
the samples in training order (the layout Miles writes, so a file Miles saved loads too
when it holds only plain values). Files are read with ``torch.load(weights_only=True)``:
plain data only, never arbitrary objects.
"""

from __future__ import annotations

import os
from typing import Iterable

from furlong.hooks import PluginError, Sample

__all__ = ["group_samples", "load_rollout", "rollout_path", "save_rollout"]


def rollout_path(template: str, rollout_id: int, evaluation: bool = False) -> str:
    """The file of rollout ``rollout_id`` under ``template`` (``eval_<id>`` for an evaluation).

    :raises PluginError: ``template`` has a placeholder other than ``{rollout_id}``.
    """
    key = f"eval_{rollout_id}" if evaluation else str(rollout_id)
    try:
        return template.format(rollout_id=key)
    except (KeyError, IndexError, ValueError) as exc:
        raise PluginError(f"debug rollout data path {template!r}: only the placeholder {{rollout_id}} is filled "
                          f"({type(exc).__name__}: {exc}).") from exc


def save_rollout(template: str, rollout_id: int, samples: Iterable[Sample], evaluation: bool = False,
                 metadata: dict | None = None) -> str:
    """Write ``samples`` as rollout ``rollout_id``'s file (atomically: a temporary file renamed); return its path."""
    import torch

    path = rollout_path(template, rollout_id, evaluation)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    payload = {"rollout_id": int(rollout_id), "metadata": dict(metadata or {}),
               "samples": [sample.to_dict() for sample in samples]}
    tmp = f"{path}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_rollout(template: str, rollout_id: int) -> list[list[Sample]]:
    """Rollout ``rollout_id``'s samples from its file, as groups (:func:`group_samples`).

    :raises PluginError: the file is missing, holds more than plain data, or has no ``samples`` list
        (each names the file and ``--load-debug-rollout-data``).
    """
    import pickle

    import torch

    path = rollout_path(template, rollout_id)
    flag = "--load-debug-rollout-data"
    if not os.path.isfile(path):
        raise PluginError(f"{flag} {template}: rollout {rollout_id}'s file {path} does not exist. Write it in an "
                          f"earlier run with --save-debug-rollout-data {template}, or lower --num-rollout.")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise PluginError(f"{flag}: {path} holds objects other than plain values (lists, dicts, numbers, strings, "
                          f"tensors), which are not loaded: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
        raise PluginError(f"{flag}: cannot read {path}: {type(exc).__name__}: {exc}") from exc
    rows = payload.get("samples") if isinstance(payload, dict) else None
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise PluginError(f"{flag}: {path} is not a saved rollout: expected a dict with a 'samples' list of dicts.")
    return group_samples([Sample.from_dict(row) for row in rows])


def group_samples(samples: list[Sample]) -> list[list[Sample]]:
    """``samples`` in groups of one ``group_index`` each, groups and samples in their first order.

    Samples without a ``group_index`` form a group each.
    """
    groups: dict = {}
    for position, sample in enumerate(samples):
        key = ("index", sample.group_index) if sample.group_index is not None else ("alone", position)
        groups.setdefault(key, []).append(sample)
    return list(groups.values())
