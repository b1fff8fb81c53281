"""Reading a request's JSON body, and the error answer SGLang gives a refused request."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from .schema import BadRequest, BodyError, ContractError

__all__ = ["error_middleware", "read_json"]


async def read_json(request: web.Request) -> Any:
    """The parsed JSON body, or None when the body is empty.

    :raises BadRequest: the body is not JSON (the message names the endpoint and the position).
    """
    raw = await request.read()
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BodyError(f"{request.path}: the body is not valid JSON ({exc})") from None


@web.middleware
async def error_middleware(request: web.Request, handler):
    """A :class:`BadRequest` becomes HTTP 400 with the body SGLang 0.5.23 gives that kind of refusal."""
    try:
        return await handler(request)
    except ContractError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    except BodyError as exc:
        return web.json_response({"object": "error", "message": str(exc), "type": "Bad Request", "param": None,
                                  "code": 400}, status=400)
    except BadRequest as exc:
        return web.json_response({"error": {"message": str(exc)}}, status=400)
