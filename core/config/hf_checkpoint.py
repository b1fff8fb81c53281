"""``--hf-checkpoint``: a local Hugging Face model directory, checked while the flags are parsed."""

from __future__ import annotations

import os

__all__ = ["hf_checkpoint_problems"]


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
