"""Importing a user's object named by a flag as a dotted path (``package.module.attr``)."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any

from furlong.hooks.errors import PluginError

__all__ = ["import_dotted"]

log = logging.getLogger("furlong.config")


def import_dotted(path: str, flag: str) -> Any:
    """Import ``package.module.attr`` named by ``flag``.

    A module found in the working directory imports as under ``python -m`` (which puts that
    directory first on ``sys.path``; the ``furlong`` console script does not): the directory is
    added to ``sys.path`` and to ``PYTHONPATH`` (so the run's other processes, Ray actors
    included, import it too), with a note.

    :raises PluginError: the path has no dot, the module cannot be imported, or it lacks
        the attribute (the message names the flag, module and attribute; for a module that is
        nowhere, where furlong looked and how to add a folder).
    """
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise PluginError(f"{flag} '{path}': expected a dotted path 'module.function'.")
    if attr == "py" and "/" not in path:
        raise PluginError(f"{flag} '{path}': a dotted path names the module without '.py' and then the function: "
                          f"'{module_name}.FUNCTION'.")
    try:
        module = _import_module(module_name, path, flag)
    except Exception as exc:  # noqa: BLE001 - report any import failure the same way
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name == module_name.split(".")[0]:
            hint = (f" (not installed, not on PYTHONPATH and not in the working directory {os.getcwd()}: run furlong "
                    "from the folder holding it, or set PYTHONPATH to that folder)")
        raise PluginError(f"{flag} '{path}': cannot import module '{module_name}': {type(exc).__name__}: {exc}"
                          f"{hint}") from exc
    if not hasattr(module, attr):
        raise PluginError(f"{flag} '{path}': module '{module_name}' has no attribute '{attr}'")
    return getattr(module, attr)


def _import_module(module_name: str, path: str, flag: str) -> Any:
    """``importlib.import_module(module_name)``, from the working directory when its top package is there."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        cwd = os.getcwd()
        here = os.path.isfile(os.path.join(cwd, f"{top}.py")) or os.path.isdir(os.path.join(cwd, top))
        if exc.name != top or not here or _on_sys_path(cwd):
            raise
    sys.path.insert(0, cwd)
    os.environ["PYTHONPATH"] = os.pathsep.join([cwd, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    importlib.invalidate_caches()
    log.info("%s %s: '%s' imported from the working directory %s (as python -m would); added to PYTHONPATH for the "
             "run's other processes.", flag, path, top, cwd)
    return importlib.import_module(module_name)


def _on_sys_path(folder: str) -> bool:
    real = os.path.realpath(folder)
    return any(os.path.realpath(entry or os.curdir) == real for entry in sys.path)
