"""How one weight bucket reaches a server from the trainer's own process (the in-process transport).

CUDA tensors: pickled with CUDA IPC handles and base64-encoded, SGLang's
``MultiprocessingSerializer`` format for ``/update_weights_from_tensor`` (the server maps
the trainer's memory). CPU tensors: a safetensors file for ``/update_weights_from_disk``.
"""

from __future__ import annotations

import os
from typing import Any

from furlong.kit.hf import save_safetensors

__all__ = ["save_bucket", "serialize_cuda_bucket"]


def save_bucket(named_tensors: list[tuple[str, Any]], directory: str) -> None:
    """Write one bucket to ``directory/model.safetensors``, replacing the last one (written aside, then renamed)."""
    save_safetensors(dict(named_tensors), os.path.join(directory, "model.safetensors"))


def serialize_cuda_bucket(named_tensors: list[tuple[str, Any]]) -> str:
    """``[(name, tensor)]`` pickled with CUDA IPC handles, base64 (SGLang's ``MultiprocessingSerializer``)."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the CUDA tensor reductions with ForkingPickler

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([(name, tensor.detach()) for name, tensor in named_tensors])
    return base64.b64encode(buffer.getvalue()).decode("ascii")
