"""Read-only endpoints: ``/health``, ``/server_info``, ``/model_info``, ``/v1/models``.

Keys follow SGLang 0.5.23 ``srt/entrypoints/http_server.py``: ``/model_info`` (and the
deprecated ``/get_model_info``) has ``model_path``, ``served_model_name``,
``tokenizer_path``, ``is_generation``, ``preferred_sampling_params``,
``weight_version``, ``load_format``, ``reasoning_parser``, ``tool_call_parser``,
``disaggregation_mode``, ``has_image_understanding``, ``has_audio_understanding``,
``model_type``, ``architectures``; ``/server_info`` (and ``/get_server_info``) has the
server's arguments under SGLang's names (``model_path``, ``tp_size``, ``dp_size``, ...)
plus ``max_total_num_tokens``, ``startup_time``, ``internal_states``, ``version`` (the
SGLang version whose HTTP API furlong serve follows, :data:`SGLANG_API_VERSION`, so that
clients pick that version's rules; furlong's own is ``furlong_version``) and
``enable_deterministic_inference`` (true: every request's ``sampling_seed`` is honoured);
``/v1/models`` is OpenAI's model list with ``owned_by: "sglang"`` (sglang-router and
smg read it to pick the SGLang protocol). SGLang 0.5.23 has no ``/get_weight_version``:
clients read ``weight_version`` from ``/model_info``, and so does furlong serve.
``/health`` runs the same one-token probe as ``/health_generate``, as SGLang's does
unless ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``; so a paused server answers 503
after ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds, as SGLang's.
"""

from __future__ import annotations

import importlib.metadata as md

import os

from aiohttp import web

from .generate import health_generate_route
from .state import state_of

__all__ = ["ROUTES", "SGLANG_API_VERSION"]

SGLANG_API_VERSION = "0.5.23"


async def health(request: web.Request) -> web.Response:
    """The generation probe of ``/health_generate``; with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false,
    200 while serving and 503 once shutting down."""
    if os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() in ("0", "false", "no", "off"):
        return web.Response(status=503 if state_of(request).exiting else 200)
    return await health_generate_route(request)


async def model_info(request: web.Request) -> web.Response:
    state = state_of(request)
    args = state.args
    model_config = getattr(getattr(state.engine, "model", None), "config", None)
    return web.json_response({
        "model_path": args.hf_checkpoint,
        "served_model_name": args.served_model_name,
        "tokenizer_path": args.hf_checkpoint,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.weight_version,
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(model_config, "model_type", None),
        "architectures": getattr(model_config, "architectures", None),
    })


async def server_info(request: web.Request) -> web.Response:
    state = state_of(request)
    args = state.args
    context = state.context_length
    return web.json_response({
        "model_path": args.hf_checkpoint,
        "tokenizer_path": args.hf_checkpoint,
        "served_model_name": args.served_model_name,
        "host": args.host,
        "port": args.port,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "ep_size": 1,
        "random_seed": args.seed,
        "context_length": context,
        "max_running_requests": getattr(state.engine, "max_batch_size", None),
        "skip_tokenizer_init": False,
        "incremental_streaming_output": args.incremental_streaming_output,
        "weight_version": state.weight_version,
        "max_total_num_tokens": None,
        "startup_time": state.started_at,
        "internal_states": [{"paused": state.pause_mode, "running_requests": len(state.running)}],
        "enable_deterministic_inference": True,
        "enable_return_routed_experts": state.routing is not None,
        "version": SGLANG_API_VERSION,
        "furlong_version": md.version("furlong"),
        "frontend": "furlong",
        "rollout_backend": args.rollout_backend,
    })


async def models(request: web.Request) -> web.Response:
    state = state_of(request)
    name = state.args.served_model_name
    return web.json_response({"object": "list", "data": [{
        "id": name, "object": "model", "created": int(state.started_at), "owned_by": "sglang", "root": name,
        "parent": None, "max_model_len": state.context_length,
    }]})


ROUTES = [
    ("GET", "/health", health),
    ("GET", "/model_info", model_info),
    ("GET", "/get_model_info", model_info),
    ("GET", "/server_info", server_info),
    ("GET", "/get_server_info", server_info),
    ("GET", "/v1/models", models),
]
