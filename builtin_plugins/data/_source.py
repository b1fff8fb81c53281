"""The data source every built-in reader returns: rows in epoch order, rendered with the chat template."""

from __future__ import annotations

import json
import logging
from typing import Callable

from furlong.hooks import DatasetSpec, PluginError, RunConfig
from furlong.kit.epochs import EpochOrder
from furlong.kit.hf import load_tokenizer

__all__ = ["RowsDataSource"]

log = logging.getLogger("furlong.data")

Reader = Callable[..., list]
"""``read(spec, input_key, label_key, metadata_key, tool_key, flag) -> rows`` (each reader's own)."""


class RowsDataSource:
    """Rows of a data set in epoch order (optionally shuffled per epoch with ``dataset.seed + epoch``).

    A reader module subclasses it and sets :attr:`read` (its file reader) and :attr:`needs` (what
    ``--prompt-data`` must name, for the message when it is missing). ``config`` is the run's
    :class:`~furlong.hooks.RunConfig`, ``dataset`` the :class:`~furlong.hooks.DatasetSpec` to read. Rows are
    ``{"prompt": str | list[dict], "label": Any, "metadata": dict}``; with ``--apply-chat-template``
    the prompt is rendered to a string by the tokenizer of ``--hf-checkpoint`` when it is served.
    """

    read: Reader
    needs = "a JSONL file with one prompt per line"

    def __init__(self, config: RunConfig, dataset: DatasetSpec):
        self.config = config
        self.dataset = dataset
        if not dataset.path:
            raise PluginError(f"{dataset.flag} is required: {self.needs}.")
        self.rows = type(self).read(dataset.path, dataset.input_key, dataset.label_key, dataset.metadata_key,
                                    dataset.tool_key, dataset.flag)
        self._tokenizer = None
        if config.apply_chat_template:
            self._check_chat_template()
        if dataset.max_prompt_len:
            self.rows = self._drop_long_prompts(self.rows, dataset.max_prompt_len)
        self.cursor = EpochOrder(len(self.rows), dataset.shuffle, dataset.seed)

    def __len__(self) -> int:
        return len(self.rows)

    def next_rows(self, k: int) -> list[dict]:
        """The next ``k`` rows; when the epoch runs out, reshuffle and continue in the next one."""
        return [self._render(dict(self.rows[i])) for i in self.cursor.take(k)]

    def state(self) -> dict:
        return self.cursor.state()

    def load_state(self, state: dict) -> None:
        self.cursor.load_state(state)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config.hf_checkpoint)
            if self.config.chat_template_path:
                with open(self.config.chat_template_path, encoding="utf-8") as f:
                    self._tokenizer.chat_template = f.read()
        return self._tokenizer

    def _check_chat_template(self) -> None:
        """The template exists and renders a one-message chat (so a syntax error stops the run now)."""
        source = f"--chat-template-path {self.config.chat_template_path}" if self.config.chat_template_path else (
            f"the tokenizer in {self.config.hf_checkpoint}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise PluginError(f"--apply-chat-template: {source} has no chat template; pass --chat-template-path "
                              "FILE (a Jinja template) or drop --apply-chat-template.")
        try:
            self.tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1 = ?"}], tokenize=False,
                                               add_generation_prompt=True, **self._template_kwargs())
        except Exception as exc:  # noqa: BLE001 - jinja2 and transformers raise many types
            line = getattr(exc, "lineno", None)
            where = f" (template line {line})" if line else ""
            raise PluginError(f"--apply-chat-template: the chat template of {source} fails{where}: "
                              f"{type(exc).__name__}: {exc}") from None

    def _template_kwargs(self) -> dict:
        kwargs = self.config.apply_chat_template_kwargs
        return dict(json.loads(kwargs or "{}")) if isinstance(kwargs, str) else dict(kwargs or {})

    def _render(self, row: dict) -> dict:
        if not self.config.apply_chat_template:
            return row
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        kwargs = self._template_kwargs()
        tools = row["metadata"].get("tools")
        if tools is not None:
            kwargs["tools"] = tools
        row["prompt"] = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        return row

    def _drop_long_prompts(self, rows: list[dict], max_len: int) -> list[dict]:
        kept = [r for r in rows if not isinstance(r["prompt"], str)
                or len(self.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) <= max_len]
        if len(kept) < len(rows):
            log.info("--rollout-max-prompt-len %d dropped %d of %d prompts", max_len, len(rows) - len(kept), len(rows))
        if not kept:
            raise PluginError(f"--rollout-max-prompt-len {max_len}: every prompt of {self.dataset.flag} is longer.")
        return kept
