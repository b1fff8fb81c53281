"""Where a trainer's starting weights can come from: a Hugging Face model directory or a saved ``torch_dist``
checkpoint (``--ref-load``)."""

from __future__ import annotations

import os

from furlong.kit.hf import is_hf_dir

__all__ = ["start_weights_problem", "torch_dist_dir"]


def torch_dist_dir(path: str | None) -> str | None:
    """The ``torch_dist`` checkpoint directory ``path`` names: itself (an ``iter_N`` directory, holding megatron-core's
    ``metadata.json``) or, for a save folder, its ``iter_<latest_checkpointed_iteration>``; None when it is neither."""
    if not path or not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    marker = os.path.join(path, "latest_checkpointed_iteration.txt")
    try:
        with open(marker) as f:
            return os.path.join(path, f"iter_{int(f.read().strip()):07d}")
    except (OSError, ValueError):  # no marker, or not a number
        return None


def start_weights_problem(flag: str, path: str | None) -> str | None:
    """Why the existing ``path`` given to ``flag`` cannot hold starting weights, in words: a directory that is
    neither a Hugging Face model directory (``config.json``) nor a ``torch_dist`` checkpoint (a backend would
    otherwise start from ``--hf-checkpoint`` without a word); None when it can, or when ``path`` is unset or absent
    (reported as missing elsewhere)."""
    if not path or not os.path.exists(path) or is_hf_dir(path) or torch_dist_dir(path):
        return None
    what = ("is a directory with neither a Hugging Face model (config.json) nor a torch_dist checkpoint "
            "(metadata.json, or a save folder's latest_checkpointed_iteration.txt) in it" if os.path.isdir(path) else
            "is a file, not a Hugging Face model directory or a torch_dist checkpoint directory")
    return (f"{flag} '{path}' {what}: point it at the weights the trainer should start from, or leave it out to "
            "start from --hf-checkpoint.")
