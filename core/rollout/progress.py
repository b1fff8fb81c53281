"""A progress bar while a rollout generates (samples done / drawn, tokens/s); silent off a TTY."""

from __future__ import annotations

import asyncio
import sys
import time

__all__ = ["RolloutProgress"]


class RolloutProgress:
    """Context manager polling ``await progress()`` twice a second into a tqdm bar on stderr.

    ``progress`` returns ``{"samples_done", "samples_total", "tokens"}`` of the rollout
    generating now (the rollout side's ``progress``, wherever it runs).

    When stderr is not a terminal (CI logs, files) it draws nothing: the one summary line
    per rollout is the record there.
    """

    def __init__(self, progress, rollout_id: int, interval: float = 0.5):
        self.progress = progress
        self.rollout_id = rollout_id
        self.interval = interval
        self.enabled = sys.stderr.isatty()
        self._task = None
        self._bar = None

    def __enter__(self):
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=0, desc=f"rollout {self.rollout_id}", unit="sample", leave=False, file=sys.stderr)
            self._start = time.perf_counter()
            self._task = asyncio.get_event_loop().create_task(self._poll())
        return self

    async def _poll(self) -> None:
        while True:
            self._refresh(await self.progress())
            await asyncio.sleep(self.interval)

    def _refresh(self, p: dict) -> None:
        self._bar.total = max(p["samples_total"], 1)
        self._bar.n = p["samples_done"]
        elapsed = max(time.perf_counter() - self._start, 1e-6)
        self._bar.set_postfix_str(f"{p['tokens'] / elapsed:.0f} tok/s", refresh=False)
        self._bar.refresh()

    def __exit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            self._bar.close()
