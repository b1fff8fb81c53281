"""Prompt data from a JSONL file (``--prompt-data``), one JSON object per line (SPEC.md section 2)."""

from __future__ import annotations

import json
import logging
import os
import re

from furlong.hooks import PluginError, hookimpl
from furlong.hooks.epochs import EpochOrder
from furlong.hooks.hf import load_tokenizer

log = logging.getLogger("furlong.data")

_OTHER_FORMATS = {".parquet": "Parquet", ".csv": "CSV", ".tsv": "TSV", ".arrow": "Arrow", ".xlsx": "Excel"}
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
        self.rows = read_rows(args.prompt_data, args.input_key, args.label_key, args.metadata_key, args.tool_key,
                              getattr(args, "prompt_data_flag", None) or "--prompt-data")
        self._tokenizer = None
        if args.apply_chat_template:
            self._check_chat_template()
        if args.rollout_max_prompt_len:
            self.rows = self._drop_long_prompts(self.rows, args.rollout_max_prompt_len)
        self.cursor = EpochOrder(len(self.rows), args.rollout_shuffle, args.rollout_seed)

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
            self._tokenizer = load_tokenizer(self.args.hf_checkpoint)
            if self.args.chat_template_path:
                with open(self.args.chat_template_path, encoding="utf-8") as f:
                    self._tokenizer.chat_template = f.read()
        return self._tokenizer

    def _check_chat_template(self) -> None:
        """The template exists and renders a one-message chat (so a syntax error stops the run now)."""
        source = f"--chat-template-path {self.args.chat_template_path}" if self.args.chat_template_path else (
            f"the tokenizer in {self.args.hf_checkpoint}")
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
        kwargs = self.args.apply_chat_template_kwargs
        return dict(json.loads(kwargs or "{}")) if isinstance(kwargs, str) else dict(kwargs or {})

    def _render(self, row: dict) -> dict:
        if not self.args.apply_chat_template:
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
            raise PluginError(f"--rollout-max-prompt-len {max_len}: every prompt of --prompt-data is longer.")
        return kept


def read_rows(spec: str, input_key: str, label_key: str | None, metadata_key: str, tool_key: str | None,
              flag: str = "--prompt-data") -> list[dict]:
    """Parse ``path`` or ``path@[a:b]`` into rows, checking every line.

    :param flag: the flag that named the file, for error messages (``--prompt-data``, or
        ``--eval-prompt-data NAME`` for an eval set).
    :raises PluginError: the file is missing, a directory, not JSONL (Parquet, CSV, ...) or
        empty; a bad ``@[a:b]`` slice; a line that is not UTF-8 or not a JSON object; a row
        without ``input_key`` (or ``label_key`` when given), with an empty prompt or a chat
        message lacking ``role``/``content``. Names file and line number.
    """
    path, start, stop = _split_slice(spec, flag)
    if os.path.isdir(path):
        raise PluginError(f"{flag} '{path}': is a directory; pass a JSONL file (one JSON object per line).")
    if not os.path.isfile(path):
        raise PluginError(f"{flag} '{path}': no such file.")
    suffix = os.path.splitext(path)[1].lower()
    if suffix in _OTHER_FORMATS:
        raise PluginError(
            f"{flag} '{path}': {_OTHER_FORMATS[suffix]} files are not read by the jsonl data source; convert it to "
            "JSONL (pandas: df.to_json('data.jsonl', orient='records', lines=True)) or choose a data source plugin "
            "that reads it (--data-source NAME)."
        )
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PluginError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                                  f"{exc.start + 1}); save the file as UTF-8.") from None
            if not line.strip():
                continue
            rows.append(_parse_line(path, lineno, line, input_key, label_key, metadata_key, tool_key))
    if not rows:
        raise PluginError(f"{flag} '{path}': the file has no rows.")
    rows = rows[start:stop]
    if not rows:
        raise PluginError(f"{flag} '{spec}': the slice selects no rows (the file has some).")
    return rows


def _split_slice(spec: str, flag: str) -> tuple[str, int | None, int | None]:
    match = _SLICE.match(spec)
    if not match:
        if re.search(r"@\[[^\]]*\]$", spec) and not os.path.exists(spec):
            raise PluginError(f"{flag} '{spec}': bad slice '{spec[spec.rindex('@'):]}'; write PATH@[START:END] with "
                              "whole numbers (either may be left out).")
        return spec, None, None
    to_int = lambda s: int(s) if s else None  # noqa: E731
    return match["path"], to_int(match["start"]), to_int(match["stop"])


def _check_messages(where: str, input_key: str, messages: list) -> None:
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise PluginError(f"{where}: '{input_key}' message {i} must be an object with a string 'role' and a "
                              f"'content' (chat format), got {json.dumps(message)[:80]}.")


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def _parse_line(path, lineno, line, input_key, label_key, metadata_key, tool_key) -> dict:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line.rstrip("\r\n"), object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise PluginError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}).") from None
    except _DuplicateKey as exc:
        raise PluginError(f"{where}: key '{exc.args[0]}' appears twice in one object; keep one.") from None
    if not isinstance(obj, dict):
        raise PluginError(f"{where}: expected a JSON object, got {type(obj).__name__}.")
    if input_key not in obj:
        raise PluginError(f"{where}: row has no key '{input_key}' (--input-key); keys: {', '.join(sorted(obj))}.")
    prompt = obj[input_key]
    if not isinstance(prompt, (str, list)):
        raise PluginError(f"{where}: '{input_key}' must be a string or a list of chat messages.")
    if not prompt or (isinstance(prompt, str) and not prompt.strip()):
        raise PluginError(f"{where}: '{input_key}' (--input-key) is empty.")
    if isinstance(prompt, list):
        _check_messages(where, input_key, prompt)
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
