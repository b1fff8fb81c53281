"""``--embedded-torch-compile``: the model's decoder layers and the sampler through ``torch.compile``.

A decode step of a small model is a long chain of small kernels (RMSNorm alone is about
seven per call), each a few microseconds even inside a CUDA graph. Compiling each decoder
layer (regional compilation: the layers share one compiled code, their parameters are
inputs of it) fuses the norms, the rotary embedding, the MLP's activation and product and
the residual adds; compiling :func:`~.sampling.sample_batch` fuses the passes over the
``[rows, vocabulary]`` logits. The slot attention (:func:`~.slots.slot_attention`) is left
to run as it is (dynamo does not trace it), so the compiled code never sees the cache.

The compiled code is then captured in the decoder's CUDA graphs like the uncompiled one.
Parameters stay inputs, so weights copied in place reach it. Dynamo compiles a new shape
once, then makes the sizes that changed dynamic, so a run compiles a few times per layer
shape (decode, prefill), seconds each; inductor's on-disk cache shortens later starts.
"""

from __future__ import annotations

from furlong.kit.hf import compile_decoder_layers, decoder_layers

from .sampling import sample_batch

__all__ = ["compile_model", "compiled_sampler", "decoder_layers", "uncompile_model"]


def compile_model(model, backend: str) -> int:
    """Compile every decoder layer of ``model`` in place with ``torch.compile(backend=backend)``.

    :returns: the number of layers compiled.
    :raises PluginError: the model names no decoder layer class (``_no_split_modules``).
    """
    return compile_decoder_layers(model, "--embedded-torch-compile", backend)


def uncompile_model(model) -> None:
    """Undo :func:`compile_model` (the layers run their plain forward again)."""
    for layer in decoder_layers(model):
        layer._compiled_call_impl = None


def compiled_sampler(backend: str):
    """:func:`~.sampling.sample_batch` compiled with ``backend``."""
    import torch

    return torch.compile(sample_batch, backend=backend)
