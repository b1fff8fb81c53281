"""Seeding, generating and scoring the samples of one group, under the concurrency limit and the abort."""

from __future__ import annotations

import asyncio
import hashlib

from furlong.hooks import PluginError, RolloutEngine, RunConfig, Sample, Status
from furlong.hooks.contract import check_generate_result
from furlong.hooks.run_config import thaw_value

from ..plugins.manager import FurlongPluginManager
from ..plugins.selection import Selection
from .generation_progress import GenerationProgress
from .group_ledger import is_aborted
from .opd_teacher import OpdTeacher
from .rewards import RewardScorer

__all__ = ["SampleRunner", "sample_seed", "train_sampling_params"]


def train_sampling_params(config: RunConfig) -> dict:
    """SGLang-style sampling parameters of training rollouts (``stop`` lists as lists)."""
    return {
        "temperature": config.rollout_temperature,
        "top_p": config.rollout_top_p,
        "top_k": config.rollout_top_k,
        "max_new_tokens": config.rollout_max_response_len,
        "stop": thaw_value(config.rollout_stop),
        "stop_token_ids": thaw_value(config.rollout_stop_token_ids),
        "skip_special_tokens": config.rollout_skip_special_tokens,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }


def sample_seed(seed: int, index: int | None, evaluation: bool) -> int:
    """The ``sampling_seed`` of a sample's requests: a hash of ``--seed``, the sample index and the phase.

    Fixed per sample, so a run samples the same tokens whatever process, engine or
    request order serves it, and a resumed run (whose sample counters come from the
    checkpoint) samples what the uninterrupted run would have. Evaluation samples get
    the same seeds at every evaluation (common random numbers across checkpoints).

    :returns: a non-negative int below ``2**62``.
    """
    key = f"{int(seed)}:{'eval' if evaluation else 'train'}:{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 2


class SampleRunner:
    """Runs the ``generate`` hook on each sample (seeded, at most ``--sglang-server-concurrency`` at once),
    then the served OPD teacher (``--use-opd --opd-type sglang``, training samples), then the reward;
    :meth:`abort` stops new requests until :meth:`clear_abort`.

    :param progress: counts the training samples generated (evaluation samples are not counted).
    """

    def __init__(self, config: RunConfig, pm: FurlongPluginManager, selection: Selection, engine: RolloutEngine,
                 progress: GenerationProgress):
        self.config = config
        self.pm = pm
        self.selection = selection
        self.engine = engine
        self.progress = progress
        self.scorer = RewardScorer(config, pm, selection)
        self.teacher = OpdTeacher(config) if config.use_opd else None  # the served teacher: the only --opd-type
        self.semaphore = asyncio.Semaphore(max(1, int(config.sglang_server_concurrency)))
        self.aborted = False

    async def generate_group(self, group: list[Sample], evaluation: bool = False,
                             sampling_params: dict | None = None) -> list[Sample]:
        """Generate and score every sample of ``group`` (concurrently), in place; return the group.

        Samples already ``completed``/``truncated`` (popped from the buffer) are kept as they
        are. A sample reached after an abort is marked ``aborted`` without a request.
        Rewards: one call per sample, or one per group under ``--group-rm``; aborted
        samples are never scored.

        :raises PluginError: a generate or reward plugin failed or returned a malformed result.
        """
        params = sampling_params or train_sampling_params(self.config)
        results = await asyncio.gather(*(self._generate_one(s, params, evaluation) for s in group))
        flat = [s for r in results for s in (r if isinstance(r, list) else [r])]
        group[:] = flat
        to_score = [s for s in flat if s.status not in (Status.ABORTED, Status.PENDING) and s.reward is None]
        if to_score and self.teacher is not None and not evaluation:
            await self.teacher.score(to_score)
        if to_score and self.config.group_rm and not evaluation:
            if not is_aborted(flat):
                await self.scorer.score(to_score)
        elif to_score:
            await asyncio.gather(*(self.scorer.score([s], evaluation) for s in to_score))
        return group

    async def _generate_one(self, sample: Sample, params: dict, evaluation: bool) -> Sample | list[Sample]:
        if sample.status not in (Status.PENDING, Status.ABORTED):
            return sample
        async with self.semaphore:
            if self.aborted:
                sample.status = Status.ABORTED
                return sample
            name, flag = self.selection.chosen["generate"]
            params = dict(params)
            params.setdefault("sampling_seed", sample_seed(self.config.seed, sample.index, evaluation))
            try:
                result = await self.pm.call_chosen("generate", name, flag, config=self.config, sample=sample,
                                                   sampling_params=params, engine=self.engine, evaluation=evaluation)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(f"generate plugin '{name}' ({self.pm.origin(name)}) failed on sample "
                                  f"{sample.index}: {type(exc).__name__}: {exc}") from exc
            check_generate_result(result, f"generate plugin '{name}' ({self.pm.origin(name)})", sample.index)
        if not evaluation:
            self.progress.generated(result if isinstance(result, list) else [result])
        return result

    async def abort(self, rollout_id: int) -> None:
        """Abort leftovers: no new requests, abort the engine's in-flight ones, broadcast ``abort``."""
        self.aborted = True
        await self.engine.abort()
        await self.pm.broadcast("abort", config=self.config, rollout_id=rollout_id)

    def clear_abort(self) -> None:
        """Serve requests again (a new rollout starts, or the aborted one ended)."""
        self.aborted = False

    async def close(self) -> None:
        """Close the teacher's HTTP session (end of the run)."""
        if self.teacher is not None:
            await self.teacher.close()
