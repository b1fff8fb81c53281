"""What ``furlong serve`` knows between requests: the engine, the weight version, the requests running."""

from __future__ import annotations

import inspect
import time
from argparse import Namespace
from typing import Any, Callable

from aiohttp import web

from furlong.hooks import PluginError

from .responses import Progress
from .schema import BadRequest, GenerateItem

__all__ = ["STATE_KEY", "ServeState", "state_of"]


class ServeState:
    """The served engine and the server's own bookkeeping.

    ``weight_version``: a string, as SGLang reports it (``--weight-version`` until an
    update sets one). ``running``: rid -> the request's progress, for ``/abort_request``
    and ``/flush_cache``. ``pause_mode``: the mode of the pause in force, or None.
    ``last_token_at``: monotonic time of the last decoded token (``/health_generate``
    counts a busy engine as healthy, as SGLang does). ``weight_session``: the selector of
    the open weight-update session (``/begin_weight_update``), or None. ``routing``: the
    engine's :class:`~furlong.kit.moe.RoutingLayout` when it records routing
    (``--enable-return-routed-experts``), else None.
    """

    def __init__(self, engine: Any, args: Namespace) -> None:
        self.engine = engine
        self.args = args
        self.tokenizer = engine.tokenizer
        self.weight_version = str(args.weight_version)
        self.running: dict[str, Progress] = {}
        self.pause_mode: str | None = None
        self.weight_session: str | None = None
        self.exiting = False
        self.last_token_at = 0.0
        self.started_at = time.time()
        model_config = getattr(getattr(engine, "model", None), "config", None)
        self.vocab_size = int(getattr(model_config, "vocab_size", 0) or len(self.tokenizer))
        self.context_length = engine.context_len or getattr(model_config, "max_position_embeddings", None)
        names = inspect.signature(engine.generate).parameters
        self.engine_streams = "on_token" in names  # incremental output
        self.engine_takes_rid = "rid" in names and callable(getattr(engine, "abort_request", None))
        self.routing = getattr(engine, "routing", None) if getattr(engine, "records_routing", False) else None

    async def generate(self, item: GenerateItem, on_progress: Callable[[], None] | None = None) -> Progress:
        """Run one request on the engine; ``on_progress`` after each new token (when the engine streams).

        :raises BadRequest: the engine refused the request (a sampling value out of range,
            a prompt longer than the context, a request id in use); the message is the engine's;
            routed experts asked of a server that does not record them, or from a start
            beyond the prompt.
        """
        if item.input_ids is None:
            item.input_ids = list(self.tokenizer.encode(item.text))
        bad = [t for t in item.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"/generate: token id {bad[0]} of request {item.rid!r} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        self._check_context(item)
        self._check_routing(item)
        if item.rid in self.running:
            raise BadRequest(f"/generate: request id {item.rid!r} is already running")
        progress = Progress()
        if item.return_logprob:
            progress.input_log_probs = await self._input_log_probs(item)
        self.running[item.rid] = progress
        kwargs = {}
        if self.engine_takes_rid:
            kwargs["rid"] = item.rid
        if self.engine_streams:
            def on_token(token: int, log_prob: float) -> None:
                if not progress.versions or progress.versions[-1][0] != self.weight_version:
                    progress.versions.append((self.weight_version, len(progress.output_ids)))
                progress.output_ids.append(token)
                progress.log_probs.append(log_prob)
                self.last_token_at = time.monotonic()
                if on_progress is not None:
                    on_progress()
            kwargs["on_token"] = on_token
        try:
            out = await self.engine.generate(item.input_ids, dict(item.sampling_params), **kwargs)
        except PluginError as exc:
            raise BadRequest(str(exc)) from exc
        finally:
            self.running.pop(item.rid, None)
        progress.output_ids = list(out.output_ids)  # the engine's own record (same tokens when it streams)
        progress.log_probs = list(out.output_log_probs)
        progress.reason = out.finish_reason
        progress.routed_experts = out.routed_experts
        return progress

    def _check_routing(self, item: GenerateItem) -> None:
        """Refuse ``return_routed_experts`` the server cannot answer; the start's range is SGLang's
        (``Scheduler``: ``0 <= routed_experts_start_len <= prompt tokens``)."""
        if not item.return_routed_experts:
            return
        if self.routing is None:
            raise BadRequest(f"/generate: return_routed_experts needs a mixture-of-experts model served with "
                             f"--enable-return-routed-experts (request {item.rid!r}).")
        start = item.routed_experts_start_len
        if not 0 <= start <= len(item.input_ids):
            raise BadRequest(f"/generate: routed_experts_start_len={start} is outside [0, {len(item.input_ids)}] "
                             f"(the prompt's tokens) for request {item.rid!r}.")

    async def _input_log_probs(self, item: GenerateItem) -> list:
        """SGLang's ``input_token_logprobs`` values: prompt positions from ``logprob_start_len`` on
        (-1, or the prompt's length: none, which is SGLang's default).

        :raises BadRequest: ``logprob_start_len`` beyond the prompt, or prompt log-probs asked
            of an engine that cannot compute them (it has no ``prompt_log_probs``).
        """
        start, length = item.logprob_start_len, len(item.input_ids)
        if start == -1 or start == length:
            return []
        if not 0 <= start < length:
            raise BadRequest(f"/generate: logprob_start_len={start} is higher than the number of input tokens "
                             f"{length} of request {item.rid!r}; use a smaller logprob_start_len.")
        score = getattr(self.engine, "prompt_log_probs", None)
        if score is None:
            raise BadRequest(f"/generate: --rollout-backend '{self.args.rollout_backend}' cannot score prompt "
                             "tokens: logprob_start_len is not supported yet with it (leave it at -1).")
        return list(await score(item.input_ids, start))

    def _check_context(self, item: GenerateItem) -> None:
        """Refuse a request that does not fit the model's context, as SGLang's tokenizer manager does.

        SGLang (``TokenizerManager._validate_one_request``) refuses a prompt of at least
        ``context_length`` tokens, and a prompt plus ``max_new_tokens`` of more than
        ``context_length`` unless ``--allow-auto-truncate``; without ``max_new_tokens`` it
        generates until the context is full.
        """
        context, prompt = self.context_length, len(item.input_ids)
        if not context:
            return
        if prompt >= context:
            raise BadRequest(f"/generate: the prompt of request {item.rid!r} has {prompt} tokens; the model's context "
                             f"length is {context} tokens (prompt plus generated tokens); send a shorter prompt.")
        max_new = item.sampling_params.get("max_new_tokens")
        if max_new is not None and prompt + int(max_new) > context:
            raise BadRequest(f"/generate: request {item.rid!r} asks for {prompt} prompt tokens + {max_new} "
                             f"max_new_tokens = {prompt + int(max_new)} tokens; the model's context length is "
                             f"{context} tokens: lower max_new_tokens to at most {context - prompt} or shorten the "
                             "prompt.")

    def mark_aborted(self, rids, message: str) -> None:
        """Say why these running requests end with finish reason abort."""
        for rid in rids:
            if rid in self.running:
                self.running[rid].abort_message = message

    async def abort_all(self, message: str) -> None:
        self.mark_aborted(list(self.running), message)
        await self.engine.abort()

    async def shut_down(self) -> None:
        """Refuse new work (503 on health checks) and end running requests as aborted (paused ones too)."""
        self.exiting = True
        if self.running:
            await self.abort_all("The server is shutting down")
        if self.pause_mode is not None:
            await self.engine.continue_generation()  # a paused batch takes its last step: it ends aborted
            self.pause_mode = None


STATE_KEY = web.AppKey("state", ServeState)


def state_of(request: web.Request) -> ServeState:
    """The :class:`ServeState` of the application serving ``request``."""
    return request.app[STATE_KEY]
