"""The micro-batch loops every train backend runs the same way: log-prob passes and optimizer steps.

A backend subclasses :class:`StepLoop` and supplies the model-specific pieces (one forward
pass, the gradient norm and clipping, the learning rate and the optimizer step); the
loops here call them in one fixed order (forward-only log-prob passes before any step;
per step, gradients accumulated over every micro-batch, then clipping and the optimizer
step). The built-in ``fsdp`` and ``megatron`` backends use it; a third-party backend may.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Sequence

from .compute_thread import compute_turn, run_compute
from furlong.hooks.errors import PluginError
from furlong.hooks.rows import SplitRows, concat_rows, row_lengths
from furlong.hooks.types import TrainBatch

__all__ = ["StepLoop", "concatenated_ranges", "local_optimizer", "right_padded", "rows_to_device", "sum_step_metrics", "to_device"]

log = logging.getLogger("furlong")


def to_device(tensor, device):
    """``tensor`` on ``device``. A host tensor bound for a GPU is copied from pinned memory without
    blocking: the copy takes its place in the stream behind the kernels already queued, where a
    copy from pageable memory would make the host wait for all of them (the GPU then idles while
    the host queues the next kernels)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def rows_to_device(rows: Sequence[Any], device) -> list:
    """Tensors (one per sample) on ``device``, moved in one copy: concatenated, moved with
    :func:`to_device`, split again (views of the moved tensor, each of its row's shape). 1-D rows
    come back as a :class:`~furlong.hooks.rows.SplitRows` (rows already on ``device`` are
    concatenated all the same, so consumers read one tensor); rows of mixed dtypes move one by one."""
    import torch

    device = torch.device(device)
    if not len(rows) or len({r.dtype for r in rows}) > 1:
        return [r.to(device) for r in rows]
    flat = to_device(concat_rows(rows), device)
    if isinstance(rows, SplitRows) and flat is rows.flat:
        return rows
    lengths = row_lengths(rows)
    if all(r.dim() == 1 for r in rows):
        return SplitRows.of(flat, lengths)
    return [part.view(r.shape) for part, r in zip(flat.split(lengths), rows)]


def local_optimizer(optimizer):
    """The optimizer that holds this rank's state: the local optimizer of a torch
    ``ZeroRedundancyOptimizer`` (its parameters are this rank's share), else ``optimizer`` itself."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def right_padded(tokens: Sequence[Any], response_lengths: Sequence[int]):
    """The sequences of a micro-batch as int64 tensors and right-padded (with 0) in one ``[B, L]`` tensor.

    :returns: ``(seqs, ids)``: B int64 tensors ``[L_i]`` and the padded int64 ``[B, max L_i]`` (host).
    :raises ValueError: a sample whose response starts at position 0 (no previous token).
    """
    import torch

    seqs = [torch.as_tensor(t, dtype=torch.long).reshape(-1) for t in tokens]
    for i, (seq, t) in enumerate(zip(seqs, response_lengths)):
        if t > 0 and len(seq) - t < 1:
            raise ValueError(f"sample {i}: response_length {t} leaves no prompt token in {len(seq)} tokens")
    return seqs, torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)


def concatenated_ranges(starts, lengths):
    """``range(starts[i], starts[i] + lengths[i])`` for every ``i``, one after another, as one int64
    tensor ``[sum lengths]`` (built with tensor operations, no Python loop over the elements).

    :param starts: and :param lengths: int64 ``[N]``.
    """
    import torch

    offsets = lengths.cumsum(0) - lengths
    return torch.arange(int(lengths.sum())) + torch.repeat_interleave(starts - offsets, lengths)


def sum_step_metrics(losses: Sequence[Any], metric_rows: Sequence[dict]) -> tuple[dict[str, float], bool]:
    """The metrics of a step's micro-batches summed, and whether every loss was finite.

    Metrics may be floats or 0-dim tensors (the core's objective returns tensors, so that no
    micro-batch waits for the GPU); the tensors are summed where they lie and read with one
    synchronisation for the whole step.

    :param losses: the micro-batches' losses (0-dim tensors, detached).
    :param metric_rows: one ``{name: value}`` per micro-batch.
    :returns: ``({name: float sum}, every loss finite)``.
    """
    import torch

    sums: dict[str, Any] = defaultdict(float)
    for metrics in metric_rows:
        for key, value in metrics.items():
            sums[key] = sums[key] + value
    names = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]
    values = [sums[k].detach().reshape(()).double() for k in names]
    finite = [torch.stack([x.reshape(()).isfinite() for x in losses]).all()] if losses else []
    devices = {v.device for v in values + finite}
    if len(devices) == 1:  # one transfer
        read = torch.stack([*values, *(f.double() for f in finite)]).tolist()
    else:
        read = [float(v) for v in values] + [float(f) for f in finite]
    out = {k: float(v) for k, v in sums.items() if not isinstance(v, torch.Tensor)}
    out.update(zip(names, read))
    return out, bool(read[len(names)]) if finite else True


class StepLoop:
    """Base of a train backend: ``log_probs`` and ``train`` over the core's micro-batches.

    A subclass sets ``name``, ``config`` (the run's :class:`~furlong.hooks.RunConfig`), ``model``,
    ``ref_model``, ``optimizer``, ``device`` and ``global_step``, and implements :meth:`_forward`, :meth:`_clip`,
    :meth:`_learning_rate` and :meth:`_optimizer_step`; it may override
    :meth:`_dp_group` / :meth:`_dp_size` (default: the default process group, ``self.world``
    ranks; metrics are summed over it), :meth:`_before_train` and :meth:`_after_train`, and
    the micro-batch passes :meth:`_forward_chunks` and :meth:`_train_step` (a pipelined
    backend runs them through its schedule).
    """

    name = "backend"
    world = 1

    # --- pieces a backend supplies ---------------------------------------------------------

    def _forward(self, model, batch: TrainBatch, ids: list[int], grad: bool) -> tuple[list, list]:
        """One forward pass over samples ``ids``: per sample float32 log-probs and entropy ``[T_i]``."""
        raise NotImplementedError

    def _clip(self, finite_loss: bool) -> tuple[float, bool]:
        """Reduce gradients as the backend must, return ``(pre-clip global grad norm, all finite on every rank)``
        and clip to ``--clip-grad`` when finite."""
        raise NotImplementedError

    def _learning_rate(self) -> float:
        """The learning rate of the next optimizer step."""
        raise NotImplementedError

    def _optimizer_step(self, lr: float) -> None:
        """Apply the step at ``lr`` and advance the schedule."""
        raise NotImplementedError

    def train_forward_gives_old_log_probs(self) -> bool:
        """Whether a forward with grad computes the same log-probs as :meth:`log_probs` (no dropout or other
        train-only randomness), so that the core may take pi_old from the training forward of a rollout
        trained in one optimizer step (``--reuse-train-log-probs``). True here; a subclass whose training
        forward differs returns False.
        """
        return True

    async def _objective(self, batch: TrainBatch, ids: list[int], outputs: tuple):
        """``batch.objective`` on one micro-batch's :meth:`_forward` outputs: ``(log-probs, entropy)`` here; a
        critic (a :class:`furlong.hooks.CriticBackend` built on this loop) passes its values instead."""
        return await batch.objective(ids, *outputs)

    def _before_train(self) -> None:
        """Called at the start of :meth:`train` (e.g. switch to train mode)."""

    def _after_train(self) -> None:
        """Called at the end of :meth:`train`."""

    async def _in_thread(self, fn, *args, **kwargs):
        """Run ``fn`` in a worker thread (:func:`~furlong.kit.compute_thread.run_compute`) on this rank's
        CUDA device (the current device is per thread), holding the process's
        :func:`~furlong.kit.compute_thread.compute_turn`."""

        def call():
            if self.device.type == "cuda":
                import torch

                torch.cuda.set_device(self.device)
            with compute_turn():
                return fn(*args, **kwargs)

        return await run_compute(call)

    def _entropy_grad(self, grad: bool) -> bool:
        """Whether a forward keeps the entropy's graph: with grad, and only when ``--entropy-coef`` != 0."""
        return grad and float(self.config.entropy_coef or 0.0) != 0.0

    def _dp_group(self):
        """The data-parallel process group (None: the default group, every rank)."""
        return None

    def _dp_size(self) -> int:
        """Ranks of :meth:`_dp_group`."""
        return self.world

    def _sum_over_ranks(self, sums: dict[str, float]) -> dict[str, float]:
        """Metric sums of every data-parallel rank (all report the same keys: same loss plugin)."""
        if self._dp_size() == 1 or not sums:
            return dict(sums)
        import torch

        keys = sorted(sums)
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(values, group=self._dp_group())
        return dict(zip(keys, values.tolist()))

    async def offload(self) -> None:
        """Move weights and optimizer state to host memory (a no-op on CPU)."""
        if self.device.type == "cuda":
            await self._in_thread(self._move, "cpu")

    async def onload(self) -> None:
        """Move weights and optimizer state back to the GPU (a no-op on CPU)."""
        if self.device.type == "cuda":
            await self._in_thread(self._move, self.device)

    async def save_hf(self, path: str) -> None:
        """Write the weights of :meth:`iter_weights` as a Hugging Face model directory at ``path``
        (``--save-hf``), with the config and tokenizer of ``--hf-checkpoint``; every rank calls it
        (the iteration may be a collective), rank 0 writes.

        :raises PluginError: the export cannot be written (:func:`furlong.kit.hf.write_hf_checkpoint`).
        """
        import torch

        from .hf import write_hf_checkpoint

        writer = getattr(self, "rank", 0) == 0
        weights = {}
        async for name, tensor in self.iter_weights():
            if writer:
                weights[name] = tensor.to("cpu", copy=True)
        if writer:
            await self._in_thread(write_hf_checkpoint, path, weights, self.config.hf_checkpoint)
        if self.world > 1:
            torch.distributed.barrier()

    def _optimizer_state(self) -> dict:
        """This rank's optimizer state (parameter -> its state dict, :func:`local_optimizer`'s): what
        :meth:`offload` moves and ``--reset-optimizer-states`` clears. A backend whose optimizer keeps
        it elsewhere overrides this."""
        return local_optimizer(self.optimizer).state

    def _modules(self) -> list:
        """The modules :meth:`offload` and :meth:`onload` move: the model, the reference model and the copies
        ``--keep-old-actor`` keeps."""
        kept = (getattr(self, "old_actor", None), getattr(self, "rollout_actor", None))
        return [m for m in (self.model, self.ref_model, *kept) if m is not None]

    async def keep_synced_weights(self) -> None:
        """``--keep-old-actor``, after each weight sync (every rank): the old actor becomes the copy of the weights
        the engines had until now, and that copy takes the weights just sent (Miles' queue: rollout_actor ->
        old_actor, actor -> rollout_actor); at the first sync both take them. A subclass sets ``old_actor`` and
        ``rollout_actor`` to two copies of its model (built alike) and implements :meth:`_copy_actor_into`."""
        first = getattr(self, "_synced_once", False) is False
        self.old_actor, self.rollout_actor = self.rollout_actor, self.old_actor
        await self._copy_actor_into(self.rollout_actor)
        if first:
            await self._copy_actor_into(self.old_actor)
        self._synced_once = True

    async def _copy_actor_into(self, target) -> None:
        """Load the actor's current weights into ``target``, a copy of the model built alike."""
        raise NotImplementedError

    def _move(self, device) -> None:
        import torch

        for model in self._modules():
            model.to(device)
        masters = getattr(self, "masters", None)  # float32 master weights (furlong.kit.master_weights)
        if masters is not None:
            masters.to(device)
        for state in self._optimizer_state().values():
            for key, value in state.items():
                if torch.is_tensor(value) and key != "step":
                    state[key] = value.to(device, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    # --- the loops ---------------------------------------------------------------------------

    async def log_probs(self, batch: TrainBatch, model: str = "actor") -> dict:
        """Forward-only log-probs and entropy of every response token.

        Micro-batches: those of ``batch.steps`` (this rank's samples, so every rank runs
        the same number of passes); with no steps, all samples in chunks of
        ``--micro-batch-size``. Logits are divided by ``batch.temperature``.

        :param model: ``"actor"``, ``"ref"`` or ``"old_actor"`` (``--keep-old-actor``: the weights the engines
            had before the last weight sync, :meth:`keep_synced_weights`).
        :returns: ``{"log_probs": [...], "entropy": [...]}``, N entries each (float32
            ``[T_i]`` on the host); samples of other ranks are None.
        :raises PluginError: ``model="ref"`` without a reference model.
        """
        import torch

        net = {"actor": self.model, "ref": self.ref_model, "old_actor": getattr(self, "old_actor", None)}.get(model)
        if net is None:
            needs = ("the old actor loads only with --keep-old-actor" if model == "old_actor" else
                     "the reference loads only with --use-kl-loss or --kl-coef != 0")
            raise PluginError(f"{self.name}: log_probs(model={model!r}) but no such model is loaded ({needs}).")
        n = len(batch.tokens)
        if batch.steps:
            chunks = [list(mb) for step in batch.steps for mb in step]
        else:
            size = max(1, int(self.config.micro_batch_size or 1))
            chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        log_probs: list = [None] * n
        entropy: list = [None] * n
        for ids, lp, ent in await self._forward_chunks(net, batch, chunks):
            for i, a, b in zip(ids, lp, ent):
                log_probs[i], entropy[i] = a.detach().to("cpu", torch.float32), b.detach().to("cpu", torch.float32)
        return {"log_probs": log_probs, "entropy": entropy}

    async def _forward_chunks(self, net, batch: TrainBatch, chunks: list[list[int]]) -> list[tuple]:
        """Forward-only passes over ``chunks`` (sample ids each): ``(ids, log_probs, entropy)`` per chunk
        whose outputs this rank holds (:meth:`_forward` per chunk here; a pipelined backend overrides it)."""
        return [(ids, *await self._in_thread(self._forward, net, batch, ids, False)) for ids in chunks]

    async def _train_step(self, batch: TrainBatch, micro_batches) -> tuple[dict, bool]:
        """Forward with grad, ``batch.objective`` and backward of every micro-batch of one step
        (gradients accumulate); this rank's metric sums and whether every loss was finite."""
        losses, metric_rows = [], []
        for mb in micro_batches:
            outputs = await self._in_thread(self._forward, self.model, batch, list(mb), True)
            loss, metrics = await self._objective(batch, list(mb), outputs)
            await self._in_thread(loss.backward)
            losses.append(loss.detach())
            metric_rows.append(metrics)
        return await self._in_thread(sum_step_metrics, losses, metric_rows)

    async def train(self, rollout_id: int, batch: TrainBatch) -> list[dict]:
        """One optimizer step per entry of ``batch.steps``.

        Per step: zero grads; per micro-batch a forward with grad, ``batch.objective``,
        backward (gradients accumulate); the metric sums over ranks; :meth:`_clip`
        (reduction, global grad norm before clipping, non-finite check, clipping); the
        scheduled learning rate and the optimizer step.

        :returns: per step, the objective's metrics summed over micro-batches and ranks
            (each rank's share already carries the whole step's denominators, so the sum
            is the step's value) plus ``grad_norm`` and ``lr``; the same on every rank. On
            CUDA also ``peak_memory_gib``: this rank's peak allocated GPU memory (GiB) since
            the call began (logged as ``train/peak_memory_gib``).
        :raises FloatingPointError: a non-finite loss or gradient, unless
            ``--no-check-for-nan-in-loss-and-grad`` (then the step and its LR advance are
            skipped, with a warning).
        """
        if self.config.reset_optimizer_states:
            self._optimizer_state().clear()
        self._before_train()
        cuda = self.device.type == "cuda"
        if cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
        results = []
        for s, micro_batches in enumerate(batch.steps):
            self.optimizer.zero_grad(set_to_none=True)
            sums, finite_loss = await self._train_step(batch, micro_batches)
            sums = await self._in_thread(self._sum_over_ranks, sums)
            grad_norm, finite = await self._in_thread(self._clip, finite_loss)
            lr = self._learning_rate()
            if not finite:
                message = (f"{self.name}: rollout {rollout_id} step {s}: non-finite loss or gradient (grad norm "
                           f"{grad_norm}); lower --lr, check rewards and data, or pass "
                           "--no-check-for-nan-in-loss-and-grad to skip such steps.")
                if self.config.check_for_nan_in_loss_and_grad:  # --no-check-for-nan-in-loss-and-grad sets it False
                    raise FloatingPointError(message)
                log.warning("%s Step skipped.", message)
                self.optimizer.zero_grad(set_to_none=True)
            else:
                await self._in_thread(self._optimizer_step, lr)
                self.global_step += 1
            results.append({**sums, "grad_norm": grad_norm, "lr": lr})
            if cuda:
                results[-1]["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.optimizer.zero_grad(set_to_none=True)
        self._after_train()
        return results
