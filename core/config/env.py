"""What this machine offers: the probes behind the device-dependent flag defaults.

Each probe is a module-level function so tests can monkeypatch it
(``monkeypatch.setattr(furlong.core.config.env, "cuda_available", lambda: True)``);
callers look them up through the module at call time.
"""

from __future__ import annotations

import importlib.util

__all__ = ["cuda_available", "megatron_available", "sglang_available"]


def cuda_available() -> bool:
    """True when torch sees at least one CUDA device."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def sglang_available() -> bool:
    """True when the ``sglang`` package is importable (its server can be launched)."""
    return _importable("sglang")


def megatron_available() -> bool:
    """True when ``megatron.core`` is importable."""
    return _importable("megatron.core")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a missing parent package raises instead of returning None
        return False
