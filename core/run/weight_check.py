"""``--check-weight-update-equal``: after a weight sync, each engine's weights equal the trainer's, bit for bit.

The train workers stream their weights in Hugging Face names, the way a sync does; each
tensor, cast to the dtype the engine holds it in (the cast the engine's own copy makes), must
have the SHA-256 the engine reports for it (``engine.weight_digests(names)``, bucket by bucket:
``{name: (dtype, shape, sha256)}``, :func:`furlong.kit.tensor_digest.named_digests`). Tensors the
engine holds that the trainer does not send (a tied output projection) are not compared. An FP8
engine's layer holds e4m3 blocks: the trainer's tensor is quantised the engine's way
(:func:`furlong.kit.fp8.quantize_blocks`) before its digest is taken.
"""

from __future__ import annotations

import asyncio

import torch

from furlong.hooks import PluginError, RunConfig
from furlong.kit.fp8 import quantize_blocks
from furlong.kit.tensor_digest import tensor_digest

from ..train.group import TrainGroup

__all__ = ["check_engine_weights"]

FLAG = "--check-weight-update-equal"


async def check_engine_weights(config: RunConfig, group: TrainGroup, engines: list, version: int) -> int:
    """Compare every tensor the trainer sends with each engine's copy; return how many tensors were compared.

    :raises PluginError: an engine cannot report its weights (it lacks ``weight_digests``), lacks a
        tensor the trainer sends, or holds one that differs (the first such tensor is named, with its engine,
        dtype, shape and the weight version).
    """
    reporters = [getattr(engine, "weight_digests", None) for engine in engines]
    if not all(callable(r) for r in reporters):
        raise PluginError(f"{FLAG}: the engines of --rollout-backend {config.rollout_backend} cannot report their "
                          "weights (no weight_digests(names)); the check works with the embedded engine in the driver's "
                          "process (--executor local). Drop the flag for this engine.")
    compared = 0
    async with group.busy:
        await group.begin_weights()
        while (bucket := await group.next_weight_bucket(config.update_weight_buffer_size, True)) is not None:
            held = await asyncio.gather(*(report(list(bucket.names)) for report in reporters))
            for name, tensor in zip(bucket.names, bucket.tensors):
                for index, digests in enumerate(held):
                    _compare(name, tensor, digests, index, version)
                compared += 1
    return compared


def _compare(name: str, tensor: torch.Tensor, digests: dict, index: int, version: int) -> None:
    where = f"{FLAG}: after weight sync {version}, engine {index}"
    if name not in digests:
        raise PluginError(f"{where} has no tensor '{name}', which the trainer sends.")
    dtype, shape, digest = digests[name]
    if list(tensor.shape) != list(shape):
        raise PluginError(f"{where}'s tensor '{name}' has shape {tuple(shape)}; the trainer's has "
                          f"{tuple(tensor.shape)}.")
    # an FP8 engine holds the e4m3 blocks the sent tensor quantises to (furlong.kit.fp8's rounding)
    held = quantize_blocks(tensor)[0] if dtype == "float8_e4m3fn" else tensor.to(getattr(torch, dtype))
    if tensor_digest(held) != digest:
        raise PluginError(f"{where}'s tensor '{name}' ({dtype}, shape {tuple(shape)}) differs from the trainer's: "
                          "the sync did not deliver it.")
