"""Random 0/1 reward: a baseline and a plumbing check (no grading at all)."""

from __future__ import annotations

import random

from furlong.hooks import hookimpl

__all__ = ["boxed_response", "reward"]


@hookimpl
def reward(config, samples):
    """Score each sample with an integer drawn uniformly from {0, 1}, ignoring its content.

    Uses Python's global ``random`` generator, so ``random.seed`` makes it repeatable.

    Flags: none.

    :param samples: finished samples (nothing is read).
    :returns: one int per sample, 0 or 1.
    """
    return [random.randint(0, 1) for _ in samples]


def boxed_response(content: str) -> str:
    """The response ``boxed_random`` hands to this grader: ``\\boxed{content}`` (unread)."""
    return "\\boxed{" + content + "}"
