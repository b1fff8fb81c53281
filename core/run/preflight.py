"""Checks of paths named by flags, run when a run starts and before any model loads."""

from __future__ import annotations

import os

from furlong.hooks import PluginError, RunConfig

from .checkpoints import read_marker, same_dir

__all__ = ["check_paths", "hf_checkpoint_problems"]


def _looks_like_hub_id(path: str) -> bool:
    """``org/model``: what a Hugging Face Hub id looks like (furlong does not download it)."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~")) and not path.endswith("/")


def hf_checkpoint_problems(path: str | None) -> list[str]:
    """What is wrong with ``--hf-checkpoint path`` (empty when it names a model directory).

    furlong reads local model directories only: a path that does not exist is an error at once,
    never a Hugging Face Hub download (which would try the network for a minute on a machine
    without it). A value that looks like a Hub id (``org/model``) gets the command that downloads it.
    """
    if not path:
        return ["--hf-checkpoint is required: the Hugging Face model directory (config, tokenizer, weights)."]
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            return [f"--hf-checkpoint '{path}': the directory has no config.json; "
                    "point it at a Hugging Face model directory."]
        return []
    if os.path.isfile(path):
        return [f"--hf-checkpoint '{path}': is a file; pass the model directory "
                f"('{os.path.dirname(path) or '.'}' holds it)."]
    if _looks_like_hub_id(path):
        return [f"--hf-checkpoint '{path}': no such directory (in {os.getcwd()}). furlong reads local model "
                "directories only, never the Hugging Face Hub; if this is a Hub id, download it first "
                f"(hf download {path} --local-dir models/{path.split('/')[1]}) and pass that folder."]
    return [f"--hf-checkpoint '{path}': no such directory."]


def check_paths(config: RunConfig) -> None:
    """Every path flag names something that exists; all problems reported at once.

    ``--hf-checkpoint`` must be a directory with a ``config.json`` (a Hugging Face model
    directory); a Hub id (``org/model``) is not downloaded (:func:`hf_checkpoint_problems`).

    :raises PluginError: one line per missing or unusable path.
    """
    problems = hf_checkpoint_problems(config.hf_checkpoint)
    for flag, value in (("--ref-load", config.ref_load), ("--chat-template-path", config.chat_template_path)):
        if value and not os.path.exists(value):
            problems.append(f"{flag} '{value}': no such file or directory.")
    problems.extend(_save_problems(config))
    if problems:
        raise PluginError("\n".join(problems))


def _save_problems(config: RunConfig) -> list[str]:
    """``--save`` must be a directory (or not exist yet) and must not hold another run.

    A ``--save`` directory with a checkpoint marker is resumed only through ``--load`` of
    the same directory; otherwise its checkpoints would be overwritten from rollout 0.
    """
    save = config.save
    if not save:
        return []
    if os.path.exists(save) and not os.path.isdir(save):
        return [f"--save '{save}': is an existing file; --save needs a directory (it is created if missing)."]
    marker = read_marker(save) if os.path.isdir(save) else None
    load = config.load
    if marker is not None and not same_dir(load, save):
        return [f"--save '{save}': already holds a run (latest checkpoint {marker}); pass --load {save} to resume "
                "it, or choose an empty --save directory."]
    return []
