"""Checks of paths named by flags, run when a run starts and before any model loads."""

from __future__ import annotations

import os
from argparse import Namespace

from furlong.hooks import PluginError

from .checkpoints import read_marker, same_dir

__all__ = ["check_paths"]


def _hub_name(path: str) -> bool:
    """``org/model``: a Hugging Face hub name rather than a local path."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~")) and not os.path.exists(path)


def check_paths(args: Namespace) -> None:
    """Every path flag names something that exists; all problems reported at once.

    ``--hf-checkpoint`` must be a directory with a ``config.json`` (a Hugging Face model
    directory); a name like ``org/model`` without such a directory is left to the hub.

    :raises PluginError: one line per missing or unusable path.
    """
    problems = []
    if not args.hf_checkpoint:
        problems.append("--hf-checkpoint is required: the Hugging Face model directory (config, tokenizer, weights).")
    elif os.path.isdir(args.hf_checkpoint):
        if not os.path.isfile(os.path.join(args.hf_checkpoint, "config.json")):
            problems.append(f"--hf-checkpoint '{args.hf_checkpoint}': the directory has no config.json; "
                            "point it at a Hugging Face model directory.")
    elif os.path.isfile(args.hf_checkpoint):
        problems.append(f"--hf-checkpoint '{args.hf_checkpoint}': is a file; pass the model directory "
                        f"('{os.path.dirname(args.hf_checkpoint) or '.'}' holds it).")
    elif not _hub_name(args.hf_checkpoint):
        problems.append(f"--hf-checkpoint '{args.hf_checkpoint}': no such directory.")
    for flag, value in (("--ref-load", args.ref_load), ("--chat-template-path", args.chat_template_path)):
        if value and not os.path.exists(value):
            problems.append(f"{flag} '{value}': no such file or directory.")
    problems.extend(_save_problems(args))
    if problems:
        raise PluginError("\n".join(problems))


def _save_problems(args: Namespace) -> list[str]:
    """``--save`` must be a directory (or not exist yet) and must not hold another run.

    A ``--save`` directory with a checkpoint marker is resumed only through ``--load`` of
    the same directory; otherwise its checkpoints would be overwritten from rollout 0.
    """
    save = getattr(args, "save", None)
    if not save:
        return []
    if os.path.exists(save) and not os.path.isdir(save):
        return [f"--save '{save}': is an existing file; --save needs a directory (it is created if missing)."]
    marker = read_marker(save) if os.path.isdir(save) else None
    load = getattr(args, "load", None)
    if marker is not None and not same_dir(load, save):
        return [f"--save '{save}': already holds a run (latest checkpoint {marker}); pass --load {save} to resume "
                "it, or choose an empty --save directory."]
    return []
