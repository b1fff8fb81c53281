"""How far the rollout generating now has come: samples drawn, samples generated, tokens."""

from __future__ import annotations

from furlong.hooks import Sample

__all__ = ["GenerationProgress"]


class GenerationProgress:
    """Counts of the current rollout, for the progress bar (evaluation samples are not counted)."""

    def __init__(self) -> None:
        self.samples_done = 0
        self.tokens = 0
        self.samples_total = 0

    def restart(self) -> None:
        """A new rollout starts: every count back to 0."""
        self.samples_done = self.tokens = self.samples_total = 0

    def drawn(self, groups: list[list[Sample]]) -> None:
        """The rollout drew ``groups``: their samples join the total."""
        self.samples_total += sum(len(g) for g in groups)

    def generated(self, samples: list[Sample]) -> None:
        """``samples`` finished a ``generate`` call: count them and their response tokens."""
        for sample in samples:
            self.samples_done += 1
            self.tokens += sample.response_length

    def as_dict(self) -> dict[str, int]:
        """``{"samples_done", "tokens", "samples_total"}``."""
        return {"samples_done": self.samples_done, "tokens": self.tokens, "samples_total": self.samples_total}
