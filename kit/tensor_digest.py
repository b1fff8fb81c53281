"""Fingerprints of tensors: whether two copies of a weight agree bit for bit (``--check-weight-update-equal``)."""

from __future__ import annotations

import hashlib

__all__ = ["named_digests", "tensor_digest"]


def tensor_digest(tensor) -> str:
    """SHA-256 (hex) of ``tensor``'s bytes in its own dtype, row-major; device and strides do not matter.

    Two tensors of one dtype and shape have the same digest exactly when every element is bitwise equal.
    """
    import torch

    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def named_digests(named_tensors) -> dict[str, tuple[str, list[int], str]]:
    """``{name: (dtype, shape, digest)}`` of ``(name, tensor)`` pairs; ``dtype`` without ``torch.`` (``"bfloat16"``)."""
    return {name: (str(t.dtype).removeprefix("torch."), list(t.shape), tensor_digest(t)) for name, t in named_tensors}

