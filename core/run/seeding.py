"""Seeding a process's random number generators from ``--seed``, and ``--deterministic-mode``."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

__all__ = ["CUBLAS_WORKSPACE", "deterministic_kernels", "seed_everything"]

CUBLAS_WORKSPACE = ":4096:8"
"""``CUBLAS_WORKSPACE_CONFIG`` under ``--deterministic-mode``: cuBLAS (CUDA 10.2+) is deterministic only with a
fixed workspace (NVIDIA's cuBLAS documentation, "Results reproducibility")."""


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python's, NumPy's and torch's global generators (each process of a run calls it once);
    with ``deterministic`` (``--deterministic-mode``) also :func:`deterministic_kernels`."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if deterministic:
        deterministic_kernels()


def deterministic_kernels() -> None:
    """Make torch pick deterministic kernels in this process, or fail on an operation that has none.

    ``torch.use_deterministic_algorithms(True)`` (an operation without a deterministic
    implementation raises ``RuntimeError`` naming it), cuDNN deterministic and without
    benchmarking, TF32 matmuls off, and ``CUBLAS_WORKSPACE_CONFIG`` (:data:`CUBLAS_WORKSPACE`) unless set.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
