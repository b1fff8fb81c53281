"""Reading ``/update_weights_from_tensor``'s ``serialized_named_tensors``: pickled tensors, base64.

The payload is what SGLang's ``MultiprocessingSerializer`` writes: ``[(name, tensor), ...]``
pickled by ``multiprocessing.reduction.ForkingPickler`` (with torch's reductions a CUDA
tensor travels as an IPC handle, a CPU tensor as a shared-memory file name), then
base64-encoded. One payload per TP rank; a server of one rank reads the first.

A pickle can name any callable, so this reader loads only the globals such a payload
holds: plain containers, torch's ``rebuild_*`` functions of
``torch.multiprocessing.reductions``, torch's storage classes, ``torch.Size`` and dtypes.
Anything else is refused.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from typing import Any

__all__ = ["PayloadError", "read_named_tensors"]

_BUILTINS = {"list", "tuple", "dict", "str", "int", "float", "bool", "bytes", "bytearray"}


class PayloadError(ValueError):
    """A payload that is not base64, not a pickle of named tensors, or names a global not allowed."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        allowed = ((module == "builtins" and name in _BUILTINS)
                   or (module == "torch.multiprocessing.reductions" and name.startswith("rebuild_"))
                   or (module == "torch.storage" and name in ("UntypedStorage", "TypedStorage"))
                   or (module == "torch" and (name in ("Size", "Tensor")
                                              or isinstance(getattr(torch, name, None), torch.dtype))))
        if not allowed:
            raise PayloadError(f"the payload names {module}.{name}, which a tensor payload never holds")
        return super().find_class(module, name)


def read_named_tensors(payload: str) -> list[tuple[str, Any]]:
    """``[(name, tensor)]`` from one base64 payload.

    :raises PayloadError: see the class; the message says what is wrong.
    """
    import torch
    import torch.multiprocessing  # noqa: F401 - registers torch's reductions, whose rebuild functions load here

    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise PayloadError(f"not base64 ({exc})") from None
    try:
        named = _Unpickler(io.BytesIO(raw)).load()
    except PayloadError:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign pickle, a shared-memory file gone
        raise PayloadError(f"not a readable tensor pickle ({type(exc).__name__}: {exc})") from None
    if not (isinstance(named, list) and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                            and isinstance(p[1], torch.Tensor) for p in named)):
        raise PayloadError("the payload is not a list of (name, tensor) pairs")
    return named
