"""Reading and writing fine-grained FP8 Hugging Face checkpoints (format: :mod:`furlong.kit.fp8`).

:func:`quantize_checkpoint` writes one from a BF16 (or float32, float16) directory
(``furlong quantize-fp8``); :func:`read_fp8_blocks` and :func:`dequantized_tensors` read one
back, for the embedded engine and for trainers that must build their model from it.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from typing import Any, Iterator

from furlong.hooks.errors import PluginError

from .fp8 import BLOCK, SCALE_SUFFIX, dequantize_blocks, fp8_quantization_config, quantization_config_for, \
    quantize_blocks

__all__ = ["dequantized_tensors", "fp8_linear_blocks", "fp8_module_names", "linear_weight_names", "quantize_bucket",
           "quantize_checkpoint", "quantized_names", "read_fp8_blocks"]

log = logging.getLogger("furlong.fp8")

FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Projections SGLang fuses into one layer (``qkv_proj``, ``gate_up_proj``): they must be quantised
all or none (SGLang refuses a fused layer with some shards quantised and some not)."""


def _weight_files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def fp8_module_names(path: str | None) -> set[str]:
    """Names of the modules the FP8 checkpoint ``path`` quantised (those with a ``weight_scale_inv`` in
    its files); empty for a directory that is not an FP8 checkpoint. Reads the files' headers only."""
    from safetensors import safe_open

    if fp8_quantization_config(path) is None:
        return set()
    names = set()
    for file in _weight_files(path):
        with safe_open(file, framework="pt") as handle:
            names.update(n[: -len(SCALE_SUFFIX) - 1] for n in handle.keys() if n.endswith("." + SCALE_SUFFIX))
    return names


def quantize_bucket(named_tensors: list[tuple[str, Any]], modules: set[str]) -> list[tuple[str, Any]]:
    """A weight-sync bucket as an FP8 server loads it: each ``<module>.weight`` of ``modules`` becomes
    its e4m3 blocks and ``<module>.weight_scale_inv`` (:func:`~furlong.kit.fp8.quantize_blocks`, on the
    tensor's device); other tensors pass unchanged. The trainer-side quantisation SGLang's FP8 layers
    need (they copy a loaded weight as it comes)."""
    out = []
    for name, tensor in named_tensors:
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module in modules:
            q, scale_inv = quantize_blocks(tensor)
            out += [(name, q), (f"{module}.{SCALE_SUFFIX}", scale_inv)]
        else:
            out.append((name, tensor))
    return out


def read_fp8_blocks(path: str) -> dict[str, tuple[Any, Any]]:
    """``{module name: (weight e4m3 [N, K], weight_scale_inv float32 [N/128, K/128])}`` of every
    quantised module of the FP8 checkpoint ``path`` (a module is quantised when the files hold its
    ``weight_scale_inv``), on the CPU.

    :raises PluginError: a ``weight_scale_inv`` without its e4m3 ``weight``.
    """
    from safetensors import safe_open

    where: dict[str, str] = {}
    for file in _weight_files(path):
        with safe_open(file, framework="pt") as handle:
            where.update({name: file for name in handle.keys()})
    blocks = {}
    for name, file in where.items():
        if not name.endswith("." + SCALE_SUFFIX):
            continue
        module = name[: -len(SCALE_SUFFIX) - 1]
        weight_file = where.get(module + ".weight")
        if weight_file is None:
            raise PluginError(f"{path}: {name} has no {module}.weight beside it; the FP8 checkpoint is incomplete.")
        with safe_open(file, framework="pt") as handle:
            scale = handle.get_tensor(name)
        with safe_open(weight_file, framework="pt") as handle:
            weight = handle.get_tensor(module + ".weight")
        blocks[module] = (weight, scale)
    return blocks


def dequantized_tensors(path: str) -> Iterator[tuple[str, Any]]:
    """Every tensor of the checkpoint ``path``, one at a time, with FP8 weights dequantised to float32
    (:func:`~furlong.kit.fp8.dequantize_blocks`) and their scales left out; the other tensors as stored.
    For a BF16 directory this is just its tensors."""
    from safetensors import safe_open

    fp8 = fp8_quantization_config(path) is not None
    files = _weight_files(path)
    scales: dict[str, str] = {}
    if fp8:
        for file in files:
            with safe_open(file, framework="pt") as handle:
                scales.update({n[: -len(SCALE_SUFFIX) - 1]: file for n in handle.keys() if n.endswith(SCALE_SUFFIX)})
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                if fp8 and name.endswith("." + SCALE_SUFFIX):
                    continue
                tensor = handle.get_tensor(name)
                module = name[: -len(".weight")] if name.endswith(".weight") else None
                if module in scales:
                    with safe_open(scales[module], framework="pt") as other:
                        tensor = dequantize_blocks(tensor, other.get_tensor(module + "." + SCALE_SUFFIX))
                yield name, tensor


def linear_weight_names(config: Any) -> tuple[dict[str, tuple[int, int]], str | None]:
    """``({module name: (out_features, in_features)}, head name)``: every plain ``nn.Linear`` of the
    causal LM that ``config`` (a transformers config) builds but its output head, and the head's module
    name, found on the meta device (no memory, no weights).

    :raises PluginError: a mixture-of-experts model (not supported yet).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from .moe import is_experts_module

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if any(is_experts_module(m) for m in model.modules()):
        raise PluginError(f"{type(model).__name__}: FP8 mixture-of-experts models are not supported yet (their "
                          "experts and routers need their own FP8 layout); quantise a dense model.")
    out = model.get_output_embeddings()
    linears = {name: (m.out_features, m.in_features) for name, m in model.named_modules()
               if type(m) is torch.nn.Linear and m is not out}
    head = next((name for name, m in model.named_modules() if m is out and out is not None), None)
    return linears, head


def quantized_names(linears: dict[str, tuple[int, int]], block: tuple[int, int] = BLOCK) -> tuple[list[str], list[str]]:
    """Split linear modules into ``(quantised, left in BF16)``: a weight whose shape is not a multiple
    of ``block`` stays, and so do its fused siblings (:data:`FUSED_SIBLINGS`)."""
    keep = {name for name, (n, k) in linears.items() if n % block[0] or k % block[1]}
    for name in list(keep):
        parent, _, leaf = name.rpartition(".")
        for group in FUSED_SIBLINGS:
            if leaf in group:
                keep.update(f"{parent}.{s}" for s in group if f"{parent}.{s}" in linears)
    return sorted(n for n in linears if n not in keep), sorted(keep)


def fp8_linear_blocks(model, path: str, flag: str) -> list[tuple[str, Any, Any, Any]]:
    """``(module name, linear layer of model, weight e4m3, weight_scale_inv)`` for every quantised module of the
    FP8 checkpoint ``path`` (given as ``flag``), each matched to the ``torch.nn.Linear`` of ``model`` it belongs to.

    :raises PluginError: a scale for a module that is not a linear layer of the model with the weight's shape
        (FP8 mixture-of-experts checkpoints, whose experts are fused in the model, are not supported yet).
    """
    import torch

    found = []
    for name, (q, scale_inv) in read_fp8_blocks(path).items():
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            layer = None
        if not isinstance(layer, torch.nn.Linear) or tuple(layer.weight.shape) != tuple(q.shape):
            raise PluginError(f"{flag} {path}: {name}.weight_scale_inv is for a module the model does not have as a "
                              f"{tuple(q.shape)} linear layer (FP8 mixture-of-experts checkpoints, whose experts are "
                              "fused in the model, are not supported yet).")
        found.append((name, layer, q, scale_inv))
    return found


def quantize_checkpoint(src: str, dst: str) -> dict:
    """Write the fine-grained FP8 version of the Hugging Face directory ``src`` to ``dst``.

    Every plain linear layer except the output head (``lm_head``) is quantised into e4m3 blocks
    with ``weight_scale_inv`` (:func:`~furlong.kit.fp8.quantize_blocks`); embeddings, norms, biases,
    the head and linear layers whose shape is not a multiple of 128 keep their dtype (the last two
    are listed in ``modules_to_not_convert``). Shards keep their
    names; the index (if any) gains the scales; ``config.json`` gains ``quantization_config``; every
    other file (tokenizer, generation config, chat template) is copied.

    :returns: ``{"quantized": [...module names], "not_converted": [...]}``.
    :raises PluginError: ``src`` is not a model directory with safetensors weights, is already
        quantised or a mixture-of-experts model, has no linear layer of a multiple of 128 in both
        dimensions, has a weight file that cannot be read, or ``dst`` exists and is not empty, or cannot
        be written (what it wrote is then removed).
    """
    from transformers import AutoConfig

    where = f"quantize-fp8 {src}"
    if os.path.isfile(src):
        raise PluginError(f"{where}: a file, not a directory; give the model directory (the folder holding "
                          "config.json and the *.safetensors weights).")
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise PluginError(f"{where}: not a Hugging Face model directory (no config.json).")
    files = _weight_files(src)
    if not files:
        raise PluginError(f"{where}: no *.safetensors weights (save the model with safe_serialization).")
    try:
        with open(os.path.join(src, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise PluginError(f"{where}: cannot read config.json ({exc}).") from None
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method")
        raise PluginError(f"{where}: already quantised (quantization_config quant_method {method!r}); "
                          "quantise the BF16 model it came from.")
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise PluginError(f"quantize-fp8 {dst}: exists and is not an empty directory; choose a new output directory.")
    try:
        config = AutoConfig.from_pretrained(src, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad config
        raise PluginError(f"{where}: cannot read config.json ({exc}).") from exc
    try:
        linears, head = linear_weight_names(config)
    except PluginError as exc:
        raise PluginError(f"{where}: {exc}") from None
    quantized, kept = quantized_names(linears)
    if not quantized:
        raise PluginError(f"{where}: no linear layer has both dimensions a multiple of 128 (the block size), so no "
                          f"layer would be in FP8 ({len(kept)} would keep their dtype); this model has no FP8 form.")
    kept = ([head] if head else []) + kept
    todo = {f"{name}.weight" for name in quantized}
    created = not os.path.exists(dst)
    try:
        _write_quantized(src, dst, files, todo, raw, kept, where)
    except BaseException:
        _clear(dst, created)  # no half-written checkpoint is left to be mistaken for a whole one
        raise
    log.debug("quantize-fp8: %d linear layers in FP8 (e4m3, 128 x 128 blocks), %d kept in %s: %s", len(quantized),
              len(kept), raw.get("torch_dtype") or raw.get("dtype") or "their dtype", dst)
    return {"quantized": quantized, "not_converted": kept}


def _clear(dst: str, created: bool) -> None:
    """Remove what a failed :func:`quantize_checkpoint` wrote: ``dst`` itself where it created it, else its contents."""
    if created:
        shutil.rmtree(dst, ignore_errors=True)
    elif os.path.isdir(dst):
        for name in os.listdir(dst):
            path = os.path.join(dst, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


def _write_quantized(src: str, dst: str, files: list[str], todo: set[str], raw: dict, kept: list[str],
                     where: str) -> None:
    """Write :func:`quantize_checkpoint`'s output: each weight file with the ``todo`` weights quantised, the config
    with its ``quantization_config``, the index and the other files of ``src``."""
    from safetensors import SafetensorError, safe_open

    from .hf import save_safetensors

    try:
        os.makedirs(dst, exist_ok=True)
        weight_map = {}
        for file in files:
            out = {}
            try:
                with safe_open(file, framework="pt") as handle:
                    for name in handle.keys():
                        tensor = handle.get_tensor(name)
                        if name in todo:
                            if not tensor.float().isfinite().all():  # a block scale cannot hold NaN or infinity
                                raise PluginError(f"{where}: {name} in {os.path.basename(file)} holds NaN or infinite "
                                                  "values; its FP8 blocks would not represent it.")
                            q, scale_inv = quantize_blocks(tensor)
                            out[name], out[name[: -len("weight")] + SCALE_SUFFIX] = q, scale_inv
                            todo.discard(name)
                        else:
                            out[name] = tensor
            except SafetensorError as exc:
                raise PluginError(f"{where}: cannot read {os.path.basename(file)} ({exc}).") from None
            save_safetensors(out, os.path.join(dst, os.path.basename(file)))
            weight_map.update({name: os.path.basename(file) for name in out})
        if todo:
            raise PluginError(f"{where}: the weight files lack {len(todo)} linear weights the config's model has "
                              f"(first: {sorted(todo)[0]}); the config and the weights do not belong together.")
        raw["quantization_config"] = quantization_config_for(kept)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(raw, f, indent=2)
        index = os.path.join(src, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                meta = json.load(f)
            meta["weight_map"] = dict(sorted(weight_map.items()))
            meta.setdefault("metadata", {}).pop("total_size", None)
            with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
                json.dump(meta, f, indent=2)
        for name in sorted(os.listdir(src)):
            source = os.path.join(src, name)
            if os.path.isfile(source) and not name.endswith(".safetensors") and name not in (
                    "config.json", "model.safetensors.index.json"):
                shutil.copyfile(source, os.path.join(dst, name))
    except OSError as exc:
        raise PluginError(f"quantize-fp8 {dst}: cannot write the FP8 checkpoint ({exc}).") from exc
