"""Deterministic pseudo-random 0/1 reward from a hash of the sample: reproducible plumbing checks."""

from __future__ import annotations

import hashlib

from furlong.hooks import hookimpl

__all__ = ["boxed_response", "reward", "hash_bit"]


@hookimpl
def reward(config, samples):
    """Score each sample with the parity of the first byte of SHA-256 of its tokens and response.

    ``reward = sha256((str(tokens) + response).encode("utf-8")).digest()[0] % 2``: the same
    sample always gets the same reward, in any process, on any machine.

    Flags: none.

    :param samples: finished samples; ``tokens`` (list of int) and ``response`` (str) are read.
    :returns: one int per sample, 0 or 1.
    """
    return [hash_bit(s.tokens, s.response or "") for s in samples]


def boxed_response(content: str) -> str:
    """The response ``boxed_deterministic_random`` hashes: ``\\boxed{content}``."""
    return "\\boxed{" + content + "}"


def hash_bit(tokens: list[int], response: str) -> int:
    """First byte of SHA-256 of ``str(tokens) + response`` (UTF-8), mod 2."""
    return hashlib.sha256((str(tokens) + response).encode("utf-8")).digest()[0] % 2
