"""The core's cursor over a data source: groups, run-wide counters, the partial-rollout buffer.

Every data source gets these for free (PLUGINS.md, "data_source"): the data source only yields
rows; the cursor turns each row into a group of ``n_samples_per_prompt`` samples with
run-wide ``group_index``/``index`` counters, serves buffered partial groups first through
the ``buffer_pop`` hook, and saves all of it as JSON in checkpoints.
"""

from __future__ import annotations

import copy

from furlong.hooks import DataSource, PluginError, RunConfig, Sample
from furlong.hooks.contract import check_buffer_pop

from ..plugins.manager import FurlongPluginManager

__all__ = ["DataCursor", "SampleCounters"]

COUNTER_NAMES = ("drawn", "trained", "filtered", "surplus", "aborted_dropped")


class SampleCounters(dict):
    """Groups drawn from the data source and where they went (for ``rollout/accounting/*``).

    On the committed timeline: drawn = trained + filtered + surplus + aborted_dropped + buffered.
    """

    def __init__(self, values: dict | None = None):
        super().__init__({name: 0 for name in COUNTER_NAMES})
        self.update(values or {})


class DataCursor:
    """Hands out groups: buffered partial groups first (``buffer_pop``), then fresh prompts.

    :param data_source: the object the ``data_source`` hook returned.
    :param buffer_pop: ``(name, flag)`` of the chosen ``buffer_pop`` plugin.
    :param n_samples: samples per group (default ``--n-samples-per-prompt``).
    """

    def __init__(self, config: RunConfig, pm: FurlongPluginManager, data_source: DataSource,
                 buffer_pop: tuple[str, str], n_samples: int | None = None):
        self.config = config
        self.pm = pm
        self.source = data_source
        self.buffer_pop = buffer_pop
        self.n = int(n_samples or config.n_samples_per_prompt)
        self.group_index = 0
        self.sample_index = 0
        self.buffer: list[list[Sample]] = []
        self.counters = SampleCounters()
        self.rollout_id = 0

    async def get_samples(self, k: int) -> list[list[Sample]]:
        """``k`` groups: up to ``k`` from the buffer (chosen by ``buffer_pop``), the rest fresh."""
        groups: list[list[Sample]] = []
        if self.buffer:
            name, flag = self.buffer_pop
            popped = await self.pm.call_chosen("buffer_pop", name, flag, config=self.config,
                                               rollout_id=self.rollout_id, buffer=self.buffer, num_samples=k)
            check_buffer_pop(popped, k, f"buffer_pop plugin '{name}' ({self.pm.origin(name)})")
            groups.extend(popped)
        fresh = self.new_groups(self.source.next_rows(k - len(groups))) if k > len(groups) else []
        self.counters["drawn"] += len(fresh)
        return groups + fresh

    def new_groups(self, rows: list[dict], n: int | None = None) -> list[list[Sample]]:
        """Turn rows into groups of ``n`` deep-copied samples with fresh run-wide indices."""
        groups = []
        for row in rows:
            group = []
            for _ in range(n or self.n):
                group.append(Sample(prompt=copy.deepcopy(row["prompt"]), label=copy.deepcopy(row.get("label")),
                                    metadata=copy.deepcopy(row.get("metadata") or {}),
                                    group_index=self.group_index, index=self.sample_index))
                self.sample_index += 1
            self.group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Put partial groups into the buffer; each must have exactly ``n`` samples."""
        for group in groups:
            if len(group) != self.n:
                raise PluginError(f"a buffered group must have {self.n} samples (--n-samples-per-prompt); got {len(group)}.")
            for sample in group:
                if sample.response_length > 0:
                    sample.metadata.setdefault("start_rollout_id", self.rollout_id)
            self.buffer.append(group)

    def buffer_len(self) -> int:
        return len(self.buffer)

    def state(self) -> dict:
        """JSON-serializable state for ``<save>/rollout/state_<id>.json``."""
        return {
            "data_source": self.source.state(),
            "group_index": self.group_index,
            "sample_index": self.sample_index,
            "buffer": [[s.to_dict() for s in group] for group in self.buffer],
            "counters": dict(self.counters),
        }

    def load_state(self, state: dict) -> None:
        self.source.load_state(state["data_source"])
        self.group_index = int(state["group_index"])
        self.sample_index = int(state["sample_index"])
        self.buffer = [[Sample.from_dict(d) for d in group] for group in state.get("buffer", [])]
        self.counters = SampleCounters(state.get("counters"))
