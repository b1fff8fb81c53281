"""Protocols that backends and the core's helpers meet.

The factories ``rollout_engine``, ``train_backend`` and ``data_source`` return objects
meeting these Protocols; the core never checks their class, only their methods.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Protocol, runtime_checkable

import attrs

from .types import FilterResult, GenerateOutput, Sample, TrainBatch

__all__ = ["DataSource", "RolloutContext", "RolloutEngine", "StepObjective", "TrainBackend"]


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates tokens. Implementations: ``embedded`` (transformers), ``sglang``."""

    tokenizer: Any

    async def generate(self, input_ids: list[int], sampling_params: dict) -> GenerateOutput:
        """Generate one continuation of ``input_ids``.

        ``sampling_params`` keys (SGLang names): ``temperature`` (> 0, or 0 for greedy),
        ``top_p``, ``top_k`` (-1 = off), ``max_new_tokens`` (tokens), ``stop`` (strings),
        ``stop_token_ids``, ``min_new_tokens``, ``skip_special_tokens``.
        Returns the generated ids, their sampling log-probs, the finish reason
        (``stop``/``length``/``abort``) and the weight version.
        """

    async def abort(self) -> None:
        """Finish every in-flight request now with finish reason ``abort``."""

    async def update_weights(self, named_tensors: list[tuple[str, Any]], version: int) -> None:
        """Load HF-named tensors in place and set the weight version."""

    async def release_memory(self) -> None: ...

    async def resume_memory(self) -> None: ...

    async def health(self) -> bool: ...


class StepObjective(Protocol):
    """The core's loss objective, called by a train backend once per micro-batch.

    It runs the chosen ``loss`` plugin and the core's reducer with denominators taken over
    the whole optimizer step (all micro-batches, all data-parallel ranks), so summing the
    returned losses over a step's micro-batches gives the step objective exactly.
    """

    async def __call__(
        self,
        sample_ids: list[int],
        log_probs: list,
        entropy: list | None,
        values: list | None = None,
    ) -> tuple[Any, dict[str, float]]:
        """Loss of one micro-batch.

        :param sample_ids: indices into the :class:`TrainBatch` of the micro-batch's samples.
        :param log_probs: N float32 tensors [T_i] of the current policy, carrying grad.
        :param entropy: N float32 tensors [T_i] or None.
        :returns: ``(loss, metrics)``: a 0-dim tensor to ``backward()`` and a dict of floats
            already divided by the step's denominator (sum them over micro-batches).
        """


@runtime_checkable
class TrainBackend(Protocol):
    """Trains the policy. Implementations: ``fsdp`` (torch, CPU or GPU), ``megatron``."""

    async def init(self, args: Any) -> int:
        """Load the model and optimizer; return the start rollout id (0 unless resumed)."""

    async def log_probs(self, batch: TrainBatch, model: str = "actor") -> dict:
        """Forward-only pass; returns ``{"log_probs": [...], "entropy": [...]}`` (N x [T_i]).

        ``model`` is ``"actor"`` or ``"ref"``. Logits are divided by ``batch.temperature``.
        With several trainer ranks ``batch.steps`` holds this rank's micro-batches; entries
        of the other ranks' samples are None (the core merges the ranks' lists).
        """

    async def train(self, rollout_id: int, batch: TrainBatch) -> list[dict]:
        """Run one optimizer step per entry of ``batch.steps`` (micro-batches in order, one
        ``objective`` call and backward each, gradients summed over data-parallel ranks,
        then clip, step, LR schedule); return one metrics dict per step (objective metrics
        summed over micro-batches and ranks, plus ``grad_norm`` (pre-clip) and ``lr``),
        the same on every rank."""

    async def named_weights(self) -> list[tuple[str, Any]]:
        """The policy's weights with Hugging Face names, for weight sync."""

    async def save(self, path: str) -> None: ...

    async def load(self, path: str) -> None: ...

    async def offload(self) -> None: ...

    async def onload(self) -> None: ...


@runtime_checkable
class DataSource(Protocol):
    """Yields prompt rows. Built-in: ``jsonl``. Buffer and counters live in the core."""

    def next_rows(self, k: int) -> list[dict]:
        """The next ``k`` rows (``{"prompt", "label", "metadata"}``), rolling over epochs."""

    def state(self) -> dict:
        """JSON-serializable position (offset, epoch, seed)."""

    def load_state(self, state: dict) -> None: ...


@attrs.define
class RolloutContext:
    """What the core hands the ``rollout`` hook for one rollout.

    ``engine``: the :class:`RolloutEngine`. ``data``: the core's data cursor with
    ``await get_samples(k) -> list[list[Sample]]`` (buffer first through ``buffer_pop``,
    then the data source), ``add_samples(groups)`` (partial-rollout buffer) and
    ``buffer_len()``.
    ``generate_group(group, evaluation=False)``: coroutine that generates and scores every
    sample of one group through the ``generate`` and ``reward`` hooks, in place.
    ``filter_group(group, rollout_id) -> FilterResult``: every chosen filter in flag order.
    ``abort(rollout_id)``: engine abort, then the ``abort`` hook broadcast.
    ``metrics``: dict the rollout adds ``rollout/...`` values to.
    ``state``: a dict the core keeps for the whole run and passes, the same object, to
    every call of the chosen rollout plugin: work that spans rollouts lives here (the
    fully async producer). When the run ends the core cancels and awaits every
    ``asyncio.Task`` stored as a value of ``state``. The callables and ``data`` of any
    context stay valid for the whole run.
    ``weight_version``: the weight version the core last pushed to the engine when this
    call started (the first sync is 1; never goes backwards), or None before any sync.

    A plugin that keeps groups after its call returns (in flight or queued) calls
    ``data.hold(groups)`` when it takes them: held groups are not counted in
    ``rollout/accounting/*`` until they are returned, buffered (``add_samples``), rejected
    by ``filter_group``, or dropped with ``data.release(groups)`` (then counted as
    surplus, or aborted_dropped when a sample was aborted).
    """

    engine: RolloutEngine
    data: Any
    generate_group: Callable[..., Awaitable[list[Sample]]]
    filter_group: Callable[..., Awaitable[FilterResult]]
    abort: Callable[[int], Awaitable[None]]
    metrics: dict = attrs.field(factory=dict)
    state: dict = attrs.field(factory=dict)
    weight_version: int | None = None
