"""The ``sglang`` rollout engine: a client of one SGLang server (or ``furlong serve``) and of the router.

Generation goes through the router (``POST {router}/generate``), which picks a server and
fails over when one dies; control calls and the weight-update phases go to this engine's
own server. The engine either started its server (a process it owns, restarted when it
dies) or attached to one someone else started (``--rollout-external``). Once the server
serves, the engine reads its SGLang version and speaks that version's API
(:mod:`.protocol`): a weight-update session on 0.5.21 and later, none before.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from furlong.hooks import GenerateOutput, PluginError, RunConfig
from furlong.kit.fp8_io import fp8_module_names, quantize_bucket
from furlong.kit.moe import RoutingLayout, decode_routed_experts

from .buckets import save_bucket, serialize_cuda_bucket
from .http import HttpError, release_http, shared_http
from .launch import ManagedProcess, ServerPlace, server_command, server_env
from .protocol import ServerProtocol, protocol_for
from .router import deregister, register
from .weight_files import new_weights_dir, remove_weights_dir

__all__ = ["SGLangEngine"]

log = logging.getLogger("furlong.engines.sglang")

START_TIMEOUT_S = 1800.0  # a large model can take many minutes to load
POLL_S = 1.0
# SGLang's /health runs a one-token generation and gives it SGLANG_HEALTH_CHECK_TIMEOUT (20 s) before answering 503
HEALTH_TIMEOUT_S = 30.0
FINISH_TYPES = ("stop", "length", "abort")


class SGLangEngine:
    """:class:`furlong.hooks.RolloutEngine` over HTTP (see the module doc).

    :param place: where to start the server, or None for an external one at ``url``.
    :param url: ``http://host:port`` of this engine's server.
    :param router_url: ``http://host:port`` of the router every request goes through.
    :param register_with_router: add the server to the router (and remove it at the end).
    :param routing: the model's :class:`~furlong.kit.moe.RoutingLayout` when each request asks for its
        routed experts (``--use-rollout-routing-replay``), else None.
    """

    context_len = None  # the server enforces its own context length

    def __init__(self, config: RunConfig, index: int, url: str, router_url: str, place: ServerPlace | None,
                 register_with_router: bool, tokenizer: Any, routing: RoutingLayout | None = None) -> None:
        self.config, self.index, self.url, self.router_url, self.place = config, index, url, router_url, place
        self.register_with_router = register_with_router
        self.tokenizer = tokenizer
        self.routing = routing
        self.weight_update_ranks = int(config.rollout_num_gpus_per_engine or 1)
        self.protocol: ServerProtocol | None = None  # read from the server once it serves
        self.paused = False  # between pause_generation and continue_generation
        api_key = (config.sglang_passthrough or {}).get("api_key")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.on_restart = None  # set by the core: gives a replaced server the current weights
        own = config.plugin_config("sglang")
        self.restarts_left = int(own.sglang_server_restarts)
        self.process: ManagedProcess | None = None
        self.http = None
        self._in_flight: set[asyncio.Future] = set()
        self._weights_dir: str | None = None
        self._recovering: asyncio.Future | None = None
        self._policy_key = config.sglang_router_policy in ("consistent_hashing", "manual")
        concurrency = int(config.sglang_server_concurrency or 512)
        engines_here = int(own.sglang_engines_per_process or 1)
        self._generation_limit = concurrency * engines_here
        self._generate_timeout = float(config.sglang_router_request_timeout_secs or 14400)
        self._control_timeout = 60.0 * float(config.distributed_timeout_minutes or 10)
        # an FP8 --hf-checkpoint: the modules whose synced weights are sent as e4m3 blocks and scales
        self._fp8_modules = fp8_module_names(config.hf_checkpoint)

    @property
    def who(self) -> str:
        return f"sglang engine {self.index} ({self.url})"

    # --- start, stop, health ------------------------------------------------------------

    async def start(self) -> None:
        """Start (or attach to) the server, wait until it serves, and register it with the router.

        :raises PluginError: the server exited, did not become ready within
            ``START_TIMEOUT_S``, or the router did not take it.
        """
        self.http = shared_http(self._generation_limit)
        if self.place is not None:
            self.process = ManagedProcess(f"sglang server {self.index}", server_command(self.config, self.place),
                                          env=server_env(self.config))
        await self._wait_ready()
        await self._read_protocol()
        if self.register_with_router:
            await register(self.http, self.router_url, self.url, alive=self._dead_reason)

    async def _wait_ready(self) -> None:
        """Poll ``GET /health_generate`` until 200, then ``GET /flush_cache`` until 200.

        An external server may be busy with someone else's requests (``/flush_cache`` would
        answer 400): only its health is asked.
        """
        deadline = time.monotonic() + START_TIMEOUT_S
        for path in ("/health_generate", "/flush_cache") if self.process is not None else ("/health_generate",):
            while True:
                reason = self._dead_reason()
                if reason:
                    raise PluginError(f"{self.who}: the server did not start: {reason}")
                try:
                    await self.http.call("GET", self.url + path, timeout_s=30, retries=0, headers=self._headers)
                    break
                except HttpError as exc:
                    if time.monotonic() > deadline:
                        raise PluginError(f"{self.who}: not ready after {START_TIMEOUT_S:g} s ({exc})") from exc
                await asyncio.sleep(POLL_S)

    async def _read_protocol(self) -> None:
        """Read the server's SGLang version (``/server_info``; ``/get_server_info`` before 0.5.6).

        :raises PluginError: the server is older than furlong supports, or reports no version.
        """
        try:
            info = await self._call("GET", "/server_info", retries=5, timeout_s=30)
        except HttpError as exc:
            if exc.status != 404:
                raise
            info = await self._call("GET", "/get_server_info", retries=5, timeout_s=30)
        reported = info.get("version") if isinstance(info, dict) else None
        self.protocol = protocol_for(reported, self.who)
        log.info("%s: SGLang %s%s", self.who, self.protocol.version,
                 " (weight updates in sessions)" if self.protocol.weight_session else "")
        if info.get("enable_deterministic_inference") is False and self.index == 0:
            log.warning("%s: SGLang uses each request's sampling_seed only when the server runs with "
                        "--enable-deterministic-inference (furlong passes --sglang-enable-deterministic-inference "
                        "on); without it --seed does not make samples repeatable.", self.who)

    def _dead_reason(self) -> str | None:
        return self.process.exited() if self.process is not None else None

    async def health(self) -> bool:
        """Whether the server serves; a dead server is taken off the router at once.

        ``GET /health`` runs a one-token generation on SGLang, which waits while generation
        is paused and, after 20 s, marks the server unhealthy. So while this engine has
        paused its server (a weight sync), only liveness is asked: ``GET /model_info``.
        """
        if self._dead_reason() is None:
            path = "/model_info" if self.paused else "/health"
            try:
                await self.http.call("GET", self.url + path, timeout_s=HEALTH_TIMEOUT_S, retries=0,
                                     headers=self._headers)
                return True
            except HttpError:
                pass
        await self._leave_router()
        return False

    async def _leave_router(self) -> None:
        """Take the server off the router, if this engine put it there (best effort)."""
        if self.register_with_router:
            try:
                await deregister(self.http, self.router_url, self.url)
            except PluginError as exc:
                log.debug("%s: could not remove it from the router: %s", self.who, exc)

    async def recover(self) -> None:
        """Restart a server this engine started that died (at most ``--sglang-server-restarts`` times per engine).

        The new server registers with the router, then gets the current weights through
        ``on_restart`` before this returns.

        :raises PluginError: the server is external, no restarts are left, or the new one
            did not start.
        """
        if self._recovering is not None:
            await asyncio.shield(self._recovering)
            return
        if await self.health():
            return
        if self.place is None:
            raise PluginError(f"{self.who}: the external server does not answer; furlong cannot restart it.")
        if self.restarts_left <= 0:
            raise PluginError(f"{self.who}: the server died and no restarts are left (--sglang-server-restarts).")
        self.restarts_left -= 1
        self._recovering = asyncio.get_running_loop().create_future()
        self._recovering.add_done_callback(lambda f: f.cancelled() or f.exception())
        log.warning("%s: the server died (%s); starting it again (%d restart(s) left)", self.who,
                    (self._dead_reason() or "no answer").splitlines()[0], self.restarts_left)
        try:
            if self.process is not None:
                await asyncio.to_thread(self.process.kill)
            self.process = ManagedProcess(f"sglang server {self.index}", server_command(self.config, self.place),
                                          env=server_env(self.config))
            self.paused = False
            await self._wait_ready()
            await self._read_protocol()
            if self.register_with_router:
                await register(self.http, self.router_url, self.url, alive=self._dead_reason)
            if self.on_restart is not None:
                await self.on_restart(self)
            self._recovering.set_result(None)
        except BaseException as exc:
            self._recovering.set_exception(exc)
            raise
        finally:
            self._recovering = None

    async def shutdown(self) -> None:
        """Take the server off the router, stop it if this engine started it, close the client."""
        if self.http is None:
            return
        await self._leave_router()
        if self.process is not None:
            await asyncio.to_thread(self.process.kill)
            self.process = None
        if self._weights_dir:
            remove_weights_dir(self._weights_dir)
            self._weights_dir = None
        await release_http()
        self.http = None

    # --- generation ---------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling_params: dict) -> GenerateOutput:
        """One ``POST {router}/generate`` (SGLang's native API) with ``return_logprob``.

        :param input_ids: prompt token ids.
        :param sampling_params: SGLang's names (the server rejects others with 400).
        :returns: ids and sampling log-probs of the generated tokens (from
            ``meta_info.output_token_logprobs``, ``[logprob, token_id, text]`` each), the finish
            reason's type and the weight version: ``meta_info.weight_version``, or, for a
            response that straddles a weight update (``meta_info.weight_versions``, SGLang
            0.5.20+), the version of its first span, the oldest; the spans themselves in
            ``weight_version_spans``. With ``routing``, the request sets ``return_routed_experts`` and
            ``meta_info.routed_experts`` becomes ``routed_experts`` (int32 ``[prompt + output - 1,
            MoE layers, topk]``).
        :raises PluginError: the router failed after retries, or the answer lacks those fields (a
            finished request's ``routed_experts`` too, when asked).
        """
        body = {"input_ids": [int(t) for t in input_ids], "sampling_params": dict(sampling_params),
                "return_logprob": True}
        if self.routing is not None:
            body["return_routed_experts"] = True
        headers = dict(self._headers or {})
        if self._policy_key:
            headers["X-SMG-Routing-Key"] = uuid.uuid4().hex
        request = asyncio.ensure_future(self.http.call("POST", self.router_url + "/generate", body, generation=True,
                                                       timeout_s=self._generate_timeout, headers=headers or None))
        self._in_flight.add(request)
        try:
            answer = await request  # a cancelled caller cancels the request too
        finally:
            self._in_flight.discard(request)
        return self._output(answer, len(input_ids))

    def _output(self, answer: Any, prompt_len: int = 0) -> GenerateOutput:
        try:
            meta = answer["meta_info"]
            pairs = meta.get("output_token_logprobs") or []
            ids = [int(e[1]) for e in pairs]
            log_probs = [float(e[0]) for e in pairs]
            reason = meta.get("finish_reason")
            kind = reason.get("type") if isinstance(reason, dict) else reason
            output_ids = answer.get("output_ids")
            if output_ids is not None and [int(t) for t in output_ids] != ids:
                raise ValueError(f"output_ids ({len(output_ids)}) and output_token_logprobs ({len(ids)}) disagree")
            if kind not in FINISH_TYPES:
                raise ValueError(f"finish_reason {reason!r} is none of {FINISH_TYPES}")
            spans = [(str(s["version"]), int(s["start"]), int(s["end"])) for s in meta.get("weight_versions") or []]
            version = spans[0][0] if spans else str(meta.get("weight_version", "0"))
            routed = self._routed(meta, prompt_len + len(ids) - 1, kind)
            return GenerateOutput(output_ids=ids, output_log_probs=log_probs, finish_reason=kind,
                                  weight_version=version, text=answer.get("text"), weight_version_spans=spans,
                                  routed_experts=routed)
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as exc:
            raise PluginError(f"sglang engine: the router at {self.router_url} answered /generate with "
                              f"something that is not SGLang's response ({exc}): {str(answer)[:300]}") from exc

    def _routed(self, meta: dict, rows: int, kind: str):
        """``meta_info.routed_experts`` decoded, when asked; an aborted request that never ran has none.

        :raises ValueError: a finished request without it, or with another shape.
        """
        if self.routing is None:
            return None
        text = meta.get("routed_experts")
        if text is None:
            if kind == "abort":
                return None
            raise ValueError("no meta_info.routed_experts although the request set return_routed_experts: the "
                             "server must run with --enable-return-routed-experts (furlong passes it to the servers "
                             "it starts under --use-rollout-routing-replay)")
        return decode_routed_experts(text, rows, self.routing)

    async def abort(self) -> None:
        """``POST /abort_request {"abort_all": true}`` to this engine's server, then wait (at most a minute)
        for the requests this engine sent to come back (aborted ones keep their partial tokens)."""
        pending = list(self._in_flight)
        await self._call("POST", "/abort_request", {"abort_all": True})
        if pending:
            await asyncio.wait(pending, timeout=60)

    # --- weight updates, in SGLang's phases ---------------------------------------------

    async def pause_generation(self, mode: str = "retract") -> None:
        self.paused = True
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._call("POST", "/continue_generation", {})
        self.paused = False

    async def begin_weight_update(self) -> None:
        """Open the weight-update session SGLang 0.5.21+ requires around broadcast and tensor updates
        (``POST /begin_weight_update``); nothing on earlier versions, which have no session."""
        if self.protocol is not None and self.protocol.weight_session:
            await self._checked("/begin_weight_update", {"selector": "all"}, idempotent=False)

    async def end_weight_update(self) -> None:
        """Close the session :meth:`begin_weight_update` opened (``POST /end_weight_update``)."""
        if self.protocol is not None and self.protocol.weight_session:
            await self._checked("/end_weight_update", {}, idempotent=False)

    async def flush_cache(self) -> None:
        """``POST /flush_cache``; SGLang answers 400 while requests are queued, so it is retried."""
        for attempt in range(60):
            try:
                await self._call("POST", "/flush_cache", retries=5)
                return
            except HttpError as exc:
                if exc.status != 400 or attempt == 59:
                    raise
            await asyncio.sleep(POLL_S)

    async def set_weight_version(self, version: int) -> None:
        await self._checked("/update_weight_version", {"new_version": str(int(version)), "abort_all_requests": False})

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str = "nccl") -> None:
        await self._checked("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}, idempotent=False)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str) -> None:
        if self._fp8_modules:
            raise PluginError(f"{self.who}: a broadcast weight sync into an FP8 --hf-checkpoint "
                              f"({self.config.hf_checkpoint}) is not supported yet: the trainer broadcasts BF16 "
                              "tensors, which SGLang's FP8 layers would copy unscaled. Run the trainer in the "
                              "driver's process (--executor local), whose syncs are quantised before they are sent.")
        await self._checked("/update_weights_from_distributed", {
            "names": list(names), "dtypes": list(dtypes), "shapes": [list(map(int, s)) for s in shapes],
            "group_name": group_name, "flush_cache": False}, idempotent=False)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._checked("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_disk(self, path: str) -> None:
        """Load the Hugging Face model directory ``path`` (an eval snapshot, on a file system the server reads)
        through SGLang's ``/update_weights_from_disk``, dropping the prefix cache of the old weights."""
        await self._checked("/update_weights_from_disk", {"model_path": path, "flush_cache": True}, idempotent=False)

    async def load_weights(self, named_tensors: list[tuple[str, Any]]) -> None:
        """One bucket from the trainer in this process (the ``local`` executor).

        CUDA tensors go by ``/update_weights_from_tensor`` (CUDA IPC handles serialized once
        per TP rank, as SGLang's own client does: each rank opens its own copy, and a copy
        shared by several ranks would upset the sender's IPC reference counts); CPU tensors
        are written to a safetensors file loaded by ``/update_weights_from_disk``. With an FP8
        ``--hf-checkpoint`` each quantised layer's weight is sent as e4m3 blocks and
        ``weight_scale_inv`` (:func:`furlong.kit.fp8_io.quantize_bucket`: the quantiser's rounding).
        """
        if self._fp8_modules:
            named_tensors = quantize_bucket(named_tensors, self._fp8_modules)
        if named_tensors and getattr(named_tensors[0][1], "is_cuda", False):
            payloads = [await asyncio.to_thread(serialize_cuda_bucket, named_tensors)
                        for _ in range(self.weight_update_ranks)]
            await self._checked("/update_weights_from_tensor", {
                "serialized_named_tensors": payloads, "flush_cache": False}, idempotent=False)
            return
        if self._weights_dir is None:
            self._weights_dir = new_weights_dir(self.index)
        await asyncio.to_thread(save_bucket, named_tensors, self._weights_dir)
        # keep_pause: the server must stay paused until the core's continue_generation
        await self._checked("/update_weights_from_disk", {"model_path": self._weights_dir, "flush_cache": False,
                                                          "keep_pause": True})

    async def release_memory(self) -> None:
        """Flush the cache (SGLang needs it empty), then ``/release_memory_occupation`` of every tag."""
        await self.flush_cache()
        await self._call("POST", "/release_memory_occupation", {"tags": None})

    async def resume_memory(self) -> None:
        await self._call("POST", "/resume_memory_occupation", {"tags": None})

    # --- plumbing -----------------------------------------------------------------------

    async def _call(self, method: str, path: str, body: Any = None, retries: int = 60,
                    timeout_s: float | None = None, idempotent: bool = True) -> Any:
        try:
            return await self.http.call(method, self.url + path, body, retries=retries, headers=self._headers,
                                        timeout_s=timeout_s or self._control_timeout, give_up=self._dead_reason,
                                        idempotent=idempotent)
        except HttpError as exc:
            raise HttpError(f"{self.who}: {exc}", exc.status, exc.answer) from exc

    async def _checked(self, path: str, body: dict, idempotent: bool = True) -> Any:
        """A call whose answer is ``{"success": bool, "message": str}``: ``success: false`` (SGLang
        answers it with 400) is one error naming this engine and the server's message."""
        try:
            answer = await self._call("POST", path, body, idempotent=idempotent)
        except HttpError as exc:
            if not (isinstance(exc.answer, dict) and exc.answer.get("success") is False):
                raise
            answer = exc.answer
        if isinstance(answer, dict) and answer.get("success") is False:
            version = f"SGLang {self.protocol.version}" if self.protocol is not None else "the server"
            raise HttpError(f"{self.who}: {version} refused POST {path}: {answer.get('message', '')}", 400, answer)
        return answer
