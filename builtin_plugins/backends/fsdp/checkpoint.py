"""Checkpoint files of the fsdp backend, written into the directory the core hands over.

Layout of ``path`` (the core's ``iter_N.tmp/``, renamed by the core when complete)::

    model/            Hugging Face directory: safetensors weights, config, tokenizer
                      (with --lora-rank: peft's adapter files instead of the weights)
    optimizer.pt      {"optimizer": full optimizer state keyed by parameter name,
                       "scheduler": {"global_step": k}}    (absent with --no-save-optim)
    rng.pt            torch / CUDA / python / numpy RNG states of rank 0
    rng_rank<r>.pt    the same for rank r > 0
    meta.json         {"global_step", "world_size", "timestamp"}

Full (unsharded) state is gathered on rank 0 and written there, so a checkpoint loads
under any world size and ``model/`` is an ordinary Hugging Face model directory.
Everything loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import glob
import json
import os
import random
import time
from typing import Any

from furlong.hooks import PluginError

from . import lora

__all__ = ["load_rng", "load_weights", "load_optimizer", "rng_state", "save_checkpoint"]


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_model_state(model, world: int, cpu: bool = True) -> dict:
    """Full state dict (collective under FSDP2); with ``cpu`` only rank 0 gets tensors."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=cpu and world > 1))


def save_checkpoint(path: str, *, model, optimizer, tokenizer, global_step: int, world: int, rank: int,
                    tied: set[str], save_optim: bool) -> None:
    """Write the layout above into ``path`` (every rank must call it)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = full_model_state(model, world)
    optim = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=world > 1)) if save_optim else None
    if rank == 0:
        os.makedirs(os.path.join(path, "model"), exist_ok=True)
        state = {k: v for k, v in state.items() if k not in tied}
        model.save_pretrained(os.path.join(path, "model"), state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(path, "model"))
        if save_optim:
            torch.save({"optimizer": optim, "scheduler": {"global_step": global_step}},
                       os.path.join(path, "optimizer.pt"))
        meta = {"global_step": global_step, "world_size": world, "timestamp": time.time()}
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
    else:
        os.makedirs(path, exist_ok=True)
    torch.save(rng_state(), os.path.join(path, _rng_name(rank)))
    if world > 1:
        torch.distributed.barrier()


def load_weights(path: str, model, world: int, rank: int, tied: set[str]) -> None:
    """Load ``path/model/*.safetensors`` into ``model`` (read on rank 0, broadcast under FSDP2).

    :raises PluginError: no weights in ``path/model``, or names missing from the files.
    """
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    files = sorted(glob.glob(os.path.join(path, "model", "*.safetensors")))
    if not files and os.path.exists(os.path.join(path, "metadata.json")):  # megatron-core's torch_dist layout
        raise PluginError(f"checkpoint {path} was written by --train-backend megatron (torch_dist files, no "
                          "model/*.safetensors); resume with --train-backend megatron.")
    if not files:
        raise PluginError(f"checkpoint {path}: no model/*.safetensors; the checkpoint is incomplete or was not "
                          "written by the fsdp backend. Restore its model/ folder or resume from an earlier "
                          "checkpoint with --ckpt-step.")
    adapter = lora.is_adapter_dir(os.path.join(path, "model"))  # LoRA: the adapters only, over --hf-checkpoint
    state: dict = {}
    if rank == 0 or world == 1:
        for file in files:
            state.update(lora.adapter_keys(load_file(file)) if adapter else load_file(file))
    result = set_model_state_dict(model, state, options=_options(strict=False, broadcast_from_rank0=world > 1))
    missing = set(getattr(result, "missing_keys", []) or []) - tied
    if adapter:
        missing = {k for k in missing if ".lora_" in k}
    if missing and (rank == 0 or world == 1):
        raise PluginError(f"checkpoint {path}: model/ lacks {sorted(missing)[:5]}; it belongs to another model.")


def load_optimizer(path: str, model, optimizer, world: int, rank: int) -> bool:
    """Restore the optimizer state (read on rank 0, broadcast under FSDP2); False without ``optimizer.pt``."""
    import torch
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    file = os.path.join(path, "optimizer.pt")
    if not os.path.exists(file):
        return False
    saved = torch.load(file, weights_only=True)["optimizer"] if rank == 0 or world == 1 else {}
    set_optimizer_state_dict(model, optimizer, saved, options=_options(broadcast_from_rank0=world > 1))
    return True


def read_meta(path: str) -> dict:
    """``meta.json`` of a checkpoint.

    :raises PluginError: the file is missing (not an fsdp checkpoint).
    """
    file = os.path.join(path, "meta.json")
    if not os.path.exists(file):
        raise PluginError(f"checkpoint {path}: no meta.json; it was not written by the fsdp backend.")
    with open(file) as f:
        return json.load(f)


def rng_state() -> dict:
    """Every RNG this process uses, as tensors and plain Python values."""
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss)],
    }


def load_rng(path: str, rank: int) -> None:
    """Restore this rank's RNG states (``rng_rank<r>.pt``, else rank 0's ``rng.pt``)."""
    import numpy as np
    import torch

    file = os.path.join(path, _rng_name(rank))
    if not os.path.exists(file):
        file = os.path.join(path, _rng_name(0))
    if not os.path.exists(file):
        return
    state: dict[str, Any] = torch.load(file, weights_only=True)
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _rng_name(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng_rank{rank}.pt"
