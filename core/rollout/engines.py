"""Several rollout engines behind one :class:`~furlong.hooks.RolloutEngine`, and the picklable engine factory.

The rollout manager talks to one engine. With several (``--rollout-num-gpus`` /
``--rollout-num-gpus-per-engine`` engines under the Ray executor) :class:`EngineSet`
sends each request to the engine with the fewest requests in flight and every control
call (abort, pause, continue, memory) to all of them. Weight sync talks to each engine
itself (:mod:`furlong.core.run.weight_sync`).
"""

from __future__ import annotations

import asyncio
import operator
from typing import Any

from furlong.hooks import GenerateOutput, PluginError, RolloutEngine, RunConfig

__all__ = ["EngineFactory", "EngineSet", "NoEngine", "checked_engine"]


# the RolloutEngine members the core calls and reads, checked when the rollout_engine hook hands an engine over
ENGINE_METHODS = ("generate", "abort", "pause_generation", "continue_generation", "flush_cache", "load_weights",
                  "set_weight_version", "release_memory", "resume_memory", "health")
ENGINE_DATA = ("tokenizer", "weight_update_ranks", "context_len")


class EngineFactory:
    """``await make_engine(i)`` for :meth:`furlong.hooks.Executor.start_engines`.

    Calls the chosen ``rollout_engine`` plugin. Picklable: a copy sent to another process
    builds its own plugin manager there.
    """

    def __init__(self, config: RunConfig, chosen: tuple[str, str], pm: Any = None) -> None:
        self.config, self.chosen, self.pm = config, tuple(chosen), pm

    async def __call__(self, index: int) -> RolloutEngine:
        pm = self.pm
        if pm is None:  # a process of its own (an engine actor)
            from ..plugins.selection import plugins_of_this_process

            pm = plugins_of_this_process(self.config, hooks=("rollout_engine",))
        name, flag = self.chosen
        engine = await pm.call_chosen("rollout_engine", name, flag, config=self.config, engine_index=index)
        return checked_engine(engine, name, flag)

    def __getstate__(self) -> dict:
        return {"config": self.config, "chosen": self.chosen, "pm": None}


def checked_engine(engine: Any, name: str, flag: str) -> RolloutEngine:
    """``engine``, which plugin ``name`` (chosen by ``flag``) returned, if it has every member of a rollout engine
    the core calls or reads (:data:`ENGINE_METHODS`, :data:`ENGINE_DATA`).

    :raises PluginError: it lacks some (all named).
    """
    missing = [m for m in ENGINE_METHODS if not callable(getattr(engine, m, None))]
    missing += [m for m in ENGINE_DATA if not hasattr(engine, m)]
    if missing:
        raise PluginError(f"{flag} '{name}': the engine it returned ({type(engine).__name__}) lacks "
                          f"{', '.join(missing)} (see furlong.hooks.RolloutEngine; subclassing it gives the "
                          "documented defaults of weight_update_ranks and context_len).")
    return engine


class EngineSet:
    """:class:`~furlong.hooks.RolloutEngine` over several engines (least requests in flight first)."""

    def __init__(self, engines: list) -> None:
        self.engines = list(engines)
        self.tokenizer = self.engines[0].tokenizer
        self._in_flight = [0] * len(self.engines)

    async def generate(self, input_ids: list[int], sampling_params: dict) -> GenerateOutput:
        i = min(range(len(self.engines)), key=self._in_flight.__getitem__)
        self._in_flight[i] += 1
        try:
            return await self.engines[i].generate(input_ids, sampling_params)
        finally:
            self._in_flight[i] -= 1

    async def _all(self, method: str, *args) -> None:
        call = operator.methodcaller(method, *args)
        await asyncio.gather(*(call(e) for e in self.engines))

    async def abort(self) -> None:
        await self._all("abort")

    async def pause_generation(self, mode: str) -> None:
        await self._all("pause_generation", mode)

    async def continue_generation(self) -> None:
        await self._all("continue_generation")

    async def flush_cache(self) -> None:
        await self._all("flush_cache")

    async def release_memory(self) -> None:
        await self._all("release_memory")

    async def resume_memory(self) -> None:
        await self._all("resume_memory")

    async def health(self) -> bool:
        return all(await asyncio.gather(*(e.health() for e in self.engines)))


class NoEngine:
    """The engine of a run that starts none (``--debug-train-only``): asking it to generate is an error
    naming the flag; control calls do nothing."""

    tokenizer = None
    weight_update_ranks = 0
    context_len = 0

    async def generate(self, input_ids: list[int], sampling_params: dict) -> GenerateOutput:
        raise PluginError("--debug-train-only starts no rollout engine, so nothing can be generated: pass "
                          "--load-debug-rollout-data PATH to train on rollouts saved by --save-debug-rollout-data, "
                          "or drop --debug-train-only.")

    async def abort(self) -> None:
        """Nothing runs."""

    async def pause_generation(self, mode: str) -> None:
        """Nothing runs."""

    async def continue_generation(self) -> None:
        """Nothing runs."""

    async def flush_cache(self) -> None:
        """Nothing is cached."""

    async def release_memory(self) -> None:
        """Nothing is held."""

    async def resume_memory(self) -> None:
        """Nothing is held."""

    async def health(self) -> bool:
        return True
