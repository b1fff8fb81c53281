"""The embedded rollout engine: a transformers causal LM with its own weights and a continuous-batching scheduler.

Concurrent ``generate`` calls are queued; a worker thread decodes them with
:class:`~.decode.SlotDecoder` (up to ``--embedded-max-batch-size`` at once, a finished
request's slot refilled from the queue at the next step) and resolves each request as
soon as it finishes, so the event loop stays free while the model runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any, Callable

import attrs

from furlong.hooks import GenerateOutput, PluginError
from furlong.kit.compute_thread import compute_turn, run_compute

from .decode import Request, SlotDecoder
from .fused_projections import fuse_projections, unfuse_projections
from .sampling import SamplingParams
from .weight_names import target_of

__all__ = ["EmbeddedEngine"]

log = logging.getLogger("furlong.engines.embedded")


class EmbeddedEngine:
    """A :class:`furlong.hooks.RolloutEngine` running a Hugging Face model in this process.

    :param model: a causal LM (its own copy of the weights; the trainer mutates its own).
    :param tokenizer: the model's tokenizer (``engine.tokenizer``).
    :param max_batch_size: most requests decoded together.
    :param seed: seeds the engine's own generator of per-request sampling seeds (a request
        without ``sampling_seed`` takes the next one), so the same requests in the same
        order sample the same tokens in whatever process the engine runs.
    :param compile: None, or the ``torch.compile`` backend of the decode step
        (``--embedded-torch-compile``: ``"inductor"``; see :class:`~.decode.SlotDecoder`).
    :param record_routing: a mixture-of-experts model records the experts each fed token was
        routed to, returned as ``GenerateOutput.routed_experts`` (``--use-rollout-routing-replay``).
    :param experts: ``(prefill, decode)`` experts kernels of an MoE model (default: chosen
        from the device and dtype, see :func:`~.experts.experts_kernels`).
    :param decode_kernels: ``--embedded-decode-kernels`` (see :class:`~.decode.SlotDecoder`'s ``kernels``).
    :raises PluginError: ``max_batch_size`` below 1, or ``record_routing`` with a model that has
        no mixture-of-experts layer.
    """

    def __init__(self, model, tokenizer, max_batch_size: int = 64, seed: int = 0, compile: str | None = None,
                 record_routing: bool = False, experts: tuple[str, str] | None = None,
                 decode_kernels: bool = True) -> None:
        import torch

        from furlong.kit.moe import routing_layout

        if max_batch_size < 1:
            raise PluginError(f"--embedded-max-batch-size {max_batch_size}: must be at least 1.")
        self.routing = routing_layout(model)  # None for a dense model
        self.records_routing = bool(record_routing)
        if record_routing and self.routing is None:
            raise PluginError(f"--use-rollout-routing-replay: the model ({type(model).__name__}) has no "
                              "mixture-of-experts layer, so there is no routing to record; run without the flag.")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        self.weight_version = 0
        self.context_len = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self._eos_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._pad_id = int(pad) if pad is not None else 0
        self._lock = threading.Lock()  # held by every forward pass and by weight copies
        self._epoch = 0
        self._paused = False
        self._pausing = False
        self._groups: dict[str, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[Request] = []
        self._inflight: set[Request] = set()  # taken by the decoder, not resolved yet
        self._queue_lock = threading.Lock()  # guards _pending and _inflight (event loop and decode thread)
        self._decoder = SlotDecoder(model, tokenizer, max_slots=max_batch_size, lock=self._lock, compile=compile,
                                    record_routing=record_routing, experts=experts, kernels=decode_kernels)
        self._by_rid: dict[str, Request] = {}  # requests given a rid, until they are resolved
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._running: asyncio.Future | None = None
        self._torch = torch
        self._seeds = torch.Generator().manual_seed(int(seed))
        self._fp8 = _fp8_layers(model)  # "<module>.weight" and ".weight_scale_inv" -> FP8 layer (syncs quantise)

    # --- RolloutEngine ------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling_params: dict, *, rid: str | None = None,
                       on_token: Callable[[int, float], None] | None = None) -> GenerateOutput:
        """Generate one continuation of ``input_ids`` (see :class:`~.sampling.SamplingParams`).

        :param input_ids: prompt (or prompt + earlier response) token ids, non-empty.
        :param sampling_params: SGLang-style dict (``temperature``, ``top_p``, ``top_k``,
            ``max_new_tokens``, ``min_new_tokens``, ``stop``, ``stop_token_ids``,
            ``ignore_eos``, ``skip_special_tokens``, ``sampling_seed``).
        :param rid: a request id for :meth:`abort_request` (unique among unfinished requests).
        :param on_token: called on the event loop with ``(token_id, log_prob)`` after each
            decoded token, before the result resolves (incremental output for streaming).
        :returns: :class:`~furlong.hooks.GenerateOutput`; at most ``max_position_embeddings``
            minus the prompt's tokens are generated (then finish reason "length");
            ``output_ids`` include a matched
            stop token or stop string (no trimming); ``output_log_probs`` are
            ``log_softmax(logits / T)`` of each chosen token (before top-k/top-p);
            ``weight_version`` is the version when the request finished.
        :raises PluginError: empty ``input_ids``, a prompt as long as the model's context
            (``max_position_embeddings``) or longer, a bad sampling parameter, or a
            ``rid`` of a request that has not finished.
        """
        params = SamplingParams.from_dict(sampling_params)
        if rid is not None and rid in self._by_rid:
            raise PluginError(f"embedded engine: request id {rid!r} is already in use by an unfinished request.")
        if not input_ids:
            raise PluginError("embedded engine: generate() got empty input_ids; send at least one prompt token.")
        if self.context_len and len(input_ids) >= self.context_len:
            raise PluginError(
                f"embedded engine: a prompt of {len(input_ids)} tokens does not fit the model's context of "
                f"{self.context_len} tokens (max_position_embeddings); drop long prompts with "
                "--rollout-max-prompt-len (--eval-max-prompt-len for eval sets)."
            )
        if self.context_len:  # never past the context: the request ends with "length" when it is full
            room = self.context_len - len(input_ids)
            if params.max_new_tokens > room:
                params = attrs.evolve(params, max_new_tokens=room)
        seed = params.sampling_seed
        if seed is None:
            seed = int(self._torch.randint(0, 2**62, (1,), generator=self._seeds).item())
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos_ids)
        req = Request(input_ids=[int(t) for t in input_ids], params=params, seed=seed, epoch=self._epoch,
                      stop_ids=stop_ids, rid=rid)
        if params.max_new_tokens == 0:
            return self._output(req, "length")
        self._ensure_worker()
        if on_token is not None:
            loop = self._loop
            req.on_token = lambda token, log_prob: loop.call_soon_threadsafe(on_token, token, log_prob)
        if rid is not None:
            self._by_rid[rid] = req
        req.future = self._loop.create_future()
        req.future.add_done_callback(lambda f: setattr(req, "cancelled", f.cancelled()))
        with self._queue_lock:
            self._pending.append(req)
        self._wakeup.set()
        return await req.future

    async def abort(self) -> None:
        """Finish every queued and in-flight request now with finish reason "abort".

        In-flight requests keep the tokens generated so far (partial rollout resumes from
        them); queued ones return no tokens. Returns once every request submitted before
        the call is resolved. Later requests run normally.
        """
        self._epoch += 1
        with self._queue_lock:
            pending, self._pending = self._pending, []
            running = [r.future for r in self._inflight if r.future is not None and not r.future.done()]
        for req in pending:
            self._resolve(req, "abort")
        if running and self._loop is asyncio.get_running_loop() and not self._paused:
            # (while paused the decoder cannot take a step: these finish, as aborted, on continue)
            await asyncio.wait(running)

    async def abort_request(self, rid: str) -> bool:
        """Finish the unfinished request ``rid`` with finish reason "abort" (SGLang's ``/abort_request``).

        A queued request returns no tokens; one being decoded keeps the tokens so far and
        ends at its next decode step (after :meth:`continue_generation` while paused).

        :returns: False when no unfinished request has that id.
        """
        req = self._by_rid.get(rid)
        if req is None:
            return False
        req.aborted = True
        with self._queue_lock:
            queued = req in self._pending
            if queued:
                self._pending.remove(req)
        if queued:
            self._resolve(req, "abort")
        return True

    # --- weight updates, in SGLang's phases ---------------------------------------------

    weight_update_ranks = 1  # ranks this engine takes in a weight-update group

    async def pause_generation(self, mode: str = "retract") -> None:
        """Hold decoding between two decode steps until :meth:`continue_generation`.

        ``abort`` first finishes every request with finish reason "abort" (partial tokens
        kept); ``retract`` and ``in_place`` keep them: they continue after the update.
        """
        if mode == "abort":
            await self.abort()
        if self._paused or self._pausing:
            return
        self._pausing = True
        await asyncio.to_thread(self._lock.acquire)
        if self._pausing:
            self._paused, self._pausing = True, False
        else:  # continue_generation came while the pause waited for the decode step: do not stay paused
            self._lock.release()

    async def continue_generation(self) -> None:
        self._pausing = False
        if self._paused:
            self._paused = False
            self._lock.release()

    async def flush_cache(self) -> None:
        """Nothing to drop: the engine keeps no prefix cache across requests."""

    async def set_weight_version(self, version: int) -> None:
        self.weight_version = int(version)

    async def load_weights(self, named_tensors: list[tuple[str, Any]]) -> None:
        """Copy one bucket of Hugging Face-named tensors into the model in place.

        Names are the model's ``state_dict`` names, or, for a mixture-of-experts model, the
        checkpoint's per-expert names too (``...mlp.experts.{e}.{gate,up,down}_proj.weight``,
        copied into their slices of the fused experts tensors; see :mod:`.weight_names`).
        An FP8 engine quantises the weight of each of its FP8 layers into e4m3 blocks and
        ``weight_scale_inv`` (:meth:`.fp8.Fp8Linear.load_dense`: the rounding of ``furlong quantize-fp8``);
        blocks already in e4m3 and their ``weight_scale_inv`` (what SGLang's clients send an FP8
        server) are copied as they are.

        :raises PluginError: an unknown name or a shape mismatch (names the tensor).
        """
        # while the decode loop runs (in the compute thread, where a pause holds it on the lock), copy beside
        # it; otherwise in the compute thread, before any decode loop started later (its queue is in order)
        decoding = self._running is not None and not self._running.done()
        copy = asyncio.to_thread if decoding else run_compute
        await copy(self._copy_weights, list(named_tensors))

    async def update_weights_from_disk(self, path: str) -> None:
        """Load every tensor of the Hugging Face model directory ``path`` (a snapshot written by ``save_hf``) in
        place, as one :meth:`load_weights` bucket (SGLang's ``/update_weights_from_disk``).

        :raises PluginError: ``path`` holds no readable weights, or a tensor the model does not have (named).
        """
        from furlong.kit.hf import read_hf_weights

        named = await asyncio.to_thread(read_hf_weights, path, "eval snapshot")
        await self.load_weights(named)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str = "gloo") -> None:
        """Join the weight-update group as rank ``rank_offset`` (trainer rank 0 broadcasts)."""
        from furlong.kit.dist import new_weight_update_group

        group = await asyncio.to_thread(new_weight_update_group, master_address, int(master_port), int(rank_offset),
                                        int(world_size), group_name, backend)
        self._groups[group_name] = (group, "cuda" if backend == "nccl" else "cpu")

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str) -> None:
        """Receive one bucket over ``group_name`` and load it (SGLang's ``/update_weights_from_distributed``)."""
        from furlong.kit.dist import receive_bucket

        if group_name not in self._groups:
            raise PluginError(f"embedded engine: no weight-update group '{group_name}'; "
                              "call init_weights_update_group first.")
        group, where = self._groups[group_name]  # NCCL receives on the GPU, gloo in host memory
        device = self.device if where == "cuda" else "cpu"
        tensors = await asyncio.to_thread(receive_bucket, dtypes, shapes, group, device)
        await self.load_weights(list(zip(names, tensors)))

    async def destroy_weights_update_group(self, group_name: str) -> None:
        group, _ = self._groups.pop(group_name, (None, None))
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(group)

    async def update_weights(self, named_tensors: list[tuple[str, Any]], version: int) -> None:
        """All phases at once: pause in place, load ``named_tensors``, set ``version``, continue."""
        await self.pause_generation("in_place")
        try:
            await self.load_weights(named_tensors)
            await self.set_weight_version(version)
        finally:
            await self.continue_generation()

    async def release_memory(self) -> None:
        """On CUDA, move the weights to host memory and empty the cache; a no-op on CPU."""
        if self.device.type == "cuda":
            await asyncio.to_thread(self._move, "cpu")

    async def resume_memory(self) -> None:
        """Move the weights back to the accelerator after :meth:`release_memory`."""
        if self.device.type == "cuda":
            await asyncio.to_thread(self._move, self.device)

    async def prompt_log_probs(self, input_ids: list[int], start: int) -> list[float | None]:
        """Log-probs of the prompt's own tokens ``input_ids[start:]``, each given the tokens before it.

        Raw model distribution (temperature 1), float; the first token of the prompt has
        no context and gets None (SGLang's ``input_token_logprobs``). Waits while
        generation is paused (the forward pass takes the decode lock).
        """
        def forward() -> list[float | None]:
            torch = self._torch
            self._use_device()
            with self._lock, compute_turn(), torch.no_grad():
                ids = torch.tensor([input_ids], device=self.device)
                log_probs = torch.log_softmax(self.model(ids).logits[0, :-1].float(), dim=-1)
                picked = log_probs.gather(1, ids[0, 1:, None])[:, 0].tolist()
            return ([None] + picked)[start:]

        return await asyncio.to_thread(forward)

    async def health(self) -> bool:
        """True unless the scheduler's worker task died."""
        return self._worker is None or not self._worker.done() or self._worker.cancelled()

    # --- scheduler ----------------------------------------------------------------------

    def _ensure_worker(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._worker is None or self._worker.done():
            self._loop = loop
            self._wakeup = asyncio.Event()
            self._pending = []  # requests of a closed event loop can never be answered
            self._by_rid = {}
            self._inflight = set()
            self._worker = loop.create_task(self._work())

    async def _work(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._pending:
                continue
            self._running = asyncio.ensure_future(run_compute(self._decode))
            try:
                await self._running
            except Exception as exc:  # noqa: BLE001 - handed to every waiting caller
                log.exception("embedded engine: decoding failed")
                self._decoder.requests = [None] * self.max_batch_size
                self._decoder.forget_prompts()
                with self._queue_lock:
                    failed, self._inflight = list(self._inflight), set()
                for req in failed:
                    self._forget(req)
                    if req.future is not None and not req.future.done():
                        req.future.set_exception(exc)
            finally:
                self._running = None

    def _decode(self) -> None:
        loop = self._loop
        self._use_device()
        self._decoder.run(
            take=self._take, aborted=self._aborted,
            on_finish=lambda reqs: loop.call_soon_threadsafe(self._resolve_all, reqs),
        )

    def _take(self, n: int) -> list[Request]:
        """Up to ``n`` queued requests for the decoder (decode thread); aborted ones are resolved instead."""
        taken, dropped = [], []
        with self._queue_lock:
            while self._pending and len(taken) < n:
                req = self._pending.pop(0)
                (dropped if self._aborted(req) else taken).append(req)
            self._inflight.update(taken)
        for req in dropped:
            self._loop.call_soon_threadsafe(self._resolve, req, "abort")
        return taken

    def _aborted(self, req: Request) -> bool:
        return req.epoch < self._epoch or req.cancelled or req.aborted

    def _forget(self, req: Request) -> None:
        if req.rid is not None and self._by_rid.get(req.rid) is req:
            del self._by_rid[req.rid]

    def _resolve_all(self, reqs: list[Request]) -> None:
        for req in reqs:
            self._resolve(req, req.finish_reason)

    def _resolve(self, req: Request, reason: str) -> None:
        self._forget(req)
        with self._queue_lock:
            self._inflight.discard(req)
        if req.future is not None and not req.future.done():
            req.future.set_result(self._output(req, reason))

    def _output(self, req: Request, reason: str) -> GenerateOutput:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
        return GenerateOutput(output_ids=list(req.output_ids), output_log_probs=list(req.log_probs),
                              finish_reason=reason, weight_version=str(self.weight_version), text=text,
                              routed_experts=req.routed_experts)

    async def weight_digests(self, names: list[str]) -> dict[str, tuple[str, list[int], str]]:
        """``{name: (dtype, shape, sha256)}`` of the tensor each Hugging Face name of a weight update is copied
        into (a per-expert name: its slice of the fused experts; an FP8 layer's name: its e4m3 blocks), for
        ``--check-weight-update-equal`` (:func:`furlong.kit.tensor_digest.tensor_digest`); names the model
        lacks are left out."""
        from furlong.kit.tensor_digest import named_digests

        def digests():
            with self._lock:
                state = self.model.state_dict()
                targets = ((name, target_of(self.model, state, name)) for name in names)
                return named_digests((name, t) for name, t in targets if t is not None)

        return await asyncio.to_thread(digests)

    # --- weights ------------------------------------------------------------------------

    def _copy_weights(self, named_tensors: list[tuple[str, Any]]) -> None:
        """Copy under the decode lock, which :meth:`pause_generation` already holds while paused."""
        self._use_device()
        state = self.model.state_dict()
        with contextlib.nullcontext() if self._paused else self._lock, self._torch.no_grad():
            written = set()  # FP8 layers given already quantised blocks or scales: refreshed after the bucket
            for name, tensor in named_tensors:
                layer = self._fp8.get(name)
                target = target_of(self.model, state, name)
                if target is None:
                    raise PluginError(
                        f"embedded engine: update_weights got unknown tensor '{name}'; "
                        "names must match the model's Hugging Face state_dict"
                        + (" or its checkpoint's per-expert names." if self.routing is not None else ".")
                    )
                if tuple(target.shape) != tuple(tensor.shape):
                    raise PluginError(
                        f"embedded engine: update_weights tensor '{name}' has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(target.shape)}."
                    )
                if layer is not None and name.endswith(".weight") and tensor.dtype != target.dtype:
                    layer.load_dense(tensor)  # the quantiser's blocks and rounding, on the engine's device
                else:
                    target.copy_(tensor)
                    if layer is not None:
                        written.add(layer)
            for layer in written:
                layer.refresh()
            self._decoder.forget_prompts()  # prompts prefilled with the old weights are not shared any more

    def _use_device(self) -> None:
        """Worker threads start on CUDA device 0; switch to the model's device."""
        if self.device.type == "cuda":
            self._torch.cuda.set_device(self.device)

    def _move(self, device) -> None:
        self._use_device()
        with self._lock:
            self._decoder.release()
            unfuse_projections(self.model)  # (.to() would give the fused weights' views storage of their own)
            self.model.to(device)
            if self._decoder.fuses_projections and self._torch.device(device).type == "cuda":
                fuse_projections(self.model)
            if self._torch.cuda.is_available():
                self._torch.cuda.empty_cache()


def _fp8_layers(model) -> dict[str, Any]:
    """The FP8 layers of ``model`` by weight name (empty for a model without any: no FP8 import)."""
    if not any(type(m).__name__ == "Fp8Linear" for m in model.modules()):
        return {}
    from .fp8 import fp8_layers

    return fp8_layers(model)


def _eos_ids(model, tokenizer) -> set[int]:
    """The tokenizer's EOS id plus the generation config's (which may be a list)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    if extra is not None:
        ids.update(int(t) for t in (extra if isinstance(extra, (list, tuple)) else [extra]))
    return ids
