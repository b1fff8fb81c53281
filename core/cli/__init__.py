"""The ``furlong`` command: its subcommands, the plugin scaffold and the metrics plot."""

from .commands import main

__all__ = ["main"]
