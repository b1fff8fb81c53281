"""Seeding a process's random number generators from ``--seed``."""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (each process of a run calls it once)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
