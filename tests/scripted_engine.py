"""A deterministic RolloutEngine for rollout-logic tests: answers come from a script.

It implements the real Protocol (batching aside): a character tokenizer, per-token
log-probs, finish reasons, abort that returns the partial tokens, weight versions.
"""

from __future__ import annotations

import asyncio

from furlong.hooks import GenerateOutput
from furlong.hooks.testing import CharTokenizer


class ScriptedEngine:
    """``answer(prompt_text, call_number) -> (text, finish_reason)``; ``delay`` seconds per token."""

    def __init__(self, answer, delay: float = 0.0):
        self.tokenizer = CharTokenizer()
        self.answer = answer
        self.delay = delay
        self.requests: list[dict] = []
        self.version = 0
        self._aborted = asyncio.Event()
        self.abort_calls = 0
        self.phases: list[tuple] = []  # weight-update calls in order

    async def generate(self, input_ids, sampling_params):
        self.requests.append({"input_ids": list(input_ids), **sampling_params})
        text, reason = self.answer(self.tokenizer.decode(input_ids), len(self.requests))
        ids = [ord(c) for c in text]
        budget = sampling_params["max_new_tokens"]
        budget = 128 if budget is None else budget  # SGLang's default
        out = []
        for tok in ids[:budget]:
            if self.delay:
                await asyncio.sleep(self.delay)
            if self._aborted.is_set():
                reason = "abort"
                break
            out.append(tok)
        else:
            if len(ids) > budget:
                reason = "length"
        return GenerateOutput(output_ids=out, output_log_probs=[-0.5] * len(out), finish_reason=reason,
                              weight_version=str(self.version), text=self.tokenizer.decode(out))

    async def abort(self):
        self.abort_calls += 1
        self._aborted.set()
        await asyncio.sleep(0)

    def reset_abort(self):
        self._aborted.clear()

    async def pause_generation(self, mode):
        self.phases.append(("pause", mode))

    async def flush_cache(self):
        self.phases.append(("flush",))

    async def load_weights(self, named_tensors):
        self.phases.append(("load", [name for name, _ in named_tensors]))

    async def set_weight_version(self, version):
        self.phases.append(("version", version))
        self.version = version

    async def continue_generation(self):
        self.phases.append(("continue",))

    async def update_weights(self, named_tensors, version):
        await self.load_weights(named_tensors)
        await self.set_weight_version(version)

    async def release_memory(self):
        return None

    async def resume_memory(self):
        return None

    async def health(self):
        return True


def rollout_manager(config, pm, engine):
    """A RolloutManager over the chosen data source and ``engine`` (as a run builds it), for rollout-logic tests."""
    from furlong.core.rollout.data_cursor import DataCursor
    from furlong.core.rollout.datasets import train_dataset
    from furlong.core.rollout.manager import RolloutManager
    from furlong.core.plugins.selection import resolve_selection

    selection = resolve_selection(config, pm)
    source = asyncio.run(pm.call_chosen("data_source", *selection.chosen["data_source"],
                                        config=config, dataset=train_dataset(config)))
    cursor = DataCursor(config, pm, source, selection.chosen["buffer_pop"])
    return RolloutManager(config, pm, selection, engine, cursor)


def boxed_first_operand(prompt, call):
    """An answer script: ``\\boxed{a}`` for prompt ``a+b=``, finishing on a stop."""
    return "\\boxed{" + prompt.split("+")[0] + "}", "stop"
