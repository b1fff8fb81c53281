"""The in-process executor pieces shared by the ``local`` plugin and its ``torchrun`` variant."""

from __future__ import annotations

__all__ = ["InProcessWorkers", "LocalExecutor"]


class InProcessWorkers:
    """One worker in this process behind :class:`furlong.hooks.WorkerGroup`."""

    size = 1

    def __init__(self, worker) -> None:
        self.worker = worker

    async def call(self, method: str, args_per_rank):
        [args] = args_per_rank
        if args is None:
            return [None]
        return [await getattr(self.worker, method)(*args)]


class LocalExecutor:
    """:class:`furlong.hooks.Executor` for one process."""

    is_driver = True
    weights_in_process = True

    async def start_train_workers(self, config, make_worker):
        return InProcessWorkers(make_worker(0, 1))

    async def start_engines(self, config, make_engine):
        """``--rollout-num-gpus / --rollout-num-gpus-per-engine`` engines (at least one), started together.

        If one fails, the others are stopped (``shutdown``, for engines that own processes)
        and the first error is raised.
        """
        per_engine = int(config.rollout_num_gpus_per_engine or 1)
        return await _start_all(max(1, int(config.rollout_num_gpus or per_engine) // per_engine), make_engine)

    async def start_eval_engines(self, config, make_engine):
        """The dedicated eval fleet: ``--eval-num-gpus / --eval-num-gpus-per-engine`` engines (at least one),
        started as :meth:`start_engines` starts the rollout engines."""
        return await _start_all(max(1, int(config.eval_num_gpus) // int(config.eval_num_gpus_per_engine)),
                                make_engine)

    async def start_rollout_side(self, config, make_rollout_side):
        return make_rollout_side()

    async def serve(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None


async def _start_all(count: int, make_engine) -> list:
    """``await make_engine(i)`` for ``i < count`` at once; if one fails the others are shut down and its error raised."""
    import asyncio

    made = await asyncio.gather(*(make_engine(i) for i in range(count)), return_exceptions=True)
    errors = [e for e in made if isinstance(e, BaseException)]
    if errors:
        await asyncio.gather(*(e.shutdown() for e in made if not isinstance(e, BaseException)
                               and hasattr(e, "shutdown")), return_exceptions=True)
        raise errors[0]
    return list(made)
