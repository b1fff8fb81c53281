"""The aiohttp application of ``furlong serve``: every route, and the 400 answer for refused requests."""

from __future__ import annotations

from aiohttp import web

from . import control, info
from .body import error_middleware
from .generate import generate_route, health_generate_route
from .state import STATE_KEY, ServeState

__all__ = ["make_app"]


def make_app(state: ServeState) -> web.Application:
    """The application serving ``state``'s engine (routes: SGLang's native API subset)."""
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024 * 1024)
    app[STATE_KEY] = state
    routes = [("POST", "/generate", generate_route), ("PUT", "/generate", generate_route),
              ("GET", "/health_generate", health_generate_route), *info.ROUTES, *control.ROUTES]
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    return app
