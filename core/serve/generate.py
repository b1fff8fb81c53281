"""``POST /generate`` (whole responses, batches, SSE streams) and ``GET /health_generate``.

Shapes from SGLang 0.5.23 ``srt/entrypoints/http_server.py``: a single request answers one
object, a batch a list; ``"stream": true`` answers ``text/event-stream`` with one
``data: {...}\\n\\n`` event per chunk and a final ``data: [DONE]\\n\\n``; by default each
chunk carries the whole output so far (``--incremental-streaming-output``: only the new
part); in a streamed batch every chunk has ``index``, its prompt's position (SGLang's
``_stream_batch_responses``); an error during a stream is one ``data: {"error": {...}}``
event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from aiohttp import web

from .body import read_json
from .responses import generate_body
from .schema import BadRequest, ContractError, GenerateItem, parse_generate
from .state import ServeState, state_of

__all__ = ["generate_route", "health_generate_route"]

HEALTH_TIMEOUT_S = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))  # SGLang's variable and default


async def generate_route(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    raw = await read_json(request)
    try:
        items, batch, top = parse_generate(raw)
    except BadRequest as exc:
        raise ContractError(str(exc)) from None
    started = time.monotonic()

    def body(item: GenerateItem, progress, start: int = 0) -> dict:
        return generate_body(state.tokenizer, item, progress, weight_version=state.weight_version,
                             latency_s=time.monotonic() - started, text_in_logprobs=top["return_text_in_logprobs"],
                             start=start, routing=state.routing)

    if top["stream"]:
        return await _stream(request, state, items, body, batch)
    tasks = [asyncio.ensure_future(state.generate(item)) for item in items]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # a refused item (or a client gone) ends the others too
    out = [body(item, progress) for item, progress in zip(items, results)]
    return web.json_response(out if batch else out[0])


async def _stream(request: web.Request, state: ServeState, items: list[GenerateItem], body,
                  batch: bool) -> web.StreamResponse:
    """Stream every item's chunks as they come; in a batch each chunk names its prompt by ``index``."""
    wake = asyncio.Event()
    tasks = [asyncio.ensure_future(state.generate(item, on_progress=wake.set)) for item in items]
    for task in tasks:
        task.add_done_callback(lambda _: wake.set())
    try:
        await asyncio.sleep(0)  # let the requests reach the engine: a refusal is still a plain 400
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        incremental = state.args.incremental_streaming_output
        sent = [0] * len(items)
        open_items = set(range(len(items)))
        while open_items:
            await wake.wait()
            wake.clear()
            for i in sorted(open_items):
                chunk = _next_chunk(state, items[i], tasks[i], body, sent, i, incremental)
                if chunk is None:
                    continue
                if tasks[i].done():
                    open_items.discard(i)
                if batch:
                    chunk["index"] = i
                await response.write(_event(chunk))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()  # the client went away: the engine drops the request


def _next_chunk(state: ServeState, item: GenerateItem, task: asyncio.Future, body, sent: list[int], i: int,
                incremental: bool) -> dict | None:
    """Item ``i``'s next chunk: its final one once ``task`` is done, else one once enough new tokens came."""
    start = sent[i] if incremental else 0
    if task.done():
        try:
            return body(item, task.result(), start=start)
        except Exception as exc:  # noqa: BLE001 - the headers are sent: the error becomes an event
            code = 400 if isinstance(exc, BadRequest) else 500
            return {"error": {"message": str(exc) or type(exc).__name__, "type": "invalid_request_error"
                              if code == 400 else "server_error", "code": code, "retryable": False}}
    progress = state.running.get(item.rid)
    interval = max(1, int(item.output_params.get("stream_interval") or 1))
    if progress is None or len(progress.output_ids) - sent[i] < interval:
        return None
    chunk = body(item, progress, start=start)
    sent[i] = len(progress.output_ids)
    return chunk


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def health_generate_route(request: web.Request) -> web.Response:
    """200 once the engine produces a token (a one-token probe, or any running request's), 503 otherwise.

    503 at once while the server shuts down; otherwise within ``SGLANG_HEALTH_CHECK_TIMEOUT``
    seconds (20). A paused engine produces nothing, so it reports 503, as SGLang does.
    """
    state = state_of(request)
    if state.exiting:
        return web.Response(status=503)
    tic = time.monotonic()
    probe = GenerateItem(rid=f"HEALTH_CHECK_{int(tic * 1e6)}", sampling_params={"max_new_tokens": 1, "temperature": 0},
                         output_params={}, return_logprob=False, input_ids=[0])
    task = asyncio.ensure_future(state.generate(probe))
    try:
        while time.monotonic() < tic + HEALTH_TIMEOUT_S:
            done, _ = await asyncio.wait([task], timeout=0.1)
            if done and task.exception() is None or state.last_token_at > tic:
                return web.Response(status=200)
            if done:
                return web.Response(status=503)
        return web.Response(status=503)
    finally:
        task.cancel()
