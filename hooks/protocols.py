"""Protocols that backends and the core's helpers meet.

The factories ``rollout_engine``, ``train_backend`` and ``data_source`` return objects
meeting these Protocols; the core never checks their class, only their methods.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, Sequence, runtime_checkable

import attrs

from .run_config import RunConfig
from .types import FilterResult, GenerateOutput, ParallelLayout, Sample, TrainBatch

__all__ = ["CriticBackend", "DataSource", "Executor", "RolloutContext", "RolloutEngine", "StepObjective",
           "TrainBackend", "WorkerGroup"]


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates tokens. Implementations: ``embedded`` (transformers), ``sglang``.

    Weight updates come in phases, the shape of SGLang's HTTP API (docs/architecture.md, weight sync):
    ``pause_generation`` → ``flush_cache`` → ``begin_weight_update`` → one ``load_weights``
    (in-process) or ``update_weights_from_distributed`` (broadcast) per bucket →
    ``end_weight_update`` → ``set_weight_version`` → ``continue_generation``.

    Data members, with the default a class gets by subclassing this Protocol
    (``class MyEngine(RolloutEngine)``): ``weight_update_ranks`` (int, default 1): the ranks
    this engine takes in a weight-update group (its server's tensor-parallel GPUs);
    ``context_len`` (int or None, default None): the most tokens a prompt plus its
    completion may have, None when the engine does not know (``furlong serve`` then reads
    the model config's ``max_position_embeddings``). The core checks every member of this
    Protocol when the ``rollout_engine`` hook hands the engine over: a missing one is a
    ``PluginError`` naming the plugin and the member.

    ``begin_weight_update()`` and ``end_weight_update()`` (async, no arguments) are optional:
    an engine whose server needs a session around the buckets (SGLang 0.5.21 and later)
    defines them; the core calls ``end_weight_update`` after every ``begin_weight_update``
    that ran, also when a bucket failed. An engine without them has no session.

    ``update_weights_from_disk(path)`` (async) is optional: it loads every tensor of the
    Hugging Face model directory ``path`` (SGLang's ``/update_weights_from_disk``). The
    dedicated eval fleet (``--eval-num-gpus``) needs it: its engines are fed a weight
    snapshot written to disk at each eval point; an engine without it is refused there.

    ``max_batch_size`` (int, optional): the most requests the engine decodes at once;
    ``furlong serve`` reports it as ``/server_info``'s ``max_running_requests`` (None without it).
    """

    tokenizer: Any
    weight_update_ranks: int = 1
    context_len: int | None = None

    async def generate(self, input_ids: list[int], sampling_params: dict) -> GenerateOutput:
        """Generate one continuation of ``input_ids``.

        ``sampling_params`` keys (SGLang names): ``temperature`` (> 0, or 0 for greedy),
        ``top_p``, ``top_k`` (-1 = off), ``max_new_tokens`` (tokens), ``stop`` (strings),
        ``stop_token_ids``, ``min_new_tokens``, ``skip_special_tokens``.
        Returns the generated ids, their sampling log-probs, the finish reason
        (``stop``/``length``/``abort``) and the weight version.

        Optional keyword arguments an engine may accept (``furlong serve`` passes them when
        the signature has them): ``rid`` (a request id for an ``async abort_request(rid)``
        method) and ``on_token`` (``on_token(token_id, log_prob)`` after each decoded token).
        """

    async def abort(self) -> None:
        """Finish every in-flight request now with finish reason ``abort``."""

    async def pause_generation(self, mode: str) -> None:
        """Stop decoding until :meth:`continue_generation` (``--pause-generation-mode``).

        ``abort``: in-flight requests finish now with finish reason ``abort``;
        ``retract`` and ``in_place``: they wait and resume after the update.
        """

    async def flush_cache(self) -> None:
        """Drop cached prefixes (their KV was computed with the old weights)."""

    async def load_weights(self, named_tensors: list[tuple[str, Any]]) -> None:
        """Load one bucket of Hugging Face-named tensors in place (in-process transport)."""

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        """Join the weight-update process group (trainer rank 0 is rank 0 of it)."""

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str) -> None:
        """Receive one bucket broadcast by trainer rank 0 over ``group_name`` and load it."""

    async def destroy_weights_update_group(self, group_name: str) -> None: ...

    async def set_weight_version(self, version: int) -> None:
        """Report ``version`` from now on (``GenerateOutput.weight_version``)."""

    async def continue_generation(self) -> None:
        """Resume decoding after :meth:`pause_generation`."""

    async def release_memory(self) -> None: ...

    async def resume_memory(self) -> None: ...

    async def health(self) -> bool:
        """False when the engine cannot serve. An engine that can replace its own process
        (a remote one) may also offer ``async recover()``: the core calls it when a weight
        sync finds the engine unhealthy, and the replacement must get the current weights
        (through its ``on_restart`` callback, which the core sets). An engine that started
        processes of its own (servers) may offer ``async shutdown()``: the core calls it
        once at the end of the run, before the executor stops."""


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
    ) -> tuple[Any, dict[str, Any]]:
        """Loss of one micro-batch.

        :param sample_ids: indices into the :class:`TrainBatch` of the micro-batch's samples.
        :param log_probs: N float32 tensors [T_i] of the current policy, carrying grad.
        :param entropy: N float32 tensors [T_i] or None.
        :returns: ``(loss, metrics)``: a 0-dim tensor to ``backward()`` and a dict of 0-dim
            tensors (on the loss's device, detached) or floats, already divided by the step's
            denominator: sum them over micro-batches (:func:`furlong.kit.trainer.sum_step_metrics`
            reads a step's sums with one synchronisation).
        """


@runtime_checkable
class TrainBackend(Protocol):
    """Trains the policy. Implementations: ``fsdp`` (torch, CPU or GPU), ``megatron``.

    The core checks every member of this Protocol when the ``train_backend`` hook hands
    the backend over: a missing one is a ``PluginError`` naming the plugin and the member.
    A class that subclasses this Protocol (``class MyBackend(TrainBackend)``) inherits the
    documented default of :meth:`train_forward_gives_old_log_probs` (False).
    """

    async def init(self, config: RunConfig) -> int:
        """Load the model and optimizer; return the start rollout id (0 unless resumed)."""

    async def log_probs(self, batch: TrainBatch, model: str = "actor") -> dict:
        """Forward-only pass; returns ``{"log_probs": [...], "entropy": [...]}`` (N x [T_i]).

        ``model`` is ``"actor"``, ``"ref"``, or ``"old_actor"`` under ``--keep-old-actor`` (the optional
        ``keep_synced_weights`` below). Logits are divided by ``batch.temperature``.
        With several trainer ranks ``batch.steps`` holds this rank's micro-batches; entries
        of the other ranks' samples are None (the core merges the ranks' lists).
        """

    async def train(self, rollout_id: int, batch: TrainBatch) -> list[dict]:
        """Run one optimizer step per entry of ``batch.steps`` (micro-batches in order, one
        ``objective`` call and backward each, gradients summed over data-parallel ranks,
        then clip, step, LR schedule); return one metrics dict per step (objective metrics
        summed over micro-batches and ranks, plus ``grad_norm`` (pre-clip) and ``lr``),
        the same on every rank."""

    def train_forward_gives_old_log_probs(self) -> bool:
        """True when the training forward computes exactly what :meth:`log_probs` would, so
        pi_old can come from it (``--reuse-train-log-probs``) instead of a pass of its own.

        Default (inherited from this Protocol): False, the core runs the forward-only pass.
        """
        return False

    def layout(self) -> ParallelLayout:
        """This rank's place in the backend's parallelism; called after :meth:`init`.

        The core plans micro-batches per data-parallel rank and sends tensor/pipeline/
        context-parallel peers the same share; it keeps outputs of ranks with
        ``returns_outputs`` only. ``shares_prompts=True`` (default False) says the backend runs a
        prompt its micro-batch's samples share once, so the planner keeps prompt groups together.
        """

    def iter_weights(self) -> AsyncIterator[tuple[str, Any]]:
        """Yield ``(hf_name, tensor)`` one tensor at a time, for weight sync.

        A collective when the weights are sharded: every rank iterates, in the same
        order, yielding the same names with tensors of the full shape and dtype (their
        values matter on rank 0 only): each rank cuts the same buckets from them by
        ``--update-weight-buffer-size``, so the whole state dict is never held at once.
        """

    async def save(self, path: str) -> None: ...

    async def load(self, path: str) -> None: ...

    async def offload(self) -> None: ...

    async def onload(self) -> None: ...

    # Optional: ``async def save_hf(self, path: str) -> None`` writes the weights as a Hugging
    # Face model directory (``--save-hf``; every rank calls it). Backends built on
    # :class:`furlong.kit.trainer.StepLoop` inherit one; without it ``--save-hf`` is an error.
    # Optional: ``async def update_ref_model(self) -> None`` makes the reference model (the one
    # ``log_probs(model="ref")`` runs) a copy of the actor's current weights, LoRA merged
    # (``--ref-update-interval N``: the core calls it on every rank after training rollout r when
    # (r + 1) % N == 0). The built-in fsdp and megatron backends have it; without it
    # ``--ref-update-interval`` is an error naming the backend.
    # Optional: ``async def keep_synced_weights(self) -> None`` (``--keep-old-actor``): after each
    # weight sync (every rank) keep a copy of the weights just sent; ``log_probs(model="old_actor")``
    # then runs the copy kept at the sync before (StepLoop has it over two model copies).


@runtime_checkable
class CriticBackend(Protocol):
    """Trains a value model (the ppo critic) beside the actor. Built-in: ``fsdp``, ``megatron``.

    Returned by the ``critic_backend`` hook of the plugin ``--train-backend`` names; a train
    backend that implements that hook is one that can build a value model. The core drives it
    through a train group of its own (the actor's group class, role ``critic``) and checks
    every member below when the hook hands it over. Values are per response token and aligned
    like log-probs: ``V_t`` is read at the position that predicts response token ``t`` (the
    state before the token).
    """

    async def init(self, config: RunConfig) -> int:
        """Load the value model (``--critic-load`` when it is a Hugging Face directory, else the
        policy's ``--hf-checkpoint`` with a fresh value head) and its optimizer; return 0."""

    async def values(self, batch: TrainBatch) -> dict:
        """Forward-only pass; returns ``{"values": [...]}``, N float32 tensors [T_i] on the host
        (samples of other data-parallel ranks None, as :meth:`TrainBackend.log_probs`)."""

    async def train(self, rollout_id: int, batch: TrainBatch) -> list[dict]:
        """One optimizer step per entry of ``batch.steps``, as :meth:`TrainBackend.train`, calling
        ``batch.objective(ids, None, None, values=V)`` with V the current values [T_i] carrying
        grad (``batch.values`` holds the values at scoring time, ``batch.returns`` the targets)."""

    def layout(self) -> ParallelLayout:
        """This rank's place in the critic's parallelism, as :meth:`TrainBackend.layout`."""

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


@runtime_checkable
class WorkerGroup(Protocol):
    """The train workers an :class:`Executor` started, one per train rank.

    ``size``: the number of ranks. Workers are objects the core defines; the executor only
    places them and carries calls and results.
    """

    size: int

    async def call(self, method: str, args_per_rank: Sequence[tuple | None]) -> list:
        """Call ``method(*args_per_rank[r])`` on every worker ``r`` at once and wait for all.

        ``args_per_rank[r] is None`` skips rank ``r`` (its result is None). Results come
        back in rank order. Calls are issued in the order the driver makes them, so
        collectives inside the methods line up across ranks.

        :raises PluginError: a worker died, raised, or did not answer in time; the message
            names the worker (rank, where it ran) and the cause.
        """


@runtime_checkable
class Executor(Protocol):
    """Places the run's processes (``--executor``): train workers and rollout engines.

    ``is_driver``: False in processes that only serve train workers (``torchrun`` ranks
    above 0), which call :meth:`serve` instead of running the loop.
    ``weights_in_process``: True when train rank 0, the engines and the driver share one
    process, so weight buckets travel as tensors; otherwise they travel by broadcast over
    a weight-update process group.
    ``concurrent_train_groups`` (optional, default False): the worker groups of two
    :meth:`start_train_workers` calls (the actor's and a critic's) run in processes of their
    own, so the core keeps both in flight at once; False, it calls them in turn.
    """

    is_driver: bool
    weights_in_process: bool

    async def start_train_workers(self, config: RunConfig, make_worker: Callable[[int, int], Any]) -> WorkerGroup:
        """Start one worker per train rank; ``make_worker(rank, world)`` builds it where it runs.

        ``make_worker`` is picklable (an executor may send it to another process).
        """

    async def start_engines(self, config: RunConfig, make_engine: Callable[[int], Awaitable[RolloutEngine]]
                            ) -> list[RolloutEngine]:
        """Start the rollout engines; ``await make_engine(i)`` builds engine ``i`` where it runs.

        Returns objects meeting :class:`RolloutEngine` in the driver (proxies for remote ones).
        """

    # Optional: ``async def start_eval_engines(config, make_engine) -> list[RolloutEngine]`` starts the
    # dedicated eval fleet (``--eval-num-gpus``): ``config.eval_num_gpus // config.eval_num_gpus_per_engine``
    # engines on devices of their own, beside the rollout engines, as :meth:`start_engines` starts those
    # (``make_engine`` builds them from the fleet's configuration, ``config.eval_engine`` True). An executor
    # without it cannot run the fleet (the run stops naming it).

    async def start_rollout_side(self, config: RunConfig, make_rollout_side: Callable[[], Any]) -> Any:
        """Place the rollout side (data, rollout manager, rewards, eval): ``make_rollout_side()`` builds it.

        Returns it, or a handle with the same coroutine methods (``load_data``, ``start(engines,
        state)``, ``generate``, ``evaluate``, ``data_state``, ``pop_metrics``,
        ``set_weight_version``, ``progress``, ``dispose``) that runs them where it was placed.
        ``start`` receives the engines :meth:`start_engines` returned; ``evaluate(rollout_id, hf_dir=None,
        start=False)`` takes the same arguments as the side's.
        """

    async def serve(self) -> None:
        """Non-driver processes: run the driver's calls on this process's worker until the run ends."""

    async def shutdown(self) -> None:
        """Stop every process and actor the executor started (idempotent)."""
