"""On-policy distillation with a served teacher (``--use-opd --opd-type sglang``): the teacher's log-probs
of each finished sample's response, from SGLang's ``/generate`` (or ``furlong serve``'s).

For each training sample, once generated and before it is scored, the teacher is asked to
score the sample's tokens without generating: ``{"input_ids": tokens, "sampling_params":
{"max_new_tokens": 0, "temperature": 0}, "return_logprob": true, "logprob_start_len": 0}``.
Its ``meta_info.input_token_logprobs`` holds ``[log-prob, token id, ...]`` per input
position (the first position has none); the last ``response_length`` entries are the
teacher's log-probs of the response tokens, stored in ``Sample.teacher_log_probs``. The
advantage stage then adds ``-opd_kl_coef * (logp_student - logp_teacher)`` per token.

The teacher of a sample: ``--opd-teacher-urls NAME=URL`` routes by
``metadata[--opd-teacher-key]``; a sample naming no known teacher goes to the one named
``default``, else to ``--rm-url``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from furlong.hooks import PluginError, RunConfig, Sample

__all__ = ["OpdTeacher", "teacher_body", "teacher_log_probs"]

TIMEOUT_S = 600.0
RETRIES = 3


def teacher_body(tokens: list[int]) -> dict:
    """The ``/generate`` request that scores ``tokens`` without generating."""
    return {"input_ids": list(tokens), "sampling_params": {"max_new_tokens": 0, "temperature": 0.0,
                                                           "skip_special_tokens": False},
            "return_logprob": True, "logprob_start_len": 0}


def teacher_log_probs(answer: Any, response_length: int, where: str) -> list[float]:
    """The response's teacher log-probs from a ``/generate`` answer (a dict, or a one-item list).

    :raises PluginError: the answer has no ``meta_info.input_token_logprobs``, or fewer
        scored positions than the response has tokens.
    """
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    entries = (answer.get("meta_info") or {}).get("input_token_logprobs") if isinstance(answer, dict) else None
    if not isinstance(entries, list):
        raise PluginError(f"{where}: the answer has no meta_info.input_token_logprobs; the server must be SGLang's "
                          "/generate (or furlong serve's) with return_logprob.")
    scored = entries[1:]
    if response_length > len(scored):
        raise PluginError(f"{where}: the teacher scored {len(scored)} positions, fewer than the response's "
                          f"{response_length} tokens.")
    return [float(entry[0]) for entry in scored[len(scored) - response_length:]]


class OpdTeacher:
    """The served teacher(s) of a run; :meth:`score` fills ``teacher_log_probs`` of finished samples."""

    def __init__(self, config: RunConfig) -> None:
        self.routes = dict(item.partition("=")[::2] for item in config.opd_teacher_urls or ())
        self.fallback = self.routes.get("default") or config.rm_url
        self.key = config.opd_teacher_key
        self._session = None

    def url_of(self, sample: Sample) -> str:
        """The teacher URL that scores ``sample``.

        :raises PluginError: the sample names no known teacher and there is no ``default`` nor ``--rm-url``.
        """
        name = (sample.metadata or {}).get(self.key)
        if name is not None and str(name) in self.routes:
            return self.routes[str(name)]
        if self.fallback:
            return self.fallback
        raise PluginError(f"--opd-teacher-urls: sample {sample.index} has metadata[{self.key!r}]={name!r}, which "
                          f"names none of {sorted(self.routes)}, and there is no 'default' teacher nor --rm-url.")

    async def score(self, samples: list[Sample]) -> None:
        """Ask the teacher for every sample's response log-probs, concurrently, and store them.

        :raises PluginError: a request failed after its retries, or an answer is malformed
            (naming the URL and the sample).
        """
        await asyncio.gather(*(self._score_one(sample) for sample in samples))

    async def _score_one(self, sample: Sample) -> None:
        url = self.url_of(sample)
        where = f"--use-opd teacher {url} (sample {sample.index})"
        answer = await self._post(url, teacher_body(sample.tokens), where)
        sample.teacher_log_probs = teacher_log_probs(answer, sample.response_length, where)

    async def _post(self, url: str, body: dict, where: str) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        problem = ""
        for attempt in range(RETRIES + 1):
            try:
                async with self._session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as r:
                    if r.status < 400:
                        return await r.json(content_type=None)
                    problem = f"HTTP {r.status}: {(await r.text()).strip()[:300]}"
                    if r.status < 500 and r.status != 429:
                        break
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if attempt < RETRIES:
                await asyncio.sleep(0.5 * 2 ** attempt)
        raise PluginError(f"{where}: the request failed ({problem}); check that the teacher server is up and serves "
                          "SGLang's /generate.")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
