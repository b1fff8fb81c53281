"""Checks of paths named by flags, run when a run starts and before any model loads."""

from __future__ import annotations

import os
from argparse import Namespace

from furlong.hooks import PluginError

__all__ = ["check_executor", "check_paths"]


def _hub_name(path: str) -> bool:
    """``org/model``: a Hugging Face hub name rather than a local path."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~")) and not os.path.exists(path)


def check_executor(args: Namespace) -> None:
    """The run can start with the resolved ``--executor``.

    :raises PluginError: ``--executor ray`` (chosen or the default for a trainer of several
        GPUs or the sglang engine): this version runs the ``local`` executor only, one
        process or one process per trainer rank under ``torchrun``.
    """
    if args.executor != "ray":
        return
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    raise PluginError(
        f"--executor ray (the default for --rollout-backend {args.rollout_backend} with {world} trainer GPU(s)) is "
        "not available in this version. Use --rollout-backend embedded --executor local; for several trainer "
        f"ranks start one process per rank: torchrun --nproc-per-node {world} -m furlong.core train ... "
        f"(with --actor-num-nodes x --actor-num-gpus-per-node = {world})."
    )


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
    elif not _hub_name(args.hf_checkpoint):
        problems.append(f"--hf-checkpoint '{args.hf_checkpoint}': no such directory.")
    for flag, value in (("--ref-load", args.ref_load), ("--chat-template-path", args.chat_template_path)):
        if value and not os.path.exists(value):
            problems.append(f"{flag} '{value}': no such file or directory.")
    if problems:
        raise PluginError("\n".join(problems))
