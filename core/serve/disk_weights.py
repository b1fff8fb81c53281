"""Reading a Hugging Face safetensors directory in buckets, for ``/update_weights_from_disk``."""

from __future__ import annotations

import glob
import os
from typing import Any, Iterator

__all__ = ["read_safetensors_dir"]


def read_safetensors_dir(path: str) -> Iterator[list[tuple[str, Any]]]:
    """Yield the tensors of ``path/*.safetensors``, one file (one list of ``(name, tensor)``) at a time.

    Names are as stored (Hugging Face names for a ``save_pretrained`` directory); tensors
    are CPU tensors in the file's dtype.

    :raises ValueError: ``path`` is not a directory or holds no ``*.safetensors`` file.
    """
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model_path {path!r}: no *.safetensors files"
                         + ("" if os.path.isdir(path) else " (not a directory)"))
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            yield [(name, handle.get_tensor(name)) for name in handle.keys()]
