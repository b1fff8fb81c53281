"""One train rank: the train backend plus the loss objective, driven by the driver's :class:`TrainGroup`.

A worker runs wherever the executor put it: in the driver's process (``--executor
local``), in a ``torchrun`` process, or in a Ray actor. Everything it receives is plain
and picklable: the launch flags, the names of the chosen plugins, its share of the batch
(:class:`WorkerShare`) and the step denominators. It builds its own plugin manager (unless
the driver's is handed to it in-process) and its own :class:`~furlong.core.train.objective.StepObjective`,
so nothing that holds a plugin manager ever travels between processes. It runs forward,
backward and optimizer steps; the driver does everything else (docs/architecture.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any, AsyncIterator

import attrs

from furlong.hooks import ParallelLayout, PluginError, RunConfig, TrainBatch, WeightBucket
from furlong.kit.dist import broadcast_bucket, free_port, host_address, new_weight_update_group

from .objective import StepObjective
from .reduction import StepDenominators
from ..plugins.selection import plugins_of_this_process

__all__ = ["TrainWorker", "WorkerFactory", "WorkerShare"]

log = logging.getLogger("furlong.train")


# the members the core calls, checked when the hook hands a backend over: a TrainBackend (role "actor",
# hook train_backend) or a CriticBackend (role "critic", hook critic_backend)
BACKEND_METHODS = {
    "actor": ("init", "log_probs", "train", "train_forward_gives_old_log_probs", "layout", "iter_weights", "save",
              "load", "offload", "onload"),
    "critic": ("init", "values", "train", "layout", "save", "load", "offload", "onload"),
}
ROLE_HOOKS = {"actor": ("train_backend", "furlong.hooks.TrainBackend"),
              "critic": ("critic_backend", "furlong.hooks.CriticBackend")}
# optional TrainBackend methods (furlong.hooks.TrainBackend), each needed by one flag: what it does
OPTIONAL_METHODS = {"save_hf": "it cannot export Hugging Face weights",
                    "update_ref_model": "it cannot copy the actor's weights into its reference model",
                    "keep_synced_weights": "it keeps no copy of the weights the engines generate with"}
CRITIC_LOSS = "value_loss"
"""The loss plugin a critic trains with (the clipped value loss, ``--value-clip``)."""


@attrs.define
class WorkerShare:
    """A data-parallel rank's share of one rollout batch.

    ``batch``: a :class:`TrainBatch` of the share's samples only (local indices ``0..n-1``;
    ``batch.steps`` this rank's micro-batches in local indices). ``sample_ids``: each
    local sample's index in the whole rollout batch. ``step_denominators``: one per
    step, over every rank's samples; ``sample_denominators``/``trajectory_ids``: per local
    sample, computed on the whole batch. ``reuse_old_log_probs``: pi_old is the
    training forward's (``batch.old_log_probs`` is None; :meth:`TrainWorker.train_log_probs`
    returns them after training). ``metric_step_denominators``: one per step over the samples the
    ranks train (``--skip-zero-advantage-samples`` leaves some out), for every metric but the loss
    terms; empty: the step denominators. ``trainer_log_probs``: per local sample, pi_old as the trainer's
    forward-only pass computed it when pi_old is the engine's (``--use-rollout-logprobs`` with
    ``--get-mismatch-metrics``), else None.
    """

    batch: TrainBatch
    sample_ids: list
    step_denominators: list[StepDenominators] = attrs.field(factory=list)
    sample_denominators: list[float] = attrs.field(factory=list)
    trajectory_ids: list[int] = attrs.field(factory=list)
    reuse_old_log_probs: bool = False
    metric_step_denominators: list[StepDenominators] = attrs.field(factory=list)
    trainer_log_probs: list | None = None


class TrainWorker:
    """The worker side of the execution seam, one per train rank.

    :param config: the run configuration (picklable).
    :param chosen: ``{hook: (plugin name, flag)}`` for ``train_backend`` and ``loss``.
    :param rank: this train rank; :param world: the number of train ranks.
    :param pm: the driver's plugin manager when the worker runs in the driver's process;
        None builds one from the installed entry points (with ``--disable-plugins``).
    :param role: ``"actor"`` (the policy, from the ``train_backend`` hook, trained with the chosen
        loss) or ``"critic"`` (the value model, from the ``critic_backend`` hook of the same plugin,
        trained with :data:`CRITIC_LOSS`).
    """

    def __init__(self, config: RunConfig, chosen: dict[str, tuple[str, str]], rank: int, world: int,
                 pm: Any = None, role: str = "actor") -> None:
        self.config, self.chosen, self.rank, self.world, self.pm = config, dict(chosen), rank, world, pm
        self.role = role
        self.backend = None
        self._weights: AsyncIterator | None = None
        self._held: tuple | None = None
        self._held_tensors: list = []
        self._weight_groups: dict[str, Any] = {}
        self._train_log_probs: dict | None = None

    async def init(self) -> tuple[int, ParallelLayout]:
        """Create and initialize the backend; return ``(start rollout id, layout)``."""
        if self.pm is None:  # a process of its own (a Ray actor)
            self.pm = plugins_of_this_process(self.config, hooks=("train_backend", "loss", "tis_function"))
        name, flag = self.chosen["train_backend"]
        hook, protocol = ROLE_HOOKS[self.role]
        self.backend = await self.pm.call_chosen(hook, name, flag, config=self.config)
        missing = [m for m in BACKEND_METHODS[self.role] if not callable(getattr(self.backend, m, None))]
        if missing:
            raise PluginError(f"{flag} '{name}': the backend its `{hook}` returned ({type(self.backend).__name__}) "
                              f"lacks {', '.join(missing)} (see {protocol}"
                              + ("; subclassing it gives the documented default of "
                                 "train_forward_gives_old_log_probs)." if self.role == "actor" else ")."))
        start = await self.backend.init(self.config)
        layout = self.backend.layout()
        if not isinstance(layout, ParallelLayout):
            raise PluginError(f"{flag} '{name}': layout() returned {type(layout).__name__}; "
                              "it must return furlong.hooks.ParallelLayout.")
        optional = {"save_hf": self.config.save_hf and "--save-hf",
                    "update_ref_model": self.config.ref_update_interval and "--ref-update-interval",
                    "keep_synced_weights": self.config.keep_old_actor and "--keep-old-actor"}
        if self.role == "actor":
            for method, flag_given in optional.items():
                if flag_given and not callable(getattr(self.backend, method, None)):
                    raise PluginError(f"{flag_given}: {flag} '{name}' has no {method}() method "
                                      f"({OPTIONAL_METHODS[method]}); drop {flag_given} or use a backend that has "
                                      "one (fsdp, megatron).")
        return int(start or 0), layout

    async def log_probs(self, share: WorkerShare, model: str) -> dict | None:
        """Forward-only log-probs (and entropy) of the share's samples, local order."""
        out = await self.backend.log_probs(share.batch, model=model)
        return {"log_probs": out["log_probs"], "entropy": out.get("entropy")}

    async def values(self, share: WorkerShare) -> dict:
        """Forward-only critic values of the share's samples, local order (role ``critic``)."""
        out = await self.backend.values(share.batch)
        return {"log_probs": out["values"]}

    async def train_forward_gives_old_log_probs(self) -> bool:
        """Whether the backend's training forward equals its log-prob pass (its ``train_forward_gives_old_log_probs()``)."""
        return bool(self.backend.train_forward_gives_old_log_probs())

    async def train(self, rollout_id: int, share: WorkerShare) -> list[dict]:
        """The rollout's optimizer steps on this share; per-step metrics (summed over ranks by the backend)."""
        if self.role == "critic":
            loss_name, loss_flag = CRITIC_LOSS, "--advantage-estimator"
        else:
            loss_name, loss_flag = self.chosen["loss"]
        objective = StepObjective(
            self.config, self.pm, share.batch, loss_name, loss_flag, trajectory_ids=share.trajectory_ids,
            step_denominators=share.step_denominators, sample_denominators=share.sample_denominators,
            reuse_old_log_probs=share.reuse_old_log_probs, old_values=share.batch.values,
            metric_step_denominators=share.metric_step_denominators or None, reducer=self.role == "actor",
            trainer_log_probs=share.trainer_log_probs)
        share.batch.objective = objective
        self._train_log_probs = None
        try:
            steps = await self.backend.train(rollout_id, share.batch)
        finally:
            share.batch.objective = None
        if share.reuse_old_log_probs:
            entropy = None if any(e is None for e in objective.entropy) else objective.entropy
            self._train_log_probs = {"log_probs": objective.old_log_probs, "entropy": entropy}
        return steps

    async def train_log_probs(self, share: WorkerShare) -> dict:
        """pi_old and entropy the last :meth:`train` took from its training forward (``reuse_old_log_probs``),
        local order, in the form of :meth:`log_probs`; consumed by this call.

        :raises PluginError: the last train did not reuse its forward's log-probs.
        """
        out, self._train_log_probs = self._train_log_probs, None
        if out is None:
            name, flag = self.chosen["train_backend"]
            raise PluginError(f"{flag} '{name}': no log-probs kept from the last training forward (it ran "
                              "without reuse_old_log_probs).")
        return out

    async def save(self, path: str) -> None:
        await self.backend.save(path)

    async def update_ref_model(self) -> None:
        """The reference model takes the actor's current weights (``--ref-update-interval``)."""
        await self.backend.update_ref_model()

    async def keep_synced_weights(self) -> None:
        """After a weight sync (``--keep-old-actor``): the backend keeps a copy of the weights just sent."""
        await self.backend.keep_synced_weights()

    async def save_hf(self, path: str) -> None:
        await self.backend.save_hf(path)

    async def load(self, path: str) -> None:
        await self.backend.load(path)

    async def offload(self) -> None:
        await self.backend.offload()

    async def onload(self) -> None:
        await self.backend.onload()

    async def clear_memory(self) -> None:
        """Return cached accelerator memory to the device (a no-op without CUDA).

        The garbage collection that frees unreachable tensors first runs only with CUDA: a
        full ``gc.collect`` costs about 0.2 s per rollout in a process holding transformers.
        """
        import gc

        import torch

        if torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()

    # --- weight sync ----------------------------------------------------------------------

    async def begin_weights(self) -> None:
        """Start a new pass over the backend's weights (every rank: it may be a collective)."""
        self._weights = aiter(self.backend.iter_weights())
        self._held = None

    async def next_weight_bucket(self, max_bytes: int, with_tensors: bool) -> WeightBucket | None:
        """The next bucket of at most ``max_bytes`` (one tensor larger than that is a bucket alone).

        Rank 0 keeps the bucket's tensors for :meth:`broadcast_weight_bucket` and returns
        them too when ``with_tensors`` (in-process transport); other ranks return None.
        Returns None on rank 0 once every tensor was sent.
        """
        names, tensors, size = [], [], 0
        pending = self._held
        self._held = None
        while True:
            if pending is None:
                try:
                    pending = await anext(self._weights)
                except StopAsyncIteration:
                    break
            name, tensor = pending
            nbytes = tensor.numel() * tensor.element_size()
            if tensors and size + nbytes > max_bytes:
                self._held = pending  # starts the next bucket
                break
            names.append(name)
            tensors.append(tensor.detach())
            size += nbytes
            pending = None
        if self.rank != 0:
            return None
        if not names:
            self._weights = None
            return None
        bucket = WeightBucket(names=names, dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
                              shapes=[list(t.shape) for t in tensors])
        self._held_tensors = tensors
        if with_tensors:
            bucket.tensors = tensors
        return bucket

    async def weight_group_address(self) -> tuple[str, int]:
        """``(host, free port)`` for the weight-update group's rendezvous (rank 0 hosts it)."""
        return host_address(), free_port()

    async def join_weight_group(self, address: str, port: int, world_size: int, group_name: str, backend: str,
                                timeout_s: float) -> None:
        """Join the weight-update group as its rank 0 (the engines join concurrently)."""
        import asyncio

        group = await asyncio.to_thread(new_weight_update_group, address, port, 0, world_size, group_name, backend,
                                        timeout_s)
        self._weight_groups[group_name] = (group, backend)

    async def leave_weight_group(self, group_name: str) -> None:
        group, _ = self._weight_groups.pop(group_name, (None, None))
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(group)

    async def broadcast_weight_bucket(self, group_name: str) -> None:
        """Broadcast the tensors of the bucket :meth:`next_weight_bucket` returned last (rank 0).

        NCCL sends from the GPU, gloo from host memory: tensors move to where the group's
        backend needs them.
        """
        import asyncio

        group, backend = self._weight_groups[group_name]
        device = "cuda" if backend == "nccl" else "cpu"
        tensors = [t.to(device) for t in self._held_tensors]
        await asyncio.to_thread(broadcast_bucket, tensors, group)
        self._held_tensors = []


class WorkerFactory:
    """``make_worker(rank, world)`` for :meth:`furlong.hooks.Executor.start_train_workers`.

    Picklable: the plugin manager is kept only while the factory stays in the driver's
    process; a copy sent to another process builds workers with their own manager.
    """

    def __init__(self, config: RunConfig, chosen: dict[str, tuple[str, str]], pm: Any = None,
                 role: str = "actor") -> None:
        self.config, self.chosen, self.pm, self.role = config, chosen, pm, role

    def __call__(self, rank: int, world: int) -> TrainWorker:
        """Build rank ``rank``'s worker in this (the worker's) process, after setting ``--train-env-vars`` there."""
        os.environ.update({str(k): str(v) for k, v in self.config.train_env_vars.items()})
        return TrainWorker(self.config, self.chosen, rank, world, self.pm, self.role)

    def __getstate__(self) -> dict:
        return {"config": self.config, "chosen": self.chosen, "pm": None, "role": self.role}
