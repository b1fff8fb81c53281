"""Epoch order for data sources: which row comes next, rolling over epochs, with a resumable position."""

from __future__ import annotations

import random

__all__ = ["EpochOrder"]


class EpochOrder:
    """Indices ``0 .. n-1`` in epoch order; past the last one the next epoch starts.

    With ``shuffle`` each epoch is a permutation drawn with ``random.Random(seed + epoch)``
    (the ``jsonl`` source's order under ``--rollout-shuffle`` and ``--rollout-seed``), so a
    position saved with :meth:`state` resumes on the same rows.

    :param n: number of rows.
    :param shuffle: permute each epoch.
    :param seed: base seed of the permutations.
    """

    def __init__(self, n: int, shuffle: bool = False, seed: int = 0):
        self.n, self.shuffle, self.seed = n, bool(shuffle), int(seed)
        self.epoch = 0
        self.offset = 0
        self._order = self._permutation(0)

    def take(self, k: int) -> list[int]:
        """The next ``k`` indices (an epoch boundary may fall inside them).

        :raises ValueError: ``k`` > 0 indices asked of zero rows.
        """
        if k > 0 and self.n == 0:
            raise ValueError("no rows to take from")
        out: list[int] = []
        while len(out) < k:
            if self.offset >= self.n:
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = self._order[self.offset:self.offset + k - len(out)]
            self.offset += len(take)
            out.extend(take)
        return out

    def state(self) -> dict:
        """JSON-serializable position: ``epoch``, ``offset``, ``seed``, ``shuffle``."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle}

    def load_state(self, state: dict) -> None:
        """Resume at a position :meth:`state` returned (its ``epoch`` and ``offset``)."""
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order
