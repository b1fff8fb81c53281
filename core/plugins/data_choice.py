"""Which data source plugin reads a data set: the one ``--data-source`` (or ``--data-source-path``)
names, else the one that says it reads the file (its module-level ``reads_path(path) -> bool``), else
``--data-source``'s default.

A data source plugin may define ``reads_path``: the core then chooses it for ``--prompt-data`` (and
for each eval set) whose path it claims, so ``--prompt-data train.parquet`` needs no
``--data-source`` flag. The core knows no plugin or format by name: each plugin claims its files.
"""

from __future__ import annotations

import logging

from furlong.hooks import RunConfig

from ..plugins.manager import FurlongPluginManager

__all__ = ["data_source_for", "reader_for"]

log = logging.getLogger("furlong.config")


def reader_for(path: str | None, pm: FurlongPluginManager) -> str | None:
    """The enabled data source plugin (by name order) whose ``reads_path(path)`` is true, or None.

    A ``reads_path`` that raises counts as false (the plugin's own reading reports the problem).
    """
    if not path:
        return None
    for name in pm.names_for("data_source"):
        claims = getattr(pm.get_plugin(name), "reads_path", None)
        try:
            if callable(claims) and claims(path):
                return name
        except Exception:  # noqa: BLE001 - a plugin's check must not stop the choice
            log.debug("data source '%s': reads_path(%r) failed", name, path, exc_info=True)
    return None


def data_source_for(config: RunConfig, pm: FurlongPluginManager, path: str | None, flag: str) -> tuple[str, str] | None:
    """``(plugin name, flag that chose it)`` of the data source that reads ``path`` when the flags leave
    the choice to the file (no ``--data-source``, no ``--data-source-path``), else None (the flags decide).

    :param flag: the flag that named ``path`` (``--prompt-data``, ``--eval-prompt-data NAME``), which
        then counts as the one that chose the plugin.
    """
    if config.data_source_path or "data_source" in config.explicit_args:
        return None
    name = reader_for(path, pm)
    return (name, flag) if name else None
