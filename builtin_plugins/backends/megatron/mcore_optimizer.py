"""megatron-core's own data-parallel wrapper and distributed optimizer for the megatron backend.

``--use-distributed-optimizer`` with ``--optimizer-cpu-offload`` or ``--use-precision-aware-optimizer``
(the features Miles' launch scripts pass together) runs the model under megatron-core's
``DistributedDataParallel`` (gradients accumulate in float32 buffers, ``main_grad``, and are
reduce-scattered over the data-parallel x context-parallel ranks) and megatron-core's
``DistributedOptimizer`` (float32 master weights and AdamW moments sharded over those ranks;
bfloat16 weights all-gathered after each step), built by ``get_megatron_optimizer`` from an
``OptimizerConfig``: with ``--optimizer-cpu-offload`` its ``HybridDeviceOptimizer`` keeps the
masters and moments of ``--optimizer-offload-fraction`` of the parameters in host memory and
steps them with torch's CPU AdamW (``--overlap-cpu-optimizer-d2h-h2d``: copies on side streams).

The step is the backend's usual one: gradients SUMMED over data-parallel ranks (each rank's
objective already carries the whole step's denominators, so the wrapper's 1 / DP scaling is
turned off), the query/key-norm and sequence-parallel norm gradients summed over TP as the
backend does without this wrapper, megatron-core's global L2 norm (TP shards and pipeline stages
counted once), clipping to ``--clip-grad``, AdamW with megatron-core's decay rule (no decay on
biases and 1-D parameters, the same as :func:`~.optimizer.build_optimizer`).

megatron-core allocates these buffers on the current CUDA device and checks for CUDA tensors, so
this path needs a GPU.
"""

from __future__ import annotations

import copy
from typing import Any

from furlong.hooks import PluginError

from .moe import flag

__all__ = ["MegatronCoreOptimizer", "OPTIMIZER_DESTS", "PRECISION_AWARE_WITHOUT_TE", "asked_features",
           "chooses_mcore_optimizer", "idle_offload_flags", "masters_follow_loaded_state", "mcore_optimizer_problems",
           "offload_optimizer_state", "onload_optimizer_state", "own_adamw_reason", "precision_aware",
           "state_for_loading", "uses_mcore_optimizer"]

_FEATURES = ("--optimizer-cpu-offload", "--use-precision-aware-optimizer")
_OFFLOAD_REFINEMENTS = {"--overlap-cpu-optimizer-d2h-h2d": "overlap_cpu_optimizer_d2h_h2d",
                        "--optimizer-offload-fraction": "optimizer_offload_fraction",
                        "--use-torch-optimizer-for-cpu-offload": "use_torch_optimizer_for_cpu_offload",
                        "--no-pin-cpu-grads": "pin_cpu_grads", "--no-pin-cpu-params": "pin_cpu_params"}
OPTIMIZER_DESTS = frozenset({"optimizer_cpu_offload", "use_precision_aware_optimizer", *_OFFLOAD_REFINEMENTS.values()})
"""The Megatron flags :func:`optimizer_config` reads."""


def uses_mcore_optimizer(config: Any) -> bool:
    """Whether ``config`` asks for a feature of megatron-core's distributed optimizer: ``--optimizer-cpu-offload`` or
    ``--use-precision-aware-optimizer`` (``--use-distributed-optimizer`` alone: :func:`chooses_mcore_optimizer`)."""
    return bool(config.optimizer_cpu_offload or config.use_precision_aware_optimizer)


def own_adamw_reason(config: Any, cuda: bool, moe: bool) -> str | None:
    """Why ``--use-distributed-optimizer`` without megatron-core's features keeps the backend's own sharded AdamW
    (:mod:`.optimizer`) instead of megatron-core's distributed optimizer, in words; None where megatron-core's runs.

    :param cuda: whether this training rank has a CUDA GPU.
    :param moe: whether the model has experts (megatron-core's expert buffers are not checked on a GPU yet).
    """
    if not cuda:
        return "megatron-core's distributed optimizer needs a CUDA GPU"
    if int(config.lora_rank or 0) > 0:
        return "megatron-core's distributed optimizer with LoRA is not supported yet"
    if config.reset_optimizer_states:
        return "megatron-core's distributed optimizer with --reset-optimizer-states is not supported yet"
    if moe:
        return "megatron-core's distributed optimizer with experts is not supported yet"
    return None


def chooses_mcore_optimizer(config: Any, own_adamw: str | None) -> bool:
    """Whether megatron-core's distributed optimizer runs the steps: its features are asked for
    (:func:`uses_mcore_optimizer`), or ``--use-distributed-optimizer`` is given and ``own_adamw`` (a reason to keep
    the backend's own sharded AdamW, :func:`own_adamw_reason`) is None."""
    if uses_mcore_optimizer(config):
        return True
    return bool(config.use_distributed_optimizer) and own_adamw is None


def asked_features(config: Any) -> str:
    """The features of megatron-core's optimizer ``config`` asks for, as typed: ``"--optimizer-cpu-offload /
    --use-precision-aware-optimizer"``, one of them, or ``""``."""
    return " / ".join(f for f, on in zip(_FEATURES, (config.optimizer_cpu_offload,
                                                      config.use_precision_aware_optimizer)) if on)


SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
"""How megatron-core's distributed optimizer lays its state out in a checkpoint (:meth:`MegatronCoreOptimizer.sharded_state_dict`)."""


def mcore_optimizer_problems(config: Any, cuda: bool = True) -> list[str]:
    """What stops megatron-core's distributed optimizer for ``config`` (launch flags or a run
    configuration), one message per problem naming the flags; empty when it can run or is not asked for.

    :param cuda: whether the training ranks have a CUDA GPU (False: a problem, megatron-core's buffers live there).
    """
    if not uses_mcore_optimizer(config):
        return []
    given = asked_features(config)
    if (config.optimizer or "adam") != "adam":
        return [f"--optimizer {config.optimizer}: {given} supports adam (AdamW) only here."]
    problems = [fraction_problem(config)] if fraction_problem(config) else []
    if not cuda:
        problems.append(f"{given} {'need' if ' / ' in given else 'needs'} a CUDA GPU: megatron-core's distributed optimizer keeps its buffers on the "
                        "GPU, and this machine has none. Use --use-distributed-optimizer alone here (the backend's "
                        "own sharded AdamW).")
    if not config.use_distributed_optimizer:
        problems.append(f"{given} {'need' if ' / ' in given else 'needs'} --use-distributed-optimizer (they are features of megatron-core's "
                        "distributed optimizer).")
    if int(config.lora_rank or 0) > 0:
        problems.append(f"{given} with --lora-rank is not supported yet by --train-backend megatron.")
    if config.reset_optimizer_states:
        problems.append(f"{given} with --reset-optimizer-states is not supported yet by --train-backend megatron.")
    return problems


PRECISION_AWARE_WITHOUT_TE = (
    "--use-precision-aware-optimizer: megatron-core reads Transformer Engine's version for it, and "
    "transformer_engine is not installed here, so the distributed optimizer runs without it: the same AdamW "
    "updates (float32 masters and moments, as the flag keeps them at its default dtypes), with the float32 masters "
    "held on the GPU as well (4 bytes per parameter over the DP x CP ranks).")


def precision_aware(config: Any) -> bool:
    """``--use-precision-aware-optimizer`` where megatron-core can honour it: with Transformer Engine installed
    (megatron-core 0.16 reads its version whenever the option is on, with or without CPU offload)."""
    return bool(config.use_precision_aware_optimizer) and _has_transformer_engine()


def fraction_problem(config: Any) -> str | None:
    """An ``--optimizer-offload-fraction`` outside [0, 1], in words; None for a fraction in range."""
    fraction = flag(config, "optimizer_offload_fraction", 1.0)
    if 0.0 <= float(fraction) <= 1.0:
        return None
    return (f"--optimizer-offload-fraction must be in [0, 1] (the share of the AdamW state kept on the host), got "
            f"{fraction:g}.")


def idle_offload_flags(args: Any) -> list[str]:
    """The CPU-offload refinements given without ``--optimizer-cpu-offload``, where they change nothing (an
    ``--optimizer-offload-fraction`` out of range is an error instead, :func:`fraction_problem`)."""
    if args.optimizer_cpu_offload:
        return []
    given = args.megatron_args or {}
    idle = [f for f, dest in _OFFLOAD_REFINEMENTS.items() if dest in given or getattr(args, dest, None) is True]
    return [f for f in idle if f != "--optimizer-offload-fraction" or not fraction_problem(args)]


def _has_transformer_engine() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def optimizer_config(config: Any, bf16: bool):
    """megatron-core's ``OptimizerConfig`` for the run: AdamW from ``--lr``, ``--min-lr``, ``--weight-decay``,
    ``--adam-beta1/2``, ``--adam-eps``, ``--clip-grad`` (applied by :meth:`MegatronCoreOptimizer.clip`),
    bfloat16 parameters under ``--bf16``, the distributed optimizer, and the offload flags:
    ``--optimizer-cpu-offload``, ``--optimizer-offload-fraction`` (Megatron's default 1.0: every
    parameter's state on the host), ``--overlap-cpu-optimizer-d2h-h2d``, ``--use-torch-optimizer-for-cpu-offload``,
    ``--no-pin-cpu-grads``, ``--no-pin-cpu-params``, ``--use-precision-aware-optimizer`` (:func:`precision_aware`)."""
    import torch
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=float(config.lr), min_lr=float(config.min_lr or 0.0),
        weight_decay=float(config.weight_decay), adam_beta1=float(config.adam_beta1),
        adam_beta2=float(config.adam_beta2), adam_eps=float(config.adam_eps), clip_grad=float(config.clip_grad or 0.0),
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32, use_distributed_optimizer=True,
        optimizer_cpu_offload=bool(config.optimizer_cpu_offload),
        optimizer_offload_fraction=float(flag(config, "optimizer_offload_fraction", 1.0)),
        overlap_cpu_optimizer_d2h_h2d=bool(config.overlap_cpu_optimizer_d2h_h2d),
        use_torch_optimizer_for_cpu_offload=bool(flag(config, "use_torch_optimizer_for_cpu_offload", False)),
        pin_cpu_grads=bool(flag(config, "pin_cpu_grads", True)),
        pin_cpu_params=bool(flag(config, "pin_cpu_params", True)),
        use_precision_aware_optimizer=precision_aware(config))


def ddp_config():
    """megatron-core's ``DistributedDataParallelConfig``: float32 gradient buffers reduce-scattered at the end
    of the step (no overlap: the backend's step loop runs the micro-batches), for the distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                         overlap_param_gather=False, use_distributed_optimizer=True)


class MegatronCoreOptimizer:
    """megatron-core's ``DistributedDataParallel`` around one model chunk and the optimizer
    ``get_megatron_optimizer`` builds for it, with the surface the backend's step loop uses:
    ``param_groups`` (for the LR schedule), :meth:`zero_grad`, :meth:`clip`, :meth:`step`,
    checkpoint state (:meth:`sharded_state_dict`, :meth:`load_sharded`) and :meth:`offload` / :meth:`onload`.

    The float32 masters start from the model's weights (bfloat16 under ``--bf16``, as megatron-core's own
    start without optimizer state); a resumed run restores them exactly (:meth:`load_sharded`).

    :param model: the backend's GPTModel (its parameters move into the wrapper's contiguous buffer; the
        model is still called directly, the wrapper's gradient hooks sit on its parameters).
    :raises PluginError: no CUDA device (megatron-core's buffers and optimizer are CUDA-only).
    """

    def __init__(self, model, config: Any, bf16: bool) -> None:
        import torch

        if not torch.cuda.is_available():
            raise PluginError(" ".join(mcore_optimizer_problems(config, cuda=False)[:1]))
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import get_megatron_optimizer

        wrapper_config = copy.copy(model.config)
        # gradients are summed over data-parallel ranks, not averaged: the objective carries the step's denominators
        wrapper_config.calculate_per_token_loss = True
        self.ddp = DistributedDataParallel(wrapper_config, ddp_config(), model)
        self.inner = get_megatron_optimizer(optimizer_config(config, bf16), [self.ddp], use_gloo_process_groups=False)
        self.clip_grad = float(config.clip_grad or 0.0)
        self._moved: list[tuple] = []  # what offload() moved to the host, for onload()
        for part in self._parts():
            if hasattr(_torch_optimizer(part), "dummy_step"):  # HybridDeviceOptimizer (--optimizer-cpu-offload)
                masters_follow_loaded_state(_torch_optimizer(part))

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def _parts(self) -> list:
        return list(getattr(self.inner, "chained_optimizers", [self.inner]))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the wrapper's gradient buffers and the optimizer's gradients (start of a step)."""
        self.ddp.zero_grad_buffer()
        self.inner.zero_grad(set_to_none)

    def reduce(self) -> None:
        """Reduce-scatter the accumulated gradients over the data-parallel x context-parallel ranks."""
        self.ddp.finish_grad_sync()

    def main_grads(self):
        """``(name, float32 gradient buffer view)`` of every trained parameter (for the backend's TP sums)."""
        return [(name, p.main_grad) for name, p in self.ddp.module.named_parameters() if p.requires_grad]

    def clip(self) -> float:
        """Copy the reduced gradients to the masters, return megatron-core's global L2 norm (before clipping;
        over TP shards, pipeline stages and data-parallel shards, each parameter once), and clip to
        ``--clip-grad`` when the norm is finite and larger."""
        import math

        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        self.inner.prepare_grads()
        norm = float(self.inner.get_grad_norm())
        if math.isfinite(norm) and self.clip_grad > 0:
            for part in self._parts():
                params = part.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, self.clip_grad, norm,
                                                 part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        return norm

    def step(self) -> None:
        """AdamW on the masters, then the bfloat16 weights from them (all-gathered over the shards)."""
        self.inner.step_with_ready_grads()

    def sharded_state_dict(self, model_sharded: dict, is_loading: bool = False) -> dict:
        """megatron-core's optimizer state for ``dist_checkpointing``: its ``dp_reshardable`` layout (each rank's
        buffers as they are, saved and loaded without communication; a resume may change the data-parallel size
        but not TP, PP or EP), Megatron-LM's default and Miles'. megatron-core 0.16.1's own default,
        ``fully_sharded_model_space``, is deprecated and its flattened tensors no longer save (measured on an
        H100: ``ShardedTensor.flattened_range is not supported``)."""
        if is_loading:
            for part in self._parts():
                state_for_loading(_torch_optimizer(part), getattr(part, "init_state_fn", None), part.config)
        return self.inner.sharded_state_dict(model_sharded, is_loading, metadata=SHARDING)

    def load_sharded(self, state: dict) -> None:
        """Restore what :meth:`sharded_state_dict` saved (after ``dist_checkpointing.load``)."""
        self.inner.load_state_dict(state)

    def masters_from_model(self) -> None:
        """Start the float32 masters again from the model's weights (a load without optimizer state)."""
        self.inner.reload_model_params()

    def _buffers(self) -> list:
        return list(self.ddp.buffers) + list(self.ddp.expert_parallel_buffers)

    def offload(self) -> None:
        """Weights, gradient buffers and optimizer state to host memory (colocated rollouts).

        The optimizer's masters and moments move by :func:`offload_optimizer_state`, not by megatron-core's
        ``offload_to_cpu`` / ``restore_from_cpu``: the latter moves every host tensor of the state to the GPU,
        including the state ``--optimizer-cpu-offload`` keeps on the host for its CPU AdamW, whose next step
        would then mix devices."""
        for buffer in self._buffers():
            buffer.offload_to_cpu(move_params=True, move_grads=True)
        self._moved = [entry for part in self._parts() for entry in offload_optimizer_state(_torch_optimizer(part))]

    def onload(self) -> None:
        """Back to the GPU what :meth:`offload` moved (and only that)."""
        for buffer in self._buffers():
            buffer.reload_from_cpu(move_params=True, move_grads=True)
        onload_optimizer_state(self._moved)
        self._moved = []


def _torch_optimizer(part):
    """The torch optimizer inside one megatron-core optimizer (``HybridDeviceOptimizer`` under
    ``--optimizer-cpu-offload``), or None for a part without one (a rank with no trained parameters)."""
    if getattr(part, "is_stub_optimizer", False):
        return None
    return getattr(part, "optimizer", None)


def state_for_loading(optimizer, init_state_fn, config) -> None:
    """Give a fresh torch optimizer (no step taken yet) the state a checkpoint load overwrites.

    megatron-core's ``DistributedOptimizer.state_dict`` (which its loading template calls) reads the AdamW step
    from every parameter's state when neither Transformer Engine nor Apex is installed, and a fresh optimizer has
    none (``assert len(steps) == 1``, seen on an H100). The ``HybridDeviceOptimizer`` of ``--optimizer-cpu-offload``
    takes megatron-core's own ``dummy_step``; torch's Adam/AdamW get megatron-core's ``init_state_fn`` moments and
    step 0. The masters a dummy step moves are replaced by the checkpoint's. No-op for ``optimizer`` None or
    an optimizer that has state.
    """
    import torch

    if optimizer is None or len(optimizer.state) > 0:
        return
    if hasattr(optimizer, "dummy_step"):
        optimizer.dummy_step()
        return
    if init_state_fn is not None:
        init_state_fn(optimizer, config)
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        for group in optimizer.param_groups:
            for param in group["params"]:
                optimizer.state[param].setdefault("step", torch.tensor(0.0))


def masters_follow_loaded_state(hybrid) -> None:
    """Make a ``HybridDeviceOptimizer`` whose masters are float32 already load a checkpoint.

    After a load, megatron-core 0.16.1 refreshes the hybrid optimizer's inner parameters from each state's
    ``master_param`` through ``param_to_fp32_param``, which holds only parameters that were not float32; the
    distributed optimizer hands it float32 masters (precision-aware optimizer off), so every load raised
    ``KeyError`` (seen on an H100). Replaced on this instance: a parameter with a float32 copy is refreshed as
    megatron-core does, one with a host copy (the offloaded part) gets the loaded ``master_param`` in that copy,
    which is what its CPU AdamW steps; a parameter that is its own master needs nothing.
    """
    def refresh() -> None:
        if not hybrid.param_update_in_fp32:
            return
        for param, state in hybrid.state.items():
            loaded = state.get("master_param")
            inner = hybrid.param_to_fp32_param.get(param, hybrid.gpu_params_map_cpu_copy.get(param))
            if loaded is not None and inner is not None and inner is not loaded:
                inner.data.copy_(loaded)

    hybrid._update_fp32_params_by_new_state = refresh


def offload_optimizer_state(optimizer, host: str = "cpu") -> list[tuple]:
    """Move to ``host`` the parameters of ``optimizer.param_groups`` (their ``.data``: the parameter objects stay,
    as the optimizer and megatron-core's maps key on them) and the tensors of ``optimizer.state`` that are not
    there already; the state a CPU optimizer keeps on the host stays put.

    :returns: ``(holder, key, device)`` per tensor moved (``key`` None: a parameter), for
        :func:`onload_optimizer_state`; empty for ``optimizer`` None.
    """
    import torch

    if optimizer is None:
        return []
    target = torch.device(host)
    moved = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if torch.is_tensor(param) and param.device != target:
                moved.append((param, None, param.device))
                param.data = param.data.to(target)
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.device != target:
                moved.append((state, key, value.device))
                state[key] = value.to(target)
    return moved


def onload_optimizer_state(moved: list[tuple]) -> None:
    """Bring back each tensor :func:`offload_optimizer_state` moved to the device it came from."""
    for holder, key, device in moved:
        if key is None:
            holder.data = holder.data.to(device, non_blocking=True)
        else:
            holder[key] = holder[key].to(device, non_blocking=True)
