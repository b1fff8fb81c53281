"""``torch_dist`` checkpoints of the megatron backend (megatron-core ``dist_checkpointing``).

Layout of ``path`` (the core's ``iter_N.tmp/``, renamed by the core when every rank is done;
docs/checkpoints.md)::

    metadata.json, .metadata, common.pt, __<rank>_<n>.distcp    megatron-core torch_dist files
    meta.json     {"global_step", "world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                   "context_parallel_size", "optimizer", "optimizer_format", "timestamp"}

The sharded state holds ``model`` (megatron-core's own sharded state dict: layers stacked,
fc1 saved as the global ``[gate; up]``, so the files do not depend on TP), ``optimizer``
(AdamW moments as tensors shaped like their parameters, one shared ``step``; absent with
``--no-save-optim``; under ``--bf16`` the weights saved are the float32 master weights
and the moments are those of the masters), ``scheduler`` (``OptimizerParamScheduler.state_dict()``),
``global_step`` and ``rng`` (one object per rank). Under megatron-core's distributed optimizer
(:mod:`.mcore_optimizer`) ``model`` holds the bfloat16 weights and ``optimizer`` megatron-core's own
state (float32 masters and moments, its ``dp_reshardable`` layout: a resume may change DP only); ``meta.json`` says which
(``"optimizer_format"``), and a resume with the other optimizer loads the weights only with
``--no-load-optim``. A checkpoint saved at one TP or PP size
loads at another: weights and moments are resharded (megatron-core keys layers by their
global index; a tied model's last-stage output layer is saved as a replica of the
embedding); RNG states are restored only when the world size is unchanged. With LoRA (:mod:`.lora`)
``model`` holds the adapters only and the moments are theirs, and ``adapter/`` holds them in peft's format.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time

from furlong.hooks import PluginError
from furlong.kit.trainer import local_optimizer

__all__ = ["load_checkpoint", "load_weights", "save_checkpoint"]

log = logging.getLogger("furlong.backends.megatron")


def _rng_state() -> dict:
    import numpy as np
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if torch.cuda.is_available() and "cuda" in state:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def init_adam_state(optimizer) -> None:
    """Give every parameter of this rank's optimizer (its share under ``--use-distributed-optimizer``)
    empty AdamW state (zeros, step 0): the template a load fills in."""
    import torch

    local = local_optimizer(optimizer)
    for group in local.param_groups:
        for param in group["params"]:
            state = local.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _optimizer_sharded(optimizer, model_sharded: dict) -> dict:
    """This rank's optimizer state dict with each moment as a ShardedTensor shaped like its parameter.

    The keys name parameters, not ranks, so the files are the same with and without
    ``--use-distributed-optimizer``. Sharded, each rank holds the moments of its own share of
    the parameters and is their main replica (the data-parallel part of the replica id is 0);
    unsharded, every data-parallel rank holds all of them and the first one writes them.
    """
    from dataclasses import replace

    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)

    local = local_optimizer(optimizer)
    state = local.state_dict()
    state["state"] = {key: dict(value) for key, value in state["state"].items()}  # the live dicts otherwise
    params = [p for group in local.param_groups for p in group["params"]]
    id_map = get_param_id_to_sharded_param_map(model_sharded, params)
    steps = [s.pop("step") for s in state["state"].values() if "step" in s]
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    if local is not optimizer:
        for moments in state["state"].values():
            for key, value in moments.items():
                replica = value.replica_id
                moments[key] = replace(value, replica_id=(*replica[:-1], 0) if isinstance(replica, tuple) else 0)
    if steps:
        state["state"]["common_step"] = float(steps[0])
    return state


def _model_sharded(model, masters) -> dict:
    """The model's sharded state dict; with :class:`~.master.MasterWeights`, holding the float32 masters. A model
    with LoRA adapters (:mod:`.lora`) gives its adapters only (the frozen base is ``--hf-checkpoint``)."""
    from .lora import adapter_sharded

    sharded = model.sharded_state_dict()
    adapters = adapter_sharded(sharded)
    if adapters:
        sharded = adapters
    return masters.sharded_state_dict(sharded) if masters is not None else sharded


def _load(template: dict, path: str, device, what: str) -> dict:
    """``dist_checkpointing.load`` of ``template`` from ``path``; a reader failure names the checkpoint."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from .model import cpu_shims

    try:
        with cpu_shims(device):
            return dist_checkpointing.load(template, path)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any reader failure is a bad checkpoint
        raise PluginError(f"checkpoint {path}: cannot load {what} into this model: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc


def _schedule_state(saved: dict, scheduler) -> dict:
    """The saved LR schedule state, the lengths of a constant schedule taken from this run's flags.

    With ``--lr-decay-style constant`` (weight decay constant too) and the same warmup, the decay
    and weight-decay lengths (``--num-rollout`` x steps per rollout by default) change no learning
    rate, so a run extended with a larger ``--num-rollout`` resumes without
    ``--override-opt_param-scheduler``; any other difference is left to megatron-core's check.
    """
    constant = (saved.get("lr_decay_style") == scheduler.lr_decay_style == "constant"
                and saved.get("wd_incr_style", "constant") == scheduler.wd_incr_style == "constant")
    if constant and saved.get("lr_warmup_steps") == scheduler.lr_warmup_steps:
        return {**saved, "lr_decay_steps": scheduler.lr_decay_steps, "wd_incr_steps": scheduler.wd_incr_steps}
    return saved


def _restore_model(model, masters, loaded_model: dict) -> None:
    """Loaded model tensors into the masters (then rounded into the model), or into the model itself."""
    if masters is not None:
        masters.load_loaded(loaded_model)
    else:
        model.load_state_dict(loaded_model, strict=False)


def optimizer_format(optimizer) -> str:
    """How ``optimizer``'s state is saved: ``"megatron-core"`` (:class:`~.mcore_optimizer.MegatronCoreOptimizer`)
    or ``"adamw"`` (torch's AdamW, sharded or not)."""
    from .mcore_optimizer import MegatronCoreOptimizer

    return "megatron-core" if isinstance(optimizer, MegatronCoreOptimizer) else "adamw"


def _sharded(model, masters, optimizer, scheduler, global_step: int, rank: int, world: int, with_optim: bool,
             rng_world: int | None, loading: bool = False) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"model": _model_sharded(model, masters), "scheduler": scheduler.state_dict(), "global_step": global_step}
    if with_optim and optimizer_format(optimizer) == "megatron-core":
        state["optimizer"] = optimizer.sharded_state_dict(_model_sharded(model, masters), loading)
    elif with_optim:
        state["optimizer"] = _optimizer_sharded(optimizer, _model_sharded(model, masters))
    if rng_world:
        state["rng"] = ShardedObject("rng", _rng_state(), (rng_world,), (rank,), replica_id=0)
    return state


def save_checkpoint(path: str, *, model, optimizer, scheduler, global_step: int, rank: int, world: int, tp: int,
                    save_optim: bool, device, masters=None, pp: int = 1, cp: int = 1) -> None:
    """Write the layout above into ``path`` (every rank calls it; a collective).

    :param masters: the :class:`~.master.MasterWeights` of a bfloat16 model (saved instead of its weights).
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from .model import cpu_shims

    os.makedirs(path, exist_ok=True)
    dist.barrier()
    state = _sharded(model, masters, optimizer, scheduler, global_step, rank, world, save_optim, world)
    with cpu_shims(device):
        dist_checkpointing.save(state, path)
    if rank == 0:
        meta = {"global_step": global_step, "world_size": world, "tensor_model_parallel_size": tp,
                "pipeline_model_parallel_size": pp, "context_parallel_size": cp,
                "optimizer": save_optim, "optimizer_format": optimizer_format(optimizer), "timestamp": time.time()}
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
    dist.barrier()


def read_meta(path: str) -> dict:
    """``meta.json`` of a checkpoint.

    :raises PluginError: no ``meta.json`` or no megatron-core ``metadata.json`` (not written by this backend).
    """
    file = os.path.join(path, "meta.json")
    if not os.path.exists(os.path.join(path, "metadata.json")) and os.path.isdir(os.path.join(path, "model")):
        raise PluginError(f"checkpoint {path} was written by --train-backend fsdp (model/ holds its weights, no "
                          "torch_dist metadata.json); resume with --train-backend fsdp.")
    if not (os.path.exists(file) and os.path.exists(os.path.join(path, "metadata.json"))):
        raise PluginError(f"checkpoint {path}: no meta.json and torch_dist metadata.json; it was not written by the "
                          "megatron backend.")
    with open(file) as f:
        return json.load(f)


_FORMAT_NAMES = {"adamw": "the backend's AdamW (--use-distributed-optimizer alone, or none)",
                 "megatron-core": "megatron-core's distributed optimizer (--optimizer-cpu-offload / "
                                  "--use-precision-aware-optimizer)"}


def _load_adamw(optimizer, state: dict) -> None:
    """Loaded AdamW state (:func:`_optimizer_sharded`'s layout) into ``optimizer`` (sharded or not)."""
    import torch

    step = state["state"].pop("common_step", None)
    if step is not None:
        for param_state in state["state"].values():
            param_state["step"] = torch.tensor(float(step))
    local = local_optimizer(optimizer)
    # the hyperparameters saved (by the first rank), the parameter indices of this rank's optimizer
    state["param_groups"] = [{**saved, "params": group["params"]} for saved, group in
                             zip(state["param_groups"], local.state_dict()["param_groups"])]
    local.load_state_dict(state)
    if local is not optimizer:  # a ZeroRedundancyOptimizer: its own groups take the loaded hyperparameters
        for outer, group in zip(optimizer.param_groups, local.param_groups):
            outer.update({k: v for k, v in group.items() if k != "params"})


def load_checkpoint(path: str, *, model, optimizer, scheduler, rank: int, world: int, load_optim: bool,
                    load_rng: bool, device, masters=None) -> int:
    """Restore ``path`` into ``model`` (and optimizer, scheduler, RNG); return the saved global step.

    :param load_optim: False (``--no-load-optim``) keeps the fresh optimizer and schedule.
    :param load_rng: False (``--no-load-rng``) keeps this process's RNG.
    :param masters: the :class:`~.master.MasterWeights` of a bfloat16 model: the saved weights
        load into them (float32), then round into the model.
    :raises PluginError: not a checkpoint of this backend, or one of another model.
    """
    meta = read_meta(path)
    with_optim = load_optim and meta.get("optimizer", True)
    saved_format, mine = meta.get("optimizer_format", "adamw"), optimizer_format(optimizer)
    if with_optim and saved_format != mine:
        raise PluginError(f"checkpoint {path} holds the optimizer state of {_FORMAT_NAMES[saved_format]}, this run "
                          f"uses {_FORMAT_NAMES[mine]}; resume with the same optimizer flags, or pass --no-load-optim "
                          "to load its weights only.")
    if with_optim and mine == "adamw":
        init_adam_state(optimizer)
    rng_world = meta["world_size"] if load_rng and meta["world_size"] == world else None
    if load_rng and not rng_world and rank == 0:
        log.warning("checkpoint %s was saved by %d rank(s), this run has %d: RNG states are not restored.", path,
                    meta["world_size"], world)
    template = _sharded(model, masters, optimizer, scheduler, 0, rank, world, with_optim, rng_world, loading=True)
    loaded = _load(template, path, device, "it")
    _restore_model(model, masters, loaded["model"])
    if mine == "megatron-core" and not with_optim:
        optimizer.masters_from_model()
    if with_optim:
        if mine == "megatron-core":
            optimizer.load_sharded(loaded["optimizer"])
        else:
            _load_adamw(optimizer, loaded["optimizer"])
        try:
            scheduler.load_state_dict(_schedule_state(loaded["scheduler"], scheduler))
        except AssertionError as exc:  # megatron-core's check that the schedule flags did not change
            raise PluginError(
                f"checkpoint {path}: the learning-rate schedule saved there differs from this run's ({exc}). "
                "Pass --override-opt_param-scheduler to continue on this run's schedule flags (--lr, --min-lr, "
                "--lr-decay-*, --lr-warmup-*; the decay length defaults to --num-rollout x steps per rollout), or "
                "--use-checkpoint-opt_param-scheduler to continue on the checkpoint's.") from exc
    if rng_world:
        _set_rng_state(loaded["rng"])
    return int(loaded["global_step"])


def load_weights(path: str, model, device, masters=None, skip: tuple[str, ...] = ()) -> None:
    """Load only the model weights of checkpoint ``path`` (``--ref-load`` of a ``torch_dist`` checkpoint).

    :param masters: the :class:`~.master.MasterWeights` of a bfloat16 model: the saved float32
        weights load into them, then round into the model.
    :param skip: state-dict key prefixes not read from ``path`` (a critic's value head, which an actor's
        checkpoint does not hold): those parameters keep their values.
    :raises PluginError: not a checkpoint of this backend, or one of another model.
    """
    from .model import cpu_shims

    read_meta(path)
    with cpu_shims(device):
        whole = _model_sharded(model, masters)
    wanted = {k: v for k, v in whole.items() if not (skip and k.startswith(skip))}
    loaded = _load({"model": wanted}, path, device, "its weights")["model"]
    loaded.update({k: v.data for k, v in whole.items() if k not in wanted})  # their own values
    _restore_model(model, masters, loaded)
