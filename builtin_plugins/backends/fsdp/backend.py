"""The fsdp train backend: a transformers causal LM trained with torch, FSDP2 across ranks."""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections import defaultdict
from typing import Any

from furlong.hooks import ParallelLayout, PluginError, TrainBatch

from . import checkpoint
from .logprobs import forward_log_probs
from .model import build_optimizer, dist_info, is_hf_dir, load_causal_lm, shard, tied_names
from .schedule import LRSchedule

__all__ = ["FSDPBackend"]

log = logging.getLogger("furlong.backends.fsdp")


class FSDPBackend:
    """A :class:`furlong.hooks.TrainBackend` over a Hugging Face model (see PLUGINS.md, "Built-in plugins").

    Single process: plain torch on CPU (float32) or one GPU (bfloat16 autocast with
    ``--bf16``). With ``torch.distributed`` initialized over several ranks: FSDP2
    ``fully_shard`` per decoder layer and on the whole model, gradients SUMMED over ranks.
    The model stays in eval mode (no dropout) so training log-probs equal the old
    log-probs bit for bit at the first step; with ``--gradient-checkpointing`` it runs in
    train mode, which needs a dropout-free config.
    """

    def __init__(self, args: Any) -> None:
        self.args = args
        self.model = None
        self.ref_model = None
        self.optimizer = None
        self.schedule: LRSchedule | None = None
        self.tokenizer = None
        self.global_step = 0
        self.world, self.rank = 1, 0
        self.device = None
        self._tied: set[str] = set()

    # --- set-up -------------------------------------------------------------------------

    async def init(self, args: Any) -> int:
        """Load actor (and reference), build optimizer and LR schedule; return 0.

        Warm start (SPEC.md 7.2): actor weights from ``--ref-load`` when it is a Hugging
        Face directory, else ``--hf-checkpoint``. The reference (``--use-kl-loss`` or
        ``--kl-coef`` != 0) loads from the same place and never trains. Resume is the
        core's job: it calls :meth:`load` and decides the start rollout id.

        :raises PluginError: an unloadable checkpoint or bad optimizer flags.
        """
        import torch
        from transformers import AutoTokenizer

        self.args = args
        ignored = list(getattr(args, "megatron_flags_given", None) or [])
        if ignored:
            log.warning("fsdp backend ignores these Megatron flags (no FSDP meaning): %s", " ".join(ignored))
        self.world, self.rank = dist_info(args)
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", 0))
            if local >= torch.cuda.device_count():  # e.g. one visible GPU per Ray actor
                local = torch.cuda.current_device()
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        source, flag = (args.ref_load, "--ref-load") if is_hf_dir(getattr(args, "ref_load", None)) else (
            args.hf_checkpoint, "--hf-checkpoint")
        self.model = self._place(load_causal_lm(source, args, self.device, flag), trainable=True)
        if getattr(args, "use_kl_loss", False) or getattr(args, "kl_coef", 0.0):
            ref = load_causal_lm(source, args, self.device, flag).requires_grad_(False)
            self.ref_model = self._place(ref, trainable=False)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        except (OSError, ValueError):
            log.warning("fsdp: no tokenizer in %s; checkpoints will hold weights and config only", args.hf_checkpoint)
        self.optimizer = build_optimizer(self.model, args)
        self.schedule = LRSchedule.from_args(args)
        if self.rank == 0:
            log.info("fsdp optimizer: %s, weight decay %s, clip %s, schedule %s", type(self.optimizer).__name__,
                     getattr(args, "weight_decay", None), getattr(args, "clip_grad", None), self.schedule)
        return 0

    def _place(self, model, *, trainable: bool):
        if not trainable or not getattr(self.args, "gradient_checkpointing", False):
            model.eval()
        if trainable:
            self._tied = tied_names(model)
        if self.world > 1:
            shard(model, self.args, self.world, self.device, trainable=trainable)
            return model
        return model.to(self.device)

    async def _in_thread(self, fn, *args, **kwargs):
        """Run ``fn`` in a worker thread on this rank's CUDA device (the current device is per thread)."""

        def call():
            if self.device.type == "cuda":
                import torch

                torch.cuda.set_device(self.device)
            return fn(*args, **kwargs)

        return await asyncio.to_thread(call)

    def _autocast(self):
        import torch

        if self.device.type == "cuda" and self.world == 1 and getattr(self.args, "bf16", False):
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return None

    # --- forward passes -----------------------------------------------------------------

    def _forward(self, model, batch: TrainBatch, ids: list[int], grad: bool):
        entropy_grad = grad and float(getattr(self.args, "entropy_coef", 0.0) or 0.0) != 0.0
        return forward_log_probs(
            model, [batch.tokens[i] for i in ids], [int(batch.response_lengths[i]) for i in ids], batch.temperature,
            self.device, grad=grad, entropy_grad=entropy_grad, autocast=self._autocast(),
        )

    async def log_probs(self, batch: TrainBatch, model: str = "actor") -> dict:
        """Forward-only log-probs and entropy of every response token (SPEC.md 6.1).

        Micro-batches: those of ``batch.steps`` (this rank's samples, so every rank runs
        the same number of passes); with no steps, all samples in chunks of
        ``--micro-batch-size``. Logits are divided by ``batch.temperature``.

        :param model: ``"actor"`` or ``"ref"``.
        :returns: ``{"log_probs": [...], "entropy": [...]}``, N entries each (float32
            ``[T_i]`` on the host); samples of other ranks are None.
        :raises PluginError: ``model="ref"`` without a reference model.
        """
        import torch

        net = {"actor": self.model, "ref": self.ref_model}.get(model)
        if net is None:
            raise PluginError(f"fsdp: log_probs(model={model!r}) but no such model is loaded "
                              "(the reference loads only with --use-kl-loss or --kl-coef != 0).")
        n = len(batch.tokens)
        if batch.steps:
            chunks = [list(mb) for step in batch.steps for mb in step]
        else:
            size = max(1, int(getattr(self.args, "micro_batch_size", 1) or 1))
            chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        log_probs: list = [None] * n
        entropy: list = [None] * n
        for ids in chunks:
            lp, ent = await self._in_thread(self._forward, net, batch, ids, False)
            for i, a, b in zip(ids, lp, ent):
                log_probs[i], entropy[i] = a.detach().to("cpu", torch.float32), b.detach().to("cpu", torch.float32)
        return {"log_probs": log_probs, "entropy": entropy}

    # --- training -----------------------------------------------------------------------

    async def train(self, rollout_id: int, batch: TrainBatch) -> list[dict]:
        """One optimizer step per entry of ``batch.steps`` (SPEC.md 6.3, 6.4).

        Per step: zero grads; per micro-batch a forward with grad, ``batch.objective``,
        backward (gradients accumulate; FSDP2 sums them over ranks); then the global grad
        norm (pre-clip), a non-finite check, clipping to ``--clip-grad`` (0 = off), the
        learning rate of the schedule at this step, and the optimizer step.

        :returns: per step, the objective's metrics summed over micro-batches and ranks
            (each rank's share already carries the whole step's denominators, so the sum
            is the step's value) plus ``grad_norm`` and ``lr``; the same on every rank. On
            CUDA also ``peak_memory_gib``: this rank's peak allocated GPU memory (GiB) since
            the call began (logged as ``train/peak_memory_gib``).
        :raises FloatingPointError: a non-finite loss or gradient, unless
            ``--no-check-for-nan-in-loss-and-grad`` (then the step and its LR advance are
            skipped, with a warning).
        """
        if getattr(self.args, "reset_optimizer_states", False):
            self.optimizer.state.clear()
        if getattr(self.args, "gradient_checkpointing", False):
            self.model.train()
        cuda = self.device.type == "cuda"
        if cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
        results = []
        for s, micro_batches in enumerate(batch.steps):
            self.optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = defaultdict(float)
            finite_loss = True
            for mb in micro_batches:
                lp, ent = await self._in_thread(self._forward, self.model, batch, list(mb), True)
                loss, metrics = await batch.objective(list(mb), lp, ent)
                finite_loss &= bool(loss.detach().isfinite().all())
                await self._in_thread(loss.backward)
                for key, value in metrics.items():
                    sums[key] += float(value)
            sums = await self._in_thread(self._sum_over_ranks, sums)
            grad_norm, finite = await self._in_thread(self._clip, finite_loss)
            lr = self.schedule(self.global_step)
            if not finite:
                message = (f"fsdp: rollout {rollout_id} step {s}: non-finite loss or gradient (grad norm {grad_norm}); "
                           "lower --lr, check rewards and data, or pass --no-check-for-nan-in-loss-and-grad to skip "
                           "such steps.")
                if not getattr(self.args, "no_check_for_nan_in_loss_and_grad", False):
                    raise FloatingPointError(message)
                log.warning("%s Step skipped.", message)
                self.optimizer.zero_grad(set_to_none=True)
            else:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                await self._in_thread(self.optimizer.step)
                self.global_step += 1
            results.append({**sums, "grad_norm": grad_norm, "lr": lr})
            if cuda:
                results[-1]["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.optimizer.zero_grad(set_to_none=True)
        if getattr(self.args, "gradient_checkpointing", False):
            self.model.eval()
        return results

    def _sum_over_ranks(self, sums: dict[str, float]) -> dict[str, float]:
        """Metric sums of every rank (all ranks report the same keys: same loss plugin)."""
        if self.world == 1 or not sums:
            return dict(sums)
        import torch

        keys = sorted(sums)
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(values)
        return dict(zip(keys, values.tolist()))

    def _clip(self, finite_loss: bool) -> tuple[float, bool]:
        """Global grad L2 norm before clipping, and whether loss and gradients are finite on every rank."""
        import torch

        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = float(getattr(self.args, "clip_grad", 1.0) or 0.0)
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf) if params else torch.tensor(0.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm = float(norm)
        flag = torch.tensor([0.0 if finite_loss else 1.0], device=self.device)
        if self.world > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return norm, math.isfinite(norm) and float(flag) == 0.0

    # --- weights and checkpoints ---------------------------------------------------------

    def layout(self) -> ParallelLayout:
        """Every rank is a data-parallel rank of its own (FSDP shards parameters, not data)."""
        return ParallelLayout(dp_rank=self.rank, dp_size=self.world, returns_outputs=True, rank=self.rank,
                              world=self.world)

    async def iter_weights(self):
        """Yield ``(hf_name, tensor)`` one parameter or buffer at a time (tied aliases left out).

        Under FSDP2 each sharded tensor is gathered in full on every rank as it is
        yielded (a collective: every rank iterates). Single process: detached views of
        the live weights; copy them before the next :meth:`train`.
        """
        for name, tensor in self.model.state_dict().items():
            if name in self._tied:
                continue
            if hasattr(tensor, "full_tensor"):
                tensor = await self._in_thread(tensor.full_tensor)
            yield name, tensor.detach()

    async def named_weights(self) -> list[tuple[str, Any]]:
        """Every tensor of :meth:`iter_weights` in one list (tests and tools; weight sync streams)."""
        return [(name, tensor) async for name, tensor in self.iter_weights()]

    async def save(self, path: str) -> None:
        """Write the checkpoint into ``path`` (layout in :mod:`.checkpoint`); every rank calls it.

        ``--no-save-optim`` leaves out ``optimizer.pt`` (optimizer and scheduler).
        """
        await self._in_thread(
            checkpoint.save_checkpoint, path, model=self.model, optimizer=self.optimizer, tokenizer=self.tokenizer,
            global_step=self.global_step, world=self.world, rank=self.rank, tied=self._tied,
            save_optim=not getattr(self.args, "no_save_optim", False),
        )

    async def load(self, path: str) -> None:
        """Restore weights, optimizer (unless ``--no-load-optim``), global step, RNG (unless ``--no-load-rng``).

        The global step (which sets the LR schedule position) always comes from
        ``meta.json``; with ``--no-load-optim`` Adam's moments start fresh.

        :raises PluginError: ``path`` is not an fsdp checkpoint.
        """
        meta = checkpoint.read_meta(path)
        await self._in_thread(checkpoint.load_weights, path, self.model, self.world, self.rank, self._tied)
        if not getattr(self.args, "no_load_optim", False):
            found = await self._in_thread(checkpoint.load_optimizer, path, self.model, self.optimizer, self.world,
                                            self.rank)
            if not found and self.rank == 0:
                log.warning("fsdp: %s has no optimizer.pt (saved with --no-save-optim); Adam starts fresh", path)
        self.global_step = int(meta["global_step"])
        if not getattr(self.args, "no_load_rng", False):
            checkpoint.load_rng(path, self.rank)

    async def offload(self) -> None:
        """Move weights and optimizer state to host memory (a no-op on CPU)."""
        if self.device.type == "cuda":
            await self._in_thread(self._move, "cpu")

    async def onload(self) -> None:
        """Move weights and optimizer state back to the GPU (a no-op on CPU)."""
        if self.device.type == "cuda":
            await self._in_thread(self._move, self.device)

    def _move(self, device) -> None:
        import torch

        for model in (self.model, self.ref_model):
            if model is not None:
                model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and key != "step":
                    state[key] = value.to(device, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

