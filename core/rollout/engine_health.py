"""Periodic rollout-engine health checks (``--use-fault-tolerance``, Miles' rollout health monitor).

Every ``--rollout-health-check-interval`` seconds (after ``--rollout-health-check-first-wait``)
the driver asks each engine ``health()``; an engine that answers False, raises, or takes
longer than ``--rollout-health-check-timeout`` is restarted through its ``recover()`` (the
path a failed weight sync takes: the replacement gets the current weights through its
``on_restart`` callback). An engine whose plugin offers no ``recover()`` is reported, once
per failure. Checks pause while the engines have given their memory to the trainer
(``--offload-rollout``) and start again, after the first wait, when they resume.
"""

from __future__ import annotations

import asyncio
import logging

from furlong.hooks import RunConfig

__all__ = ["EngineHealthMonitor", "health_monitor_wanted"]

log = logging.getLogger("furlong.engines")


def health_monitor_wanted(config: RunConfig) -> bool:
    """``--use-fault-tolerance`` with ``rollout`` among ``--ft-components`` (the default), and engines in use."""
    components = config.ft_components or ("rollout",)
    return config.use_fault_tolerance and "rollout" in components and not config.debug_train_only


class EngineHealthMonitor:
    """Checks ``engines`` in the background; :meth:`start`, :meth:`pause`, :meth:`resume`, :meth:`stop`.

    :param interval: seconds between rounds; :param timeout: seconds one ``health()`` may
        take; :param first_wait: seconds before the first round after a start or resume.
    """

    def __init__(self, engines: list, interval: float, timeout: float, first_wait: float) -> None:
        self.engines = list(engines)
        self.interval, self.timeout, self.first_wait = interval, timeout, first_wait
        self.restarts = 0
        self._reported: set[int] = set()  # engines without recover() already reported unhealthy
        self._task: asyncio.Task | None = None
        self._running = asyncio.Event()
        self._waited = False

    @classmethod
    def from_config(cls, config: RunConfig, engines: list) -> EngineHealthMonitor:
        """A monitor of ``engines`` on the ``--rollout-health-check-*`` timings."""
        return cls(engines, config.rollout_health_check_interval, config.rollout_health_check_timeout,
                   config.rollout_health_check_first_wait)

    def start(self) -> None:
        self._running.set()
        self._task = asyncio.ensure_future(self._loop())

    @property
    def running(self) -> bool:
        """Started and not paused."""
        return self._running.is_set()

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        if not self._running.is_set():
            self._waited = False
            self._running.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await self._running.wait()
            if not self._waited:
                await asyncio.sleep(self.first_wait)
                self._waited = True
                continue  # paused during the wait: wait again at the next resume
            await self.check_all()
            await asyncio.sleep(self.interval)

    async def check_all(self) -> int:
        """One round: check every engine, restart the failed ones; returns how many were restarted."""
        restarted = 0
        for index, engine in enumerate(self.engines):
            if not self._running.is_set():
                break
            if await self._healthy(engine):
                self._reported.discard(index)
                continue
            who = getattr(engine, "who", f"engine {index}")
            if not hasattr(engine, "recover"):
                if index not in self._reported:
                    log.error("%s failed its health check and cannot be restarted (its plugin has no recover()).",
                              who)
                    self._reported.add(index)
                continue
            log.warning("%s failed its health check; restarting it.", who)
            await engine.recover()
            restarted += 1
        self.restarts += restarted
        return restarted

    async def _healthy(self, engine) -> bool:
        try:
            return bool(await asyncio.wait_for(engine.health(), self.timeout))
        except Exception:  # noqa: BLE001 - a timeout or an error is a failed check
            return False
