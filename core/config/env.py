"""What this machine offers: the probes behind the device-dependent flag defaults.

Each probe is a module-level function so tests can monkeypatch it
(``monkeypatch.setattr(furlong.core.config.env, "cuda_available", lambda: True)``);
callers look them up through the module at call time.
"""

from __future__ import annotations

import importlib.util

__all__ = ["cuda_available", "cuda_device_count", "describe_machine", "furlong_plugin_installed",
           "gpu_memory", "megatron_available", "sglang_available"]


def cuda_available() -> bool:
    """True when torch sees at least one CUDA device."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def cuda_device_count() -> int:
    """The number of CUDA devices torch can see (``CUDA_VISIBLE_DEVICES`` applies); 0 without CUDA."""
    if not cuda_available():
        return 0
    import torch

    return int(torch.cuda.device_count())


def gpu_memory() -> tuple[str, int, int]:
    """``(name, total bytes, free bytes)`` of the first CUDA device; ``("", 0, 0)`` when torch cannot tell."""
    if importlib.util.find_spec("torch") is None:
        return "", 0, 0
    import torch

    try:
        free, total = torch.cuda.mem_get_info(0)
        return torch.cuda.get_device_name(0), int(total), int(free)
    except (AssertionError, RuntimeError):  # no CUDA runtime, or a device that cannot be queried
        return "", 0, 0


def describe_machine():
    """The :class:`furlong.hooks.Machine` plugins' ``configure`` hooks see (``report.machine``),
    from the probes above (module globals, so a test that monkeypatches them fakes a GPU machine)."""
    from furlong.hooks import Machine

    if not cuda_available():
        return Machine()
    name, total, free = gpu_memory()
    return Machine(cuda=True, gpu_name=name, gpu_count=cuda_device_count(), gpu_total_bytes=total,
                   gpu_free_bytes=free)


def furlong_plugin_installed(name: str) -> bool:
    """True when an installed distribution registers plugin ``name`` in entry-point group ``furlong``.

    Reads the metadata only (nothing is imported). A third-party package such as ``sglang``
    or ``megatron-core`` registers no furlong plugin; furlong's own distribution registers
    the ``sglang`` and ``megatron`` plugins that use them.
    """
    import importlib.metadata as md

    return any(ep.name == name for ep in md.entry_points(group="furlong"))


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
