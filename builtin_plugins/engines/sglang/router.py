"""The router in front of the engines: start it, register and remove workers (sglang-router >= 0.3, smg).

Worker API (sglang-router 0.3.x and smg): ``POST /workers {"url",
"worker_type"}`` answers 202 and registers asynchronously, so the caller polls ``GET
/workers`` until the worker is listed healthy; ``DELETE /workers/{id}`` removes one (the id
comes from the listing). Routers before 0.3 (``/add_worker``) are refused with an error.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import logging
import time
from typing import Any
from urllib.parse import quote

from furlong.hooks import PluginError

from .http import Http, HttpError
from .launch import ManagedProcess, router_command

__all__ = ["NEEDS_ROUTER", "deregister", "list_workers", "register", "router_module", "start_router",
           "stop_routers"]

log = logging.getLogger("furlong.engines.sglang")

NEEDS_ROUTER = ('--rollout-backend sglang starts a router, which needs sglang-router >= 0.3 or smg: '
                'pip install "furlong[router]" (or give a running one with --sglang-router-ip/--sglang-router-port).')
REGISTER_TIMEOUT_S = 120.0
ROUTER_START_TIMEOUT_S = 60.0

_ROUTERS: list[ManagedProcess] = []


def router_module() -> str | None:
    """``sglang_router.launch_router`` or ``smg.launch_router``, whichever is installed (None: neither)."""
    for package in ("sglang_router", "smg"):
        if importlib.util.find_spec(package) is not None:
            return f"{package}.launch_router"
    return None


def start_router(args: Any, host: str, port: int, prometheus_port: int) -> ManagedProcess:
    """Start the router on ``host:port`` and wait until it answers ``GET /workers``; it stops when this process ends.

    :raises PluginError: no router package is installed, or the router exited or did not
        answer within a minute (the message holds the end of its log).
    """
    import urllib.error
    import urllib.request

    module = router_module()
    if module is None:
        raise PluginError(NEEDS_ROUTER)
    router = ManagedProcess("router", router_command(args, module, host, port, prometheus_port))
    _ROUTERS.append(router)
    deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
    probe = "127.0.0.1" if host == "0.0.0.0" else host
    while True:
        reason = router.exited()
        if reason:
            raise PluginError(f"the router did not start: {reason}")
        try:
            with urllib.request.urlopen(f"http://{probe}:{port}/workers", timeout=2) as response:
                if response.status == 200:
                    return router
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            router.kill()
            raise PluginError(f"the router at http://{host}:{port} did not answer within {ROUTER_START_TIMEOUT_S:g} s;"
                              f" the end of its log {router.log_path}:\n{router.log_tail()}")
        time.sleep(0.2)


def stop_routers() -> None:
    """Stop every router this process started (also at exit)."""
    while _ROUTERS:
        _ROUTERS.pop().kill()


atexit.register(stop_routers)


async def list_workers(http: Http, router_url: str) -> list[dict]:
    """The router's healthy-or-not registered workers: ``[{"id", "url", "is_healthy", ...}]``."""
    try:
        body = await http.call("GET", f"{router_url}/workers", timeout_s=30, retries=5)
    except HttpError as exc:
        if exc.status == 404:
            raise PluginError(f"the router at {router_url} has no GET /workers: furlong needs sglang-router >= 0.3 "
                              "or smg.") from exc
        raise
    return list((body or {}).get("workers") or []) if isinstance(body, dict) else []


async def register(http: Http, router_url: str, worker_url: str, alive=None) -> None:
    """Add ``worker_url`` to the router and wait until the router lists it healthy.

    :param alive: returns a reason when the worker's process died (stops the wait).
    :raises PluginError: the router refused the worker, or did not list it healthy within
        two minutes.
    """
    try:
        await http.call("POST", f"{router_url}/workers", {"url": worker_url, "worker_type": "regular"},
                        timeout_s=30, retries=5)
    except HttpError as exc:
        if exc.status == 404:
            raise PluginError(f"the router at {router_url} has no POST /workers: furlong needs sglang-router >= 0.3 "
                              "or smg.") from exc
        if exc.status != 409:  # 409: already registered (a re-registration after a restart on the same address)
            raise
    deadline = time.monotonic() + REGISTER_TIMEOUT_S
    while True:
        workers = await list_workers(http, router_url)
        if any(w.get("url") == worker_url and w.get("is_healthy", True) for w in workers):
            log.info("router %s: worker %s registered", router_url, worker_url)
            return
        reason = alive() if alive is not None else None
        if reason:
            raise PluginError(f"{worker_url} died while the router registered it: {reason}")
        if time.monotonic() > deadline:
            raise PluginError(f"the router at {router_url} did not list {worker_url} as a healthy worker within "
                              f"{REGISTER_TIMEOUT_S:g} s (GET /workers: {workers}).")
        await asyncio.sleep(0.25)


async def deregister(http: Http, router_url: str, worker_url: str) -> None:
    """Remove ``worker_url`` from the router (nothing if it is not registered)."""
    for worker in await list_workers(http, router_url):
        if worker.get("url") == worker_url:
            key = worker.get("id") or worker_url
            await http.call("DELETE", f"{router_url}/workers/{quote(str(key), safe='')}", timeout_s=30, retries=3)
            log.info("router %s: worker %s removed", router_url, worker_url)
