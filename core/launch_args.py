"""The launch flags of a ``furlong train`` run with every default, for plugin tests and the contract kit."""

from __future__ import annotations

from argparse import Namespace

__all__ = ["launch_args"]

REQUIRED = {"--num-rollout": "1", "--rollout-batch-size": "1"}


def launch_args(*argv: str, pm=None) -> Namespace:
    """Parse ``argv`` as ``furlong train`` does, after the installed plugins added their flags.

    The two flags a run must give (``--num-rollout``, ``--rollout-batch-size``) default
    to 1 here; everything else takes furlong's and the plugins' defaults. Touches no file.

    :param argv: launch flags, e.g. ``("--rm-type", "my_reward", "--my-reward-scale", "2")``.
    :param pm: the plugin manager whose plugins add flags (default: every installed plugin).
    :returns: the validated ``argparse.Namespace`` the hooks receive as ``args``.
    :raises PluginError: a flag is unknown or invalid (one message naming every problem).
    """
    from .config import parse_args
    from .plugins import get_plugin_manager

    given = {token.split("=", 1)[0] for token in argv}
    filled = [item for flag, value in REQUIRED.items() if flag not in given for item in (flag, value)]
    return parse_args(filled + list(argv), pm if pm is not None else get_plugin_manager(), command="train")
