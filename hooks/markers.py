"""pluggy markers of the ``furlong`` project."""

import pluggy

PROJECT = "furlong"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
