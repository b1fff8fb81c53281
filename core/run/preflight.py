"""Checks of paths named by flags, run when a run starts and before any model loads."""

from __future__ import annotations

import os

from furlong.hooks import PluginError, RunConfig
from furlong.kit.start_weights import start_weights_problem

from ..config.hf_checkpoint import hf_checkpoint_problems
from .checkpoints import read_marker, same_dir

__all__ = ["check_paths"]


def check_paths(config: RunConfig) -> None:
    """Every path flag names something that exists; all problems reported at once.

    ``--hf-checkpoint`` must be a directory with a ``config.json`` (a Hugging Face model
    directory); a Hub id (``org/model``) is not downloaded (:func:`hf_checkpoint_problems`).
    ``--ref-load`` must hold a Hugging Face model or a ``torch_dist`` checkpoint.
    A ``--critic-load`` given (not the default ppo derives, which need not exist yet) must exist.

    :raises PluginError: one line per missing or unusable path.
    """
    problems = hf_checkpoint_problems(config.hf_checkpoint)
    for flag, value in (("--ref-load", config.ref_load), ("--chat-template-path", config.chat_template_path)):
        if value and not os.path.exists(value):
            problems.append(f"{flag} '{value}': no such file or directory.")
    no_weights = start_weights_problem("--ref-load", config.ref_load)
    if no_weights:
        problems.append(no_weights)
    if config.use_critic and "critic_load" in config.explicit_args and not os.path.exists(config.critic_load or ""):
        problems.append(f"--critic-load '{config.critic_load}': no such directory (a critic checkpoint folder or a "
                        "Hugging Face directory); leave it out to start the critic from --hf-checkpoint.")
    problems.extend(_save_problems(config))
    if problems:
        raise PluginError("\n".join(problems))


def _save_problems(config: RunConfig) -> list[str]:
    """``--save`` must be a directory (or not exist yet) and must not hold another run, nor
    ``--critic-save`` another run's critic.

    A ``--save`` directory with a checkpoint marker is resumed only through ``--load`` of
    the same directory; otherwise its checkpoints would be overwritten from rollout 0. A
    ``--critic-save`` with a marker is only written by the run that resumes it.
    """
    save = config.save
    if not save:
        return []
    if os.path.exists(save) and not os.path.isdir(save):
        return [f"--save '{save}': is an existing file; --save needs a directory (it is created if missing)."]
    marker = read_marker(save) if os.path.isdir(save) else None
    load = config.load
    resumes = marker is not None and same_dir(load, save)
    if marker is not None and not resumes:
        return [f"--save '{save}': already holds a run (latest checkpoint {marker}); pass --load {save} to resume "
                "it, or choose an empty --save directory."]
    critic = config.critic_save if config.use_critic else None
    critic_marker = read_marker(critic) if critic and os.path.isdir(critic) else None
    if critic_marker is not None and not resumes:
        return [f"--critic-save '{critic}': already holds another run's critic (latest checkpoint {critic_marker}), "
                f"which this run would start from and overwrite; move it away, choose another --save (the critic "
                f"goes to --save + '_critic') or --critic-save"
                + (f", or resume that run with --load {save}." if marker is not None else ".")]
    return []
