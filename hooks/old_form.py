"""The ``args`` an old-form hook implementation gets (accepted until the next minor version).

Before the run configuration was frozen, hooks took the launch flags' ``argparse.Namespace``
as ``args``, and two facts that vary per call were patched onto copies of it: the engine's
index (``args.rollout_engine_index``) and the data set a ``data_source`` reads
(``args.prompt_data``, ``args.prompt_data_flag``, the row keys, ``args.rollout_shuffle``,
``args.rollout_max_prompt_len``). An implementation that still takes ``args`` gets that view,
built from the call's ``config``, ``engine_index`` and ``dataset`` (PLUGINS.md, "Deprecations"): the
plugin manager and the contract test kit both hand it over.
"""

from __future__ import annotations

import logging
import warnings
from argparse import Namespace

__all__ = ["old_form_args", "warn_old_form"]

_WARNED: set[tuple[str, str]] = set()


def old_form_args(kwargs: dict) -> Namespace:
    """``kwargs["config"].namespace()`` with the call's ``engine_index`` and ``dataset`` written in as before."""
    view = kwargs["config"].namespace()
    if "engine_index" in kwargs:
        view.rollout_engine_index = kwargs["engine_index"]
    dataset = kwargs.get("dataset")
    if dataset is not None:
        view.prompt_data, view.prompt_data_flag = dataset.path, dataset.flag
        view.input_key, view.label_key = dataset.input_key, dataset.label_key
        view.metadata_key, view.tool_key = dataset.metadata_key, dataset.tool_key
        view.rollout_shuffle, view.rollout_max_prompt_len = dataset.shuffle, dataset.max_prompt_len
    return view


def warn_old_form(plugin: str, hook: str, old: str, new: str) -> None:
    """Say once per plugin and hook that it uses an old form: a ``DeprecationWarning`` (for the plugin's
    own tests) and a warning in the run's log (Python hides ``DeprecationWarning`` outside tests).

    :param old: the form, e.g. "`reward(args, ...)`"; ``new``: what to do instead.
    """
    if (plugin, hook) in _WARNED:
        return
    _WARNED.add((plugin, hook))
    message = (f"plugin '{plugin}': {old} is the old form of the hook; {new}. The old form goes away in the next "
               f"minor version (PLUGINS.md, \"Deprecations\").")
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    logging.getLogger("furlong.plugins").warning("%s", message)
