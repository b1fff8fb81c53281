"""Control endpoints of ``furlong serve``: abort, pause/continue, cache, weight updates, memory.

Request bodies and answers follow SGLang 0.5.23 (``srt/entrypoints/http_server.py``,
``srt/managers/io_struct.py``): field names and defaults of ``AbortReq``,
``PauseGenerationReqInput``, ``ContinueGenerationReqInput``,
``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``DestroyWeightsUpdateGroupReqInput``, ``UpdateWeightFromDiskReqInput``,
``UpdateWeightsFromTensorReqInput``, ``Begin/EndWeightUpdateReqInput``,
``UpdateWeightVersionReqInput``, ``Release/ResumeMemoryOccupationReqInput``. Weight
calls answer ``{"success", "message"}`` (400 with ``success: false`` on failure).

The weight-update session is SGLang 0.5.21+'s rule
(``srt/managers/scheduler_components/weight_updater.py``): ``/update_weights_from_distributed``
and ``/update_weights_from_tensor`` are refused unless ``/begin_weight_update`` opened a
session; a second begin, or an end without a begin, is refused;
``/update_weights_from_disk`` needs none.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from .body import read_json
from .disk_weights import read_safetensors_dir
from .schema import BadRequest, BodyError, Field, check_bool, check_int, check_str, list_of, one_of, optional, check_body
from .state import ServeState, state_of
from .tensor_payload import read_named_tensors

__all__ = ["ROUTES"]

_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang/srt/constants.py
_SELECTOR = Field(one_of("target", "draft", "all"), "all")  # furlong serve has no draft model: all = target


async def _body(request: web.Request, fields: dict[str, Field]) -> dict:
    """The checked body; a problem is SGLang's 400 for a body its request type refuses."""
    try:
        return check_body(request.path, await read_json(request), fields)
    except BadRequest as exc:
        raise BodyError(str(exc)) from None


async def abort_request(request: web.Request) -> web.Response:
    """``{"rid": "", "abort_all": false}`` -> 200, empty. A rid also ends the requests whose
    id starts with it (a batch sent with one rid string), as SGLang's scheduler does."""
    body = await _body(request, {"rid": Field(check_str, ""), "abort_all": Field(check_bool, False)})
    state = state_of(request)
    if body["abort_all"]:
        await state.abort_all("Aborted by /abort_request (abort_all)")
    elif body["rid"]:
        rids = [rid for rid in state.running if rid.startswith(body["rid"])]
        if rids and not state.engine_takes_rid:
            raise BadRequest(f"/abort_request: --rollout-backend '{state.args.rollout_backend}' cannot abort one "
                             "request; send abort_all")
        state.mark_aborted(rids, "Aborted by /abort_request")
        for rid in rids:
            await state.engine.abort_request(rid)
    return web.Response(status=200)


async def pause_generation(request: web.Request) -> web.Response:
    """``{"mode": "abort"|"retract"|"in_place"}`` (default abort): abort ends running
    requests now (partial tokens); retract and in_place hold them until continue."""
    body = await _body(request, {"mode": Field(one_of("abort", "retract", "in_place"), "abort")})
    state = state_of(request)
    if body["mode"] == "abort":
        state.mark_aborted(list(state.running), "Aborted by /pause_generation")
    await state.engine.pause_generation(body["mode"])
    state.pause_mode = body["mode"]
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    """``{"torch_empty_cache": true}``: resume decoding (and empty the CUDA cache first)."""
    body = await _body(request, {"torch_empty_cache": Field(check_bool, True)})
    if body["torch_empty_cache"]:
        _empty_cuda_cache()
    state = state_of(request)
    await state.engine.continue_generation()
    state.pause_mode = None
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def flush_cache(request: web.Request) -> web.Response:
    """GET or POST, ``?timeout=S`` (default 0): 200 once no request runs (or they are paused
    in abort/retract mode), else 400 after waiting ``timeout`` seconds; plain-text answer."""
    try:
        timeout = float(request.query.get("timeout", 0))
    except ValueError:
        raise BodyError(f"/flush_cache: timeout={request.query['timeout']!r} is not a number") from None
    state = state_of(request)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.0, timeout)
    while state.running and state.pause_mode not in ("abort", "retract") and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.running and state.pause_mode not in ("abort", "retract"):
        return web.Response(status=400, text=f"Flush cache failed: {len(state.running)} requests are running.\n")
    await state.engine.flush_cache()
    return web.Response(status=200, text="Cache flushed.\n")


async def update_weight_version(request: web.Request) -> web.Response:
    """``{"new_version": str, "abort_all_requests": true}`` -> ``{success, message, new_version}``."""
    body = await _body(request, {"new_version": Field(check_str), "abort_all_requests": Field(check_bool, True)})
    if body["new_version"] is None:
        raise BodyError("/update_weight_version: 'new_version' is required")
    state = state_of(request)
    if body["abort_all_requests"]:
        await state.abort_all("Aborted by /update_weight_version")
    state.weight_version = body["new_version"]
    return web.json_response({"success": True, "message": f"Weight version updated to {body['new_version']}",
                              "new_version": body["new_version"]})


async def _weight_call(request: web.Request, action, message: str) -> web.Response:
    """Run a weight operation; engine errors answer 400 ``{"success": false, "message"}``."""
    try:
        extra = await action() or {}
    except Exception as exc:  # noqa: BLE001 - any failure is the answer's message, as SGLang's
        return web.json_response({"success": False, "message": f"{request.path}: {exc}", **_failure_extra(request)},
                                 status=400)
    return web.json_response({"success": True, "message": message, **extra})


def _failure_extra(request: web.Request) -> dict:
    return {"num_paused_requests": 0} if request.path == "/update_weights_from_disk" else {}


def _session_refusal(request: web.Request) -> web.Response | None:
    """SGLang 0.5.21+'s answer to a broadcast or tensor update outside a weight-update session."""
    if state_of(request).weight_session is not None:
        return None
    message = f"{request.path.lstrip('/')} must run between begin_weight_update() and end_weight_update()"
    return web.json_response({"success": False, "message": message}, status=400)


async def begin_weight_update(request: web.Request) -> web.Response:
    """``{"selector": "all"}``: open the weight-update session (400 when one is open)."""
    body = await _body(request, {"selector": _SELECTOR})
    state = state_of(request)
    if state.weight_session is not None:
        return web.json_response({"success": False, "message": "a weight-update session is already open; call "
                                  "end_weight_update() first"}, status=400)
    state.weight_session = body["selector"]
    return web.json_response({"success": True, "message": "Success"})


async def end_weight_update(request: web.Request) -> web.Response:
    """``{}``: close the session (400 when none is open)."""
    await _body(request, {})
    state = state_of(request)
    if state.weight_session is None:
        return web.json_response({"success": False, "message": "no weight-update session is open; call "
                                  "begin_weight_update() first"}, status=400)
    state.weight_session = None
    return web.json_response({"success": True, "message": "Success"})


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """``{"serialized_named_tensors": [base64 per TP rank], "load_format", "flush_cache", ...}``.

    This server is one rank: it reads the first payload (:mod:`.tensor_payload`), in the
    default load format only (``load_format`` null).
    """
    body = await _body(request, {
        "serialized_named_tensors": Field(list_of(check_str)), "load_format": Field(check_str, honoured=False),
        "flush_cache": Field(check_bool, True), "abort_all_requests": Field(check_bool, False),
        "weight_version": Field(optional(check_str)), "selector": _SELECTOR,
        "torch_empty_cache": Field(check_bool, False),
    })
    if not body["serialized_named_tensors"]:
        raise BodyError("/update_weights_from_tensor: 'serialized_named_tensors' is required: one payload per TP rank")
    engine = state_of(request).engine
    return await _update_in_session(request, body, lambda: engine.load_weights(
        read_named_tensors(body["serialized_named_tensors"][0])), "Success")


async def _update_in_session(request: web.Request, body: dict, load, message: str) -> web.Response:
    """A broadcast or tensor update: refused outside a weight-update session; ``load()`` brings the weights in."""
    refusal = _session_refusal(request)
    if refusal is not None:
        return refusal
    state = state_of(request)

    async def action():
        if body["abort_all_requests"]:
            await state.abort_all(f"Aborted by {request.path}")
        await load()
        await _after_update(state, body)

    return await _weight_call(request, action, message)


async def init_weights_update_group(request: web.Request) -> web.Response:
    body = await _body(request, {
        "master_address": Field(check_str), "master_port": Field(check_int), "rank_offset": Field(check_int),
        "world_size": Field(check_int), "group_name": Field(check_str, "weight_update_group"),
        "backend": Field(check_str, "nccl"),
    })
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if body[k] is None]
    if missing:
        raise BodyError(f"/init_weights_update_group: missing {', '.join(missing)}")
    return await _weight_call(request, lambda: state_of(request).engine.init_weights_update_group(**body),
                              "Succeeded to initialize custom process group.")


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await _body(request, {"group_name": Field(check_str, "weight_update_group")})
    engine = state_of(request).engine
    return await _weight_call(request, lambda: engine.destroy_weights_update_group(body["group_name"]),
                              "Succeeded to destroy custom process group.")


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """One bucket: the tensors follow by broadcast from rank 0 of ``group_name``."""
    body = await _body(request, {
        "names": Field(list_of(check_str)), "dtypes": Field(list_of(check_str)),
        "shapes": Field(list_of(list_of(check_int))), "group_name": Field(check_str, "weight_update_group"),
        "flush_cache": Field(check_bool, True), "abort_all_requests": Field(check_bool, False),
        "weight_version": Field(optional(check_str)), "load_format": Field(check_str, honoured=False),
        "selector": _SELECTOR, "torch_empty_cache": Field(check_bool, False),
    })
    lengths = {len(body[k] or []) for k in ("names", "dtypes", "shapes")}
    if body["names"] is None or len(lengths) != 1:
        raise BodyError("/update_weights_from_distributed: 'names', 'dtypes' and 'shapes' are required, "
                        "one entry per tensor")
    engine = state_of(request).engine
    return await _update_in_session(request, body, lambda: engine.update_weights_from_distributed(
        body["names"], body["dtypes"], body["shapes"], body["group_name"]), "Succeeded to update parameter online.")


async def update_weights_from_disk(request: web.Request) -> web.Response:
    """``{"model_path", "weight_version", "abort_all_requests", "flush_cache", "keep_pause", ...}``.

    Reads ``model_path/*.safetensors`` (Hugging Face names), with running requests paused
    in place for the whole load, so no request decodes with half-updated weights.
    Answers ``{success, message, num_paused_requests}``.
    """
    body = await _body(request, {
        "model_path": Field(check_str), "load_format": Field(check_str, honoured=False),
        "abort_all_requests": Field(check_bool, False), "weight_version": Field(optional(check_str)),
        "is_async": Field(check_bool, honoured=False), "torch_empty_cache": Field(check_bool, False),
        "keep_pause": Field(check_bool, False), "recapture_cuda_graph": Field(check_bool, honoured=False),
        "token_step": Field(check_int, 0), "flush_cache": Field(check_bool, True),
        "manifest": Field(check_str, honoured=False),
    })
    if body["model_path"] is None:
        raise BodyError("/update_weights_from_disk: 'model_path' is required")
    state = state_of(request)

    async def action():
        if body["abort_all_requests"]:
            await state.abort_all("Aborted by /update_weights_from_disk")
        paused = len(state.running)
        own_pause = state.pause_mode is None  # a pause the client made stays until its continue
        if own_pause:
            await state.engine.pause_generation("in_place")
        try:
            for bucket in read_safetensors_dir(body["model_path"]):
                await state.engine.load_weights(bucket)
            await _after_update(state, body)
        finally:
            if own_pause and not body["keep_pause"]:
                await state.engine.continue_generation()
        if own_pause and body["keep_pause"]:
            state.pause_mode = "in_place"
        return {"num_paused_requests": paused}

    return await _weight_call(request, action, "Succeeded to update model weights.")


async def _after_update(state: ServeState, body: dict) -> None:
    if body["flush_cache"]:
        await state.engine.flush_cache()
    if body["torch_empty_cache"]:
        _empty_cuda_cache()
    if body["weight_version"] is not None:
        state.weight_version = body["weight_version"]


async def release_memory_occupation(request: web.Request) -> web.Response:
    """``{"tags": [...] | null}``: the weights leave the accelerator when ``tags`` is null or
    names ``weights`` (the engine keeps no KV cache or CUDA graphs between requests)."""
    body = await _body(request, {"tags": Field(optional(list_of(one_of(*_MEMORY_TAGS))))})
    if body["tags"] is None or "weights" in body["tags"]:
        await state_of(request).engine.release_memory()
    return web.json_response(None)


async def resume_memory_occupation(request: web.Request) -> web.Response:
    body = await _body(request, {"tags": Field(optional(list_of(one_of(*_MEMORY_TAGS))))})
    if body["tags"] is None or "weights" in body["tags"]:
        await state_of(request).engine.resume_memory()
    return web.json_response(None)


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


ROUTES = [
    ("POST", "/abort_request", abort_request),
    ("POST", "/pause_generation", pause_generation),
    ("POST", "/continue_generation", continue_generation),
    ("GET", "/flush_cache", flush_cache),
    ("POST", "/flush_cache", flush_cache),
    ("POST", "/update_weight_version", update_weight_version),
    ("POST", "/init_weights_update_group", init_weights_update_group),
    ("POST", "/destroy_weights_update_group", destroy_weights_update_group),
    ("POST", "/update_weights_from_distributed", update_weights_from_distributed),
    ("POST", "/update_weights_from_disk", update_weights_from_disk),
    ("POST", "/update_weights_from_tensor", update_weights_from_tensor),
    ("POST", "/begin_weight_update", begin_weight_update),
    ("POST", "/end_weight_update", end_weight_update),
    ("GET", "/release_memory_occupation", release_memory_occupation),
    ("POST", "/release_memory_occupation", release_memory_occupation),
    ("GET", "/resume_memory_occupation", resume_memory_occupation),
    ("POST", "/resume_memory_occupation", resume_memory_occupation),
]
