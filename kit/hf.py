"""Loading Hugging Face model directories with errors that name the flag and the file at fault.

Engines, train backends and data sources all read ``--hf-checkpoint`` (or ``--ref-load``);
these helpers turn the many ways that can fail (missing tokenizer files, a truncated or
corrupt ``*.safetensors``, an unreadable ``config.json``) into one :class:`PluginError`.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
from typing import Any, Sequence

from furlong.hooks.errors import PluginError

__all__ = ["compile_decoder_layers", "decoder_layers", "is_hf_dir", "load_causal_lm_weights", "load_tokenizer",
           "non_full_attention", "read_hf_weights", "save_safetensors", "write_hf_checkpoint"]

log = logging.getLogger("furlong")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "merges.txt", "spiece.model")


def load_tokenizer(path: str, flag: str = "--hf-checkpoint") -> Any:
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)``: a local directory, never a Hub download.

    :raises PluginError: ``path`` is not a directory, or it holds no usable tokenizer (the
        message names ``flag``, ``path`` and the files a tokenizer needs).
    """
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise PluginError(f"{flag} {path}: no such directory (furlong reads local model directories only).")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here
        found = [n for n in _TOKENIZER_FILES if os.path.exists(os.path.join(path, n))] if os.path.isdir(path) else []
        problem = f"cannot load the tokenizer ({_first_line(exc)})" if found else "no tokenizer files"
        raise PluginError(
            f"{flag} {path}: {problem}. The directory needs the model's tokenizer files (tokenizer.json and "
            "tokenizer_config.json, or its vocabulary files); copy them from where the model came from."
        ) from exc


def load_causal_lm_weights(path: str, flag: str, attn_implementations: Sequence[str] = ("sdpa", "eager"),
                           **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path, attn_implementation=..., local_files_only=True, **kwargs)``:
    a local directory, never a Hub download.

    Tries each attention implementation in order (one that is not installed or not
    supported by the architecture raises ``ImportError``/``ValueError``; the next is tried
    with a warning).

    A fine-grained FP8 checkpoint (:mod:`furlong.kit.fp8`) loads dequantised: its linear layers
    hold ``weight * weight_scale_inv`` in the model's dtype (transformers' own dequantising load,
    without its GPU kernels: the embedded engine swaps in FP8 layers itself).

    :raises PluginError: no implementation loads (e.g. an unknown ``model_type``), no
        weights, weights that do not match ``config.json``, a corrupt or truncated weight
        file, or an unreadable config; the message names ``flag``, ``path`` and the cause.
    """
    from transformers import AutoModelForCausalLM

    kwargs.setdefault("local_files_only", True)
    fp8 = _fp8_config_without_quantization(path, flag)
    if fp8 is not None:
        kwargs["config"] = fp8
    problem = ""
    for i, attn in enumerate(attn_implementations):
        try:
            with _quiet_transformers() if fp8 is not None else contextlib.nullcontext():
                # (the scales are "unexpected" to the plain layers; _dequantize_into reads them)
                model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, **kwargs)
        except (ImportError, ValueError) as exc:
            problem = _first_line(exc)
            if i + 1 < len(attn_implementations):
                log.warning("%s %s: attention %r did not load (%s); trying %r", flag, path, attn, problem,
                            attn_implementations[i + 1])
        except OSError as exc:
            raise PluginError(f"{flag} {path}: cannot load the model ({_first_line(exc)}).") from exc
        except Exception as exc:  # noqa: BLE001 - e.g. safetensors' SafetensorError on a corrupt file
            raise PluginError(f"{flag} {path}: {_weights_problem(path, exc)}") from exc
        else:
            if fp8 is not None:
                _dequantize_into(model, path, flag)
            return model
    raise PluginError(f"{flag} {path}: cannot load the model ({problem}).")


def _fp8_config_without_quantization(path: str, flag: str) -> Any:
    """For an FP8 checkpoint: its transformers config with ``quantization_config`` removed (so
    transformers builds plain linear layers, which :func:`_dequantize_into` fills); else None.

    :raises PluginError: an FP8 format furlong does not run (:func:`furlong.kit.fp8.require_supported`).
    """
    from transformers import AutoConfig

    from .fp8 import fp8_quantization_config, require_supported

    if fp8_quantization_config(path) is None:
        return None
    require_supported(path, flag)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    del config.quantization_config
    return config


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' loading report at error level only, for the duration."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _dequantize_into(model, path: str, flag: str) -> None:
    """Overwrite each quantised linear weight of ``model`` (loaded from the FP8 checkpoint ``path``, given
    as ``flag``, with the raw e4m3 values) with its dequantised value, in the weight's dtype.

    :raises PluginError: a scale for a module that is not such a linear layer of the model."""
    import torch

    from .fp8 import dequantize_blocks
    from .fp8_io import fp8_linear_blocks

    with torch.no_grad():
        for _, layer, q, scale_inv in fp8_linear_blocks(model, path, flag):
            layer.weight.copy_(dequantize_blocks(q, scale_inv, layer.weight.dtype))


def decoder_layers(model) -> list:
    """The transformer blocks of a Hugging Face model: modules whose class it names in ``_no_split_modules``
    (a peft-wrapped model's too)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names and hasattr(model, "get_base_model"):
        names = set(getattr(model.get_base_model(), "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


COMPILED_VARIANTS = 64
"""Compiled variants torch keeps per function (``torch._dynamo.config.cache_size_limit``, 8 by default) once a
model's layers compile here. The engine's and the trainer's layers are the same classes, so their variants
(prefill and decode shapes, with and without grad, the calls' argument forms) add up on the same functions.
At 8 the demo's engine alone made 10 variants in its first rollouts, and those past the limit ran
uncompiled."""


def compile_decoder_layers(model, flag: str, backend: str = "inductor", dynamic: bool | None = None) -> int:
    """Compile every decoder layer of ``model`` in place with ``torch.compile`` (regional compilation:
    the layers share one compiled code, their parameters are its inputs, so weights changed in
    place reach it and the compilation costs one layer's, not the model's). The layers run with torch's
    limit of compiled variants per function at :data:`COMPILED_VARIANTS`.

    :param flag: the flag that asked for it, for the error message.
    :param dynamic: passed to ``torch.compile`` (True: sizes symbolic from the start, for inputs
        whose lengths change at every call).
    :returns: the number of layers compiled.
    :raises PluginError: the model names no decoder layer class (``_no_split_modules``).
    """
    layers = decoder_layers(model)
    if not layers:
        raise PluginError(f"{flag}: {type(model).__name__} names no decoder layer class "
                          "(_no_split_modules), so there is nothing to compile; run without the flag.")
    for layer in layers:
        layer.compile(backend=backend, dynamic=dynamic)
        layer._compiled_call_impl = _keeping_variants(layer._compiled_call_impl)
    return len(layers)


def _keeping_variants(compiled):
    """``compiled`` called with torch's limit of compiled variants per function at least
    :data:`COMPILED_VARIANTS`. Torch (2.13) keeps that setting per context (a thread's, an asyncio task's, a
    ``contextvars`` copy's), so a call raises it in the context it runs in where it is lower, and leaves it
    raised there (a read, about a microsecond, when it already is)."""
    import torch._dynamo

    config = torch._dynamo.config

    def call(*args, **kwargs):
        if config.cache_size_limit < COMPILED_VARIANTS:
            config.cache_size_limit = COMPILED_VARIANTS
        return compiled(*args, **kwargs)

    return call


def is_hf_dir(path: str | None) -> bool:
    """True when ``path`` is a Hugging Face model directory (has ``config.json``)."""
    return bool(path) and os.path.isfile(os.path.join(path, "config.json"))


def read_hf_weights(path: str, flag: str) -> list[tuple[str, Any]]:
    """Every tensor of the Hugging Face model directory ``path``: ``(name, tensor)`` on the CPU, read from its
    ``*.safetensors`` files in name order (one file or the shards of an index).

    :raises PluginError: ``path`` has no ``config.json`` or no safetensors file, or a file cannot be read (the
        message names ``flag``, ``path`` and the cause).
    """
    from safetensors.torch import load_file

    if not is_hf_dir(path):
        raise PluginError(f"{flag} {path}: not a Hugging Face model directory (no config.json).")
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise PluginError(f"{flag} {path}: no *.safetensors weights in the directory.")
    named: list[tuple[str, Any]] = []
    for name in files:
        try:
            named.extend(load_file(os.path.join(path, name), device="cpu").items())
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise PluginError(f"{flag} {path}: cannot read {name} ({_first_line(exc)}).") from exc
    return named


def save_safetensors(named_tensors: dict[str, Any], path: str) -> None:
    """Write ``named_tensors`` (moved to the CPU, contiguous) to ``path`` as safetensors, replacing any
    file there atomically (written aside, then renamed), so a reader never sees half a file."""
    from safetensors.torch import save_file

    save_file({name: t.detach().to("cpu").contiguous() for name, t in named_tensors.items()}, path + ".tmp",
              metadata={"format": "pt"})
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(path + ".tmp", 0o666 & ~umask)  # safetensors creates the file readable by its owner only
    os.replace(path + ".tmp", path)


def write_hf_checkpoint(path: str, weights: dict[str, Any], source: str) -> None:
    """Write a Hugging Face model directory: ``weights`` as ``model.safetensors``, and the
    config, generation config and tokenizer files of ``source`` (the ``--hf-checkpoint``).

    :param weights: HF parameter name -> tensor (any device and dtype; saved as given, on
        the CPU); tied aliases may be left out (``tie_word_embeddings`` restores them).
    :raises PluginError: ``source`` has no readable ``config.json``, or ``path`` cannot be written.
    """
    import shutil

    config = os.path.join(source, "config.json")
    if not os.path.isfile(config):
        raise PluginError(f"--save-hf {path}: --hf-checkpoint {source} has no config.json to copy next to the weights.")
    try:
        os.makedirs(path, exist_ok=True)
        save_safetensors(weights, os.path.join(path, "model.safetensors"))
        _write_unquantized_config(config, os.path.join(path, "config.json"))
        for name in ("generation_config.json", *_TOKENIZER_FILES, "special_tokens_map.json",
                     "added_tokens.json", "chat_template.jinja"):
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(path, name))
    except OSError as exc:
        raise PluginError(f"--save-hf {path}: cannot write the Hugging Face export ({_first_line(exc)}).") from exc


def _write_unquantized_config(source: str, target: str) -> None:
    """Copy config.json, less a ``quantization_config``: the exported weights are the trainer's
    (BF16 or float32) even when ``--hf-checkpoint`` is an FP8 checkpoint."""
    import json
    import shutil

    with open(source) as f:
        config = json.load(f)
    if not isinstance(config, dict) or "quantization_config" not in config:
        shutil.copyfile(source, target)
        return
    del config["quantization_config"]
    with open(target, "w") as f:
        json.dump(config, f, indent=2)


def _weights_problem(path: str, exc: Exception) -> str:
    text = _first_line(exc)
    if "size mismatch" in str(exc):
        return (f"the weights do not match config.json ({text}); the config and the weight files come from "
                "different models.")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) or sorted(glob.glob(os.path.join(path, "*.bin")))
    named = ", ".join(os.path.basename(f) for f in files) or "the weight files"
    return (f"cannot read the weights in {named} ({type(exc).__name__}: {text}); the file is corrupt or truncated: "
            "download or export it again.")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def non_full_attention(config) -> bool:
    """True when a model of ``config`` has sliding-window or other layers that are not full causal attention
    (the layers of transformers' ``DynamicCache`` for it are not all plain ``DynamicLayer``)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return any(type(layer) is not DynamicLayer for layer in getattr(DynamicCache(config=config), "layers", []))
