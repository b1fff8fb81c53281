"""HTTP calls to SGLang servers and the router: one shared client per process, bounded retries.

Generation and control travel on two :mod:`aiohttp` sessions of this process, shared by
every engine in it: generation requests are capped at ``--sglang-server-concurrency``
connections per engine, control calls (pause, continue, weight updates) have their own
pool, so a control call is never queued behind the requests it is meant to pause.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from furlong.hooks import PluginError

__all__ = ["Http", "HttpError", "release_http", "shared_http"]

log = logging.getLogger("furlong.engines.sglang")

RETRY_SLEEP_S = 1.0
RETRIED_STATUS = (408, 429, 500, 502, 503, 504)  # the server or router may come back; 4xx otherwise is final


class HttpError(PluginError):
    """A call that failed for good; ``status`` is the last HTTP status (None: no answer), ``answer``
    the decoded body of that last answer (None: no answer)."""

    def __init__(self, message: str, status: int | None = None, answer: Any = None) -> None:
        super().__init__(message)
        self.status, self.answer = status, answer


class Http:
    """The two sessions of this process's event loop (see the module doc)."""

    def __init__(self, generation_limit: int) -> None:
        import aiohttp

        self.generation = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=generation_limit))
        self.control = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))

    async def call(self, method: str, url: str, body: Any = None, *, timeout_s: float, retries: int = 60,
                   generation: bool = False, headers: dict | None = None, idempotent: bool = True,
                   give_up: Callable[[], str | None] | None = None) -> Any:
        """``method url`` with JSON ``body``; return the decoded JSON answer (or its text, or None).

        Connection errors, time-outs and the statuses in :data:`RETRIED_STATUS` are retried
        ``retries`` times, one second apart; another 4xx fails at once. A call that is not
        ``idempotent`` (opening a weight-update session, joining a process group, receiving
        a broadcast bucket) is sent again only when the connection was refused, which means
        the server never saw it: after a time-out or a 5xx it may have acted, and a second
        copy would fail or wait for a broadcast that never comes.

        :param give_up: called before each retry; a non-None reason stops retrying (a
            server process known to be dead).
        :raises HttpError: the last error, naming the URL, the attempts and the answer.
        """
        import aiohttp

        session = self.generation if generation else self.control
        attempts, last, status, answer = 0, "", None, None
        while True:
            attempts += 1
            try:
                async with session.request(method, url, json=body, headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                    text = await response.text()
                    status = response.status
                    if status < 400:
                        return _decode(response.content_type, text)
                    last, answer = f"HTTP {status}: {text.strip()[:300]}", _decode(response.content_type, text)
                    if status not in RETRIED_STATUS or not idempotent:
                        break
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last, status, answer = f"{type(exc).__name__}: {exc}".rstrip(": "), None, None
                if not idempotent and not isinstance(exc, aiohttp.ClientConnectorError):
                    break
            reason = give_up() if give_up is not None else None
            if reason:
                last = f"{last}; {reason}"
                break
            if attempts > retries:
                break
            await asyncio.sleep(RETRY_SLEEP_S)
        raise HttpError(f"{method} {url} failed after {attempts} attempt(s): {last}", status, answer)

    async def close(self) -> None:
        await self.generation.close()
        await self.control.close()


_SHARED: dict[int, list] = {}  # id(loop) -> [loop, Http, users]


def shared_http(generation_limit: int) -> Http:
    """This process's :class:`Http` for the running event loop (made by the first caller, with its limit).

    Every caller calls :func:`release_http` when done; the last one closes the sessions.
    """
    loop = asyncio.get_running_loop()
    held = _SHARED.get(id(loop))
    if held is None or held[0] is not loop:
        held = _SHARED[id(loop)] = [loop, Http(generation_limit), 0]
    held[2] += 1
    return held[1]


async def release_http() -> None:
    """One caller of :func:`shared_http` is done with it."""
    loop = asyncio.get_running_loop()
    held = _SHARED.get(id(loop))
    if held is None or held[0] is not loop:
        return
    held[2] -= 1
    if held[2] <= 0:
        del _SHARED[id(loop)]
        await held[1].close()


def _decode(content_type: str, text: str) -> Any:
    import json

    if not text:
        return None
    if content_type == "application/json" or text[:1] in "{[":
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text
