"""Prompt data from a JSONL file (``--prompt-data``), one JSON object per line (SPEC.md section 2)."""

from __future__ import annotations

import json
import logging
import os
import random
import re

from furlong.hooks import PluginError, hookimpl

log = logging.getLogger("furlong.data")

_SLICE = re.compile(r"^(?P<path>.*)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")


@hookimpl
def data_source(args):
    """Read and check ``--prompt-data`` now, so a bad file fails before any model loads.

    :raises PluginError: missing, empty or malformed file, or a row without
        ``--input-key`` / ``--label-key`` (the message names file and line).
    """
    return JsonlDataSource(args)


class JsonlDataSource:
    """Rows of a JSONL file in epoch order (optionally shuffled per epoch with ``rollout_seed + epoch``).

    Rows are ``{"prompt": str | list[dict], "label": Any, "metadata": dict}``; with
    ``--apply-chat-template`` the prompt is rendered to a string by the tokenizer of
    ``--hf-checkpoint`` when it is served.
    """

    def __init__(self, args):
        self.args = args
        if not args.prompt_data:
            raise PluginError("--prompt-data is required: a JSONL file with one prompt per line.")
        self.rows = read_rows(args.prompt_data, args.input_key, args.label_key, args.metadata_key, args.tool_key)
        self._tokenizer = None
        if args.rollout_max_prompt_len:
            self.rows = self._drop_long_prompts(self.rows, args.rollout_max_prompt_len)
        self.shuffle = bool(args.rollout_shuffle)
        self.seed = int(args.rollout_seed)
        self.epoch = 0
        self.offset = 0
        self.order = self._order(0)

    def __len__(self) -> int:
        return len(self.rows)

    def next_rows(self, k: int) -> list[dict]:
        """The next ``k`` rows; when the epoch runs out, reshuffle and continue in the next one."""
        out = []
        while len(out) < k:
            if self.offset >= len(self.order):
                self.epoch += 1
                self.offset = 0
                self.order = self._order(self.epoch)
            take = self.order[self.offset : self.offset + k - len(out)]
            self.offset += len(take)
            out.extend(self._render(dict(self.rows[i])) for i in take)
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle}

    def load_state(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self.order = self._order(self.epoch)

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.args.hf_checkpoint)
            if self.args.chat_template_path:
                with open(self.args.chat_template_path, encoding="utf-8") as f:
                    self._tokenizer.chat_template = f.read()
        return self._tokenizer

    def _render(self, row: dict) -> dict:
        if not self.args.apply_chat_template:
            return row
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        kwargs = dict(json.loads(self.args.apply_chat_template_kwargs or "{}")) if isinstance(
            self.args.apply_chat_template_kwargs, str) else dict(self.args.apply_chat_template_kwargs or {})
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
            raise PluginError(f"--rollout-max-prompt-len {max_len}: every prompt of --prompt-data is longer.")
        return kept


def read_rows(spec: str, input_key: str, label_key: str | None, metadata_key: str, tool_key: str | None) -> list[dict]:
    """Parse ``path`` or ``path@[a:b]`` into rows, checking every line.

    :raises PluginError: the file is missing or empty, a line is not a JSON object, or a
        row lacks ``input_key`` (or ``label_key`` when given); names file and line number.
    """
    path, start, stop = _split_slice(spec)
    if not os.path.isfile(path):
        raise PluginError(f"--prompt-data '{path}': no such file.")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            rows.append(_parse_line(path, lineno, line, input_key, label_key, metadata_key, tool_key))
    if not rows:
        raise PluginError(f"--prompt-data '{path}': the file has no rows.")
    rows = rows[start:stop]
    if not rows:
        raise PluginError(f"--prompt-data '{spec}': the slice selects no rows (the file has some).")
    return rows


def _split_slice(spec: str) -> tuple[str, int | None, int | None]:
    match = _SLICE.match(spec)
    if not match:
        return spec, None, None
    to_int = lambda s: int(s) if s else None  # noqa: E731
    return match["path"], to_int(match["start"]), to_int(match["stop"])


def _parse_line(path, lineno, line, input_key, label_key, metadata_key, tool_key) -> dict:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as exc:
        raise PluginError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}).") from None
    if not isinstance(obj, dict):
        raise PluginError(f"{where}: expected a JSON object, got {type(obj).__name__}.")
    if input_key not in obj:
        raise PluginError(f"{where}: row has no key '{input_key}' (--input-key); keys: {', '.join(sorted(obj))}.")
    prompt = obj[input_key]
    if not isinstance(prompt, (str, list)):
        raise PluginError(f"{where}: '{input_key}' must be a string or a list of chat messages.")
    if label_key and label_key not in obj:
        raise PluginError(f"{where}: row has no key '{label_key}' (--label-key); keys: {', '.join(sorted(obj))}.")
    metadata = obj.get(metadata_key) or {}
    if not isinstance(metadata, dict):
        raise PluginError(f"{where}: '{metadata_key}' (--metadata-key) must be a JSON object.")
    if tool_key and tool_key in obj:
        tools = obj[tool_key]
        tools = json.loads(tools) if isinstance(tools, str) else tools
        if not isinstance(tools, list):
            raise PluginError(f"{where}: '{tool_key}' (--tool-key) must be a list.")
        metadata = {**metadata, "tools": tools}
    return {"prompt": prompt, "label": obj[label_key] if label_key else None, "metadata": metadata}
