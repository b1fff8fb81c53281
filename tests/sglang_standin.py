"""A strict stand-in for an SGLang server of a given version, in front of a ``furlong serve`` process.

It answers on loopback as SGLang ``version`` would and forwards the work to the backend:

- a route that version's ``http_server.py`` does not define answers 404 (SGLang 0.5.16 has
  no ``/begin_weight_update``);
- every request body is checked with SGLang's own contract (``/generate`` with 0.5.23's
  ``api_types.GenerateRequest``; control bodies with that version's ``io_struct.py`` request
  type, unknown keys included); a violation is recorded and answered 400;
- the weight-update session of 0.5.21+ (``scheduler_components/weight_updater.py``
  l.192-197, 232-240, 309-334 in 0.5.23): broadcast and tensor updates outside a session,
  a second begin, an end without begin are recorded and refused with SGLang's answers;
- ``/server_info`` reports ``version``; every ``/generate``, ``/model_info`` and
  ``/server_info`` answer of the backend is decoded with ``api_types`` (a failure is recorded).

The backend follows 0.5.23's rules, so for an older version the stand-in opens and closes
the backend's session around each forwarded update itself. ``violations`` lists what the
client (or the backend's answers) got wrong; ``calls`` every ``(method, path)`` received.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import aiohttp
from aiohttp import web

import sglang_reference as ref

SESSION_UPDATES = ("/update_weights_from_distributed", "/update_weights_from_tensor")
DECODED_ANSWERS = {"/generate": "GenerateResponse", "/model_info": "GetModelInfoResponse",
                   "/server_info": "GetServerInfoResponse"}


class StandIn:
    """Serve SGLang ``version``'s rules on ``127.0.0.1:port`` in a thread of its own; :meth:`stop` ends it."""

    def __init__(self, version: str, backend: str, port: int) -> None:
        self.version, self.backend, self.port = version, backend.rstrip("/"), port
        self.url = f"http://127.0.0.1:{port}"
        self.sessions = ("POST", "/begin_weight_update") in ref.routes(version)
        self.version_reported = version  # what /server_info says (a test may make it lie)
        self.session_open = False
        self.violations: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the SGLang stand-in did not start")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._session = aiohttp.ClientSession(loop=self._loop)
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        async def close():
            await self._session.close()
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    # --- one request ------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        method, path = request.method, request.path
        self.calls.append((method, path))
        if (method, path) not in ref.routes(self.version):
            return web.json_response({"detail": "Not Found"}, status=404)
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            return self._refuse(f"{path}: the body is not JSON")
        problems = self._contract(method, path, body)
        if problems:
            return self._refuse(*problems)
        refusal = self._session_rule(path)
        if refusal is not None:
            return refusal
        if path in ("/begin_weight_update", "/end_weight_update"):
            self.session_open = path == "/begin_weight_update"
        own_session = path in SESSION_UPDATES and not self.sessions  # the backend needs one even so
        if own_session:
            await self._forward("POST", "/begin_weight_update", {})
        try:
            status, content_type, answer = await self._forward(method, path, body, query=request.query_string)
        finally:
            if own_session:
                await self._forward("POST", "/end_weight_update", {})
        if path == "/server_info" and status == 200:
            answer = json.dumps({**json.loads(answer), "version": self.version_reported}).encode()
        if status == 200 and path in DECODED_ANSWERS:
            self._decode_answer(path, json.loads(answer))
        return web.Response(status=status, body=answer, content_type=content_type)

    def _contract(self, method: str, path: str, body: Any) -> list[str]:
        if path == "/generate":
            try:
                ref.api_types().GenerateRequest.from_json_value(body)
                return []
            except ValueError as exc:
                return [f"/generate: {exc}"]
        return ref.check_control_body(self.version, method, path, body)

    def _session_rule(self, path: str) -> web.Response | None:
        """SGLang 0.5.21+'s answers to a weight update outside its session (weight_updater.py)."""
        if not self.sessions:
            return None
        if path in SESSION_UPDATES and not self.session_open:
            name = path.lstrip("/")
            return self._failed(f"{name} must run between begin_weight_update() and end_weight_update()")
        if path == "/begin_weight_update" and self.session_open:
            return self._failed("a weight-update session is already open; call end_weight_update() first")
        if path == "/end_weight_update" and not self.session_open:
            return self._failed("no weight-update session is open; call begin_weight_update() first")
        return None

    def _failed(self, message: str) -> web.Response:
        self.violations.append(message)
        return web.json_response({"success": False, "message": message}, status=400)

    def _refuse(self, *problems: str) -> web.Response:
        self.violations.extend(problems)
        return web.json_response({"object": "error", "message": "; ".join(problems), "type": "Bad Request",
                                  "param": None, "code": 400}, status=400)

    def _decode_answer(self, path: str, answer: Any) -> None:
        decode = getattr(ref.api_types(), DECODED_ANSWERS[path]).from_json_value
        try:
            for one in answer if isinstance(answer, list) else [answer]:
                decode(one)
        except ValueError as exc:
            self.violations.append(f"the answer to {path} breaks SGLang's contract: {exc}")

    async def _forward(self, method: str, path: str, body: Any, query: str = "") -> tuple[int, str, bytes]:
        url = self.backend + path + (f"?{query}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        async with self._session.request(method, url, data=data, headers={"Content-Type": "application/json"},
                                         timeout=aiohttp.ClientTimeout(total=600)) as answer:
            return answer.status, answer.content_type, await answer.read()
