"""Continuous batching for the embedded engine (runs in a worker thread).

:class:`SlotDecoder` keeps up to ``S`` requests in the slots of a preallocated key/value
cache (:mod:`.slots`). Each turn of its loop it fills free slots from the queue (one
prefill pass for all new requests; requests with the same prompt, such as the samples of
one group, share a single prefill row and get copies of its keys and values), then runs
one decode step for every slot at once: one forward pass, every row sampled on the
device (:func:`~.sampling.sample_batch`), the finish test made on the device, and one
small copy to the host per step (which rows finished). A finished request leaves its
slot at once and the next queued request takes it at the next turn.

A request finishes on its token budget ("length", checked first, as SGLang does), a stop
token or a stop string in its decoded tail ("stop"), or an abort ("abort"; the tokens so
far are kept). Tokens are read back to the host when a request finishes, or every step
for the few requests that need them earlier (stop strings, ``on_token`` streaming).

On CUDA the decode step's forward pass is captured once per batch width in a CUDA graph
and replayed (weights are updated in place, so the graphs stay valid; they are dropped
when the cache grows or the weights move).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import attrs

from .sampling import SamplingParams, sample_batch
from .slots import SlotCache, SlotPass, use_slot_attention

__all__ = ["Request", "SlotDecoder"]

log = logging.getLogger("furlong.engines.embedded")

# positions allocated beyond the longest prompt at first (the cache doubles when a request needs more)
FIRST_GROWTH = 2048


@attrs.define(eq=False)
class Request:
    """One ``generate`` call: its prompt, parameters, sampling seed and results so far.

    ``epoch``: the engine's abort epoch at submission; the request is aborted as soon as
    the engine's epoch is larger. ``cancelled``: the caller stopped waiting. ``rid``: the
    caller's request id (``abort_request(rid)`` sets ``aborted``). ``on_token``: called
    in the decode thread with ``(token_id, log_prob)`` after each new token (streaming).
    """

    input_ids: list[int]
    params: SamplingParams
    seed: int
    epoch: int
    stop_ids: set[int]
    future: Any = None
    cancelled: bool = False
    rid: str | None = None
    aborted: bool = False
    on_token: Callable[[int, float], None] | None = None
    output_ids: list[int] = attrs.field(factory=list)
    log_probs: list[float] = attrs.field(factory=list)
    finish_reason: str | None = None

    @property
    def watched(self) -> bool:
        """Its tokens are needed on the host every step (stop strings, streaming)."""
        return bool(self.params.stop) or self.on_token is not None


class SlotDecoder:
    """The slots, their per-slot sampling state on the device, and the decode loop.

    :param model: a transformers causal LM in eval mode (switched to slot attention).
    :param max_slots: most requests decoded together (``--embedded-max-batch-size``).
    :param lock: held around every forward pass (weight updates take it between steps).
    :param graphs: capture the decode step in CUDA graphs (CUDA only).
    """

    def __init__(self, model, tokenizer, *, max_slots: int, lock: threading.Lock, graphs: bool = True) -> None:
        import torch

        use_slot_attention(model)
        self.model, self.tokenizer, self.max_slots, self.lock = model, tokenizer, max_slots, lock
        self.device = next(model.parameters()).device
        self.cache = SlotCache.for_model(model)
        self.graphs_on = graphs and self.device.type == "cuda"
        self._graphs: dict[int, tuple[Any, Any]] = {}
        self.requests: list[Request | None] = [None] * max_slots
        self.count = [0] * max_slots  # tokens generated, per slot (host copy)
        self.pos = [0] * max_slots  # column of the slot's next input token (host copy)
        s, dev = max_slots, self.device
        self.d_tok = torch.zeros(s, dtype=torch.long, device=dev)
        self.d_pos = torch.zeros(s, dtype=torch.long, device=dev)
        self.d_busy = torch.zeros(s, dtype=torch.long, device=dev)
        self.d_count = torch.zeros(s, dtype=torch.long, device=dev)
        self.d_seed = torch.zeros(s, dtype=torch.long, device=dev)
        self.d_temp = torch.ones(s, dtype=torch.float32, device=dev)
        self.d_greedy = torch.zeros(s, dtype=torch.bool, device=dev)
        self.d_top_k = torch.full((s,), -1, dtype=torch.long, device=dev)
        self.d_top_p = torch.ones(s, dtype=torch.float32, device=dev)
        self.d_max_new = torch.zeros(s, dtype=torch.long, device=dev)
        self.d_min_new = torch.zeros(s, dtype=torch.long, device=dev)
        self.d_stops = torch.full((s, 1), -1, dtype=torch.long, device=dev)
        self.out_ids = torch.zeros(s, 0, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(s, 0, dtype=torch.float32, device=dev)

    # --- the loop -----------------------------------------------------------------------

    def run(self, take: Callable[[int], list[Request]], aborted: Callable[[Request], bool],
            on_finish: Callable[[Request], None]) -> None:
        """Decode until no slot is busy and ``take`` hands out nothing more.

        :param take: ``take(n)`` returns up to ``n`` queued requests (it may return none).
        :param aborted: tells whether a request must stop now.
        :param on_finish: called once per request, after its ``finish_reason`` is set.
        """
        import torch

        with torch.no_grad():
            while True:
                for s, req in enumerate(self.requests):
                    if req is not None and aborted(req):
                        self._finish([s], ["abort"], on_finish)
                free = [s for s, r in enumerate(self.requests) if r is None]
                new = take(len(free)) if free else []
                if new:
                    self._admit(new, free[: len(new)], on_finish)
                busy = [s for s, r in enumerate(self.requests) if r is not None]
                if not busy:
                    if new:
                        continue
                    return
                self._step(busy[-1] + 1, on_finish)

    def release(self) -> None:
        """Drop the cache and graphs (weights moved, or memory handed back)."""
        self._graphs.clear()
        self.cache.release()

    # --- admission and prefill ----------------------------------------------------------

    def _admit(self, new: list[Request], slots: list[int], on_finish) -> None:
        import torch

        dev = self.device
        longest = max(len(r.input_ids) for r in new)
        need = max([len(r.input_ids) + r.params.max_new_tokens for r in new]
                   + [self.pos[s] + 1 for s, r in enumerate(self.requests) if r is not None])
        self._ensure(min(need, max(longest, max(self.pos)) + FIRST_GROWTH))
        for s, req in zip(slots, new):
            self.requests[s] = req
            self.count[s], self.pos[s] = 0, len(req.input_ids)
        index = torch.tensor(slots, device=dev)
        p = [r.params for r in new]
        self.d_seed[index] = torch.tensor([r.seed % 2**62 for r in new], device=dev)
        self.d_temp[index] = torch.tensor([q.temperature if q.temperature > 0 else 1.0 for q in p], device=dev)
        self.d_greedy[index] = torch.tensor([q.temperature == 0 for q in p], device=dev)
        self.d_top_k[index] = torch.tensor([q.top_k for q in p], device=dev)
        self.d_top_p[index] = torch.tensor([q.top_p for q in p], device=dev)
        self.d_max_new[index] = torch.tensor([q.max_new_tokens for q in p], device=dev)
        self.d_min_new[index] = torch.tensor([q.min_new_tokens for q in p], device=dev)
        self.d_pos[index] = torch.tensor([len(r.input_ids) for r in new], device=dev)
        self.d_count[index] = 0
        self.d_busy[index] = 1
        self._set_stops(slots, new)
        logits = self._prefill(new, slots)
        self._sample(index, logits, on_finish)

    def _prefill(self, new: list[Request], slots: list[int]):
        """One forward pass over the distinct prompts; returns float32 logits ``[len(new), V]``."""
        import torch

        dev = self.device
        first: dict[tuple[int, ...], int] = {}
        row_of = [first.setdefault(tuple(r.input_ids), len(first)) for r in new]
        prompts = [list(k) for k in first]
        width = max(len(x) for x in prompts)
        ids = torch.tensor([[0] * (width - len(x)) + x for x in prompts], device=dev)
        valid = torch.tensor([[False] * (width - len(x)) + [True] * len(x) for x in prompts], device=dev)
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        columns = torch.where(valid, positions, torch.full_like(positions, self.cache.scratch))
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
        eye = torch.eye(width, dtype=torch.bool, device=dev)
        mask = ((causal[None] & valid[:, None, :]) | eye[None])[:, None]
        owner = [0] * len(prompts)
        for i, r in reversed(list(enumerate(row_of))):
            owner[r] = slots[i]
        step = SlotPass(cache=self.cache, rows=torch.tensor(owner, device=dev), columns=columns, causal=mask)
        with self.lock:
            logits = self.model(input_ids=ids, position_ids=positions, slot_pass=step, use_cache=False,
                                logits_to_keep=1).logits[:, -1].float()
        copies = [(owner[r], s) for r, s in zip(row_of, slots) if owner[r] != s]
        if copies:
            sources, targets = zip(*copies)
            self.cache.copy_prefix(torch.tensor(sources, device=dev), torch.tensor(targets, device=dev), width)
        return logits[torch.tensor(row_of, device=dev)]

    # --- decoding -----------------------------------------------------------------------

    def _step(self, n: int, on_finish) -> None:
        """One token for slots ``0 .. n-1`` (idle ones compute and are ignored)."""
        import torch

        top = max(self.pos[s] for s in range(n) if self.requests[s] is not None)
        if top >= self.cache.capacity:
            self._ensure(top + 1)
        with self.lock:
            logits = self._decode_logits(n, top + 1)
        self.d_pos[:n] += self.d_busy[:n]
        for s in range(n):
            if self.requests[s] is not None:
                self.pos[s] += 1
        self._sample(torch.arange(n, device=self.device), logits, on_finish)

    def _decode_logits(self, n: int, width: int):
        if not self.graphs_on:
            return self._forward_decode(n, width)
        bucket = min(self.max_slots, 1 << (n - 1).bit_length())
        graph = self._graphs.get(bucket)
        if graph is None:
            graph = self._graphs[bucket] = self._capture(bucket)
        if graph is False:
            return self._forward_decode(n, width)
        graph[0].replay()
        return graph[1][:n]

    def _forward_decode(self, n: int, width: int):
        import torch

        pos = self.d_pos[:n]
        visible = torch.arange(width, device=self.device)[None, :] <= pos[:, None]
        step = SlotPass(cache=self.cache, rows=torch.arange(n, device=self.device), columns=pos[:, None],
                        visible=visible[:, None, None, :], width=width)
        out = self.model(input_ids=self.d_tok[:n, None], position_ids=pos[:, None], slot_pass=step, use_cache=False,
                         logits_to_keep=1)
        return out.logits[:, -1].float()

    def _capture(self, n: int):
        """A CUDA graph of the decode forward of ``n`` slots over the whole cache, or False."""
        import torch

        width = self.cache.capacity
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward_decode(n, width)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._forward_decode(n, width)
            return graph, logits
        except Exception as exc:  # noqa: BLE001 - a model that cannot be captured runs eagerly
            log.warning("embedded engine: CUDA graph capture failed (%s); decoding without graphs", exc)
            self.graphs_on = False
            return False

    def _sample(self, index, logits, on_finish) -> None:
        """Sample rows ``index`` (slots) from ``logits`` ``[len(index), V]``, store, and finish what ended."""
        import torch

        slots = index.tolist()
        busy = [s for s in slots if self.requests[s] is not None]
        params = [self.requests[s].params for s in busy]
        filtering = any(q.top_k != -1 or q.top_p < 1 for q in params)
        tokens, log_probs = sample_batch(
            logits, self.d_temp[index], self.d_greedy[index], self.d_seed[index], self.d_count[index],
            top_k=self.d_top_k[index] if filtering else None, top_p=self.d_top_p[index] if filtering else None,
            banned=self._banned(slots, logits.shape[-1]),
        )
        count = self.d_count[index]
        self.out_ids[index, count] = tokens
        self.out_lp[index, count] = log_probs
        count = count + 1
        self.d_count[index] = count
        self.d_tok[index] = tokens
        is_stop = (self.d_stops[index] == tokens[:, None]).any(-1) & (count >= self.d_min_new[index])
        length = count >= self.d_max_new[index]
        flags = (length.long() * 2 + is_stop.long()).tolist()  # the one host copy of a step
        for s in busy:
            self.count[s] += 1
        done, reasons = [], []
        for k, s in enumerate(slots):
            if self.requests[s] is None:
                continue
            flag = flags[k]
            if flag:
                done.append(s)
                reasons.append("length" if flag >= 2 else "stop")
        watched = [s for s in busy if self.requests[s].watched]
        if watched:
            self._watch(watched, set(done), done, reasons)
        if done:
            self._finish(done, reasons, on_finish)

    def _watch(self, watched: list[int], finished: set[int], done: list[int], reasons: list[str]) -> None:
        """Per-step host work for streaming and stop-string requests."""
        for s in watched:
            req, k = self.requests[s], self.count[s] - 1
            token, log_prob = int(self.out_ids[s, k]), float(self.out_lp[s, k])
            req.output_ids.append(token)
            req.log_probs.append(log_prob)
            if req.on_token is not None:
                req.on_token(token, log_prob)
            if s not in finished and _stop_string(req, self.tokenizer):
                done.append(s)
                reasons.append("stop")

    def _finish(self, slots: list[int], reasons: list[str], on_finish) -> None:
        import torch

        longest = max(self.count[s] for s in slots)
        index = torch.tensor(slots, device=self.device)
        ids = self.out_ids[index, :longest].tolist()
        lps = self.out_lp[index, :longest].tolist()
        for s, reason, row_ids, row_lps in zip(slots, reasons, ids, lps):
            req = self.requests[s]
            req.output_ids, req.log_probs = row_ids[: self.count[s]], row_lps[: self.count[s]]
            req.finish_reason = reason
            self.requests[s] = None
            self.d_max_new[s] = self.d_busy[s] = self.d_pos[s] = 0
            on_finish(req)

    # --- per-slot tables ----------------------------------------------------------------

    def _ensure(self, capacity: int) -> None:
        import torch

        if self.cache.ensure(self.max_slots, capacity):
            self._graphs.clear()
            width = self.cache.capacity + 1
            ids = torch.zeros(self.max_slots, width, dtype=torch.long, device=self.device)
            lps = torch.zeros(self.max_slots, width, dtype=torch.float32, device=self.device)
            old = self.out_ids.shape[1]
            ids[:, :old], lps[:, :old] = self.out_ids, self.out_lp
            self.out_ids, self.out_lp = ids, lps

    def _set_stops(self, slots: list[int], new: list[Request]) -> None:
        import torch

        widest = max(len(r.stop_ids) for r in new)
        if widest > self.d_stops.shape[1]:
            grown = torch.full((self.max_slots, widest), -1, dtype=torch.long, device=self.device)
            grown[:, : self.d_stops.shape[1]] = self.d_stops
            self.d_stops = grown
        rows = [sorted(r.stop_ids) + [-1] * (self.d_stops.shape[1] - len(r.stop_ids)) for r in new]
        self.d_stops[torch.tensor(slots, device=self.device)] = torch.tensor(rows, dtype=torch.long,
                                                                             device=self.device)

    def _banned(self, slots: list[int], vocab: int):
        """``[len(slots), V]`` bool of stop tokens banned before ``min_new_tokens``, or None."""
        import torch

        rows = [(k, self.requests[s].stop_ids) for k, s in enumerate(slots) if self.requests[s] is not None
                and self.count[s] < self.requests[s].params.min_new_tokens and self.requests[s].stop_ids]
        if not rows:
            return None
        banned = torch.zeros(len(slots), vocab, dtype=torch.bool, device=self.device)
        for k, ids in rows:
            banned[k, torch.tensor(sorted(ids), device=self.device)] = True
        return banned


def _stop_string(req: Request, tokenizer) -> bool:
    """True when a stop string appears in the decoded tail (only once ``min_new_tokens`` exist)."""
    p = req.params
    if not p.stop or len(req.output_ids) < p.min_new_tokens:
        return False
    window = 4 * max(len(s) for s in p.stop) + 4  # a character is at most 4 byte-level tokens
    tail = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=p.skip_special_tokens)
    return any(s in tail for s in p.stop)
