"""What every built-in data source does to one record: find the keys (nested ones too), check them,
and build the row ``{"prompt", "label", "metadata"}``; and the ``PATH@[START:END]`` slice."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from furlong.hooks import PluginError

__all__ = ["MISSING", "base_path", "lookup", "row_from_record", "rows_of", "split_slice"]

_SLICE = re.compile(r"^(?P<path>.*)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()
"""What :func:`lookup` returns for a key the record does not have."""


def lookup(record: dict, key: str) -> Any:
    """``record[key]``; for a key that is not there and holds dots, the nested value it names
    (``reward_model.ground_truth`` is ``record["reward_model"]["ground_truth"]``); else :data:`MISSING`."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split(".") if "." in key else ():
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value if "." in key else MISSING


def base_path(spec: str) -> str:
    """``spec`` without a ``@[START:END]`` slice at its end (never raises: for choosing a reader by the file)."""
    match = _SLICE.match(spec)
    return match["path"] if match else spec


def split_slice(spec: str, flag: str) -> tuple[str, int | None, int | None]:
    """``PATH`` or ``PATH@[START:END]`` -> ``(PATH, START, END)`` (None where left out).

    :raises PluginError: a malformed ``@[...]`` at the end of a path that does not exist as given.
    """
    match = _SLICE.match(spec)
    if not match:
        if re.search(r"@\[[^\]]*\]$", spec) and not os.path.exists(spec):
            raise PluginError(f"{flag} '{spec}': bad slice '{spec[spec.rindex('@'):]}'; write PATH@[START:END] with "
                              "whole numbers (either may be left out).")
        return spec, None, None
    to_int = lambda s: int(s) if s else None  # noqa: E731
    return match["path"], to_int(match["start"]), to_int(match["stop"])


def _missing_key(where: str, record: dict, key: str, flag: str) -> PluginError:
    """The error for a row without ``key``: its keys, and the dotted path of a nested value so named."""
    nested = sorted(f"{outer}.{key}" for outer, value in record.items() if isinstance(value, dict) and key in value)
    hint = f" (did you mean {flag} {nested[0]}?)" if len(nested) == 1 else ""
    return PluginError(f"{where}: row has no key '{key}' ({flag}); keys: {', '.join(sorted(map(str, record)))}{hint}.")


def _check_messages(where: str, input_key: str, messages: list) -> None:
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise PluginError(f"{where}: '{input_key}' message {i} must be an object with a string 'role' and a "
                              f"'content' (chat format), got {json.dumps(message, default=str)[:80]}.")


def _metadata(where: str, record: dict, metadata_key: str) -> dict:
    """The row's metadata: the object under ``metadata_key``; with several comma-separated keys, each
    value under its key's last part (``data_source,extra_info`` -> ``{"data_source": ..., "extra_info": ...}``)."""
    keys = [k.strip() for k in metadata_key.split(",") if k.strip()] if metadata_key else []
    if len(keys) > 1:
        return {key.rsplit(".", 1)[-1]: value for key in keys if (value := lookup(record, key)) is not MISSING}
    value = lookup(record, keys[0]) if keys else MISSING
    if value is MISSING or value is None:
        return {}
    if not isinstance(value, dict):
        raise PluginError(f"{where}: '{metadata_key}' (--metadata-key) must be a JSON object.")
    return value


def row_from_record(where: str, record: Any, input_key: str, label_key: str | None, metadata_key: str,
                    tool_key: str | None) -> dict:
    """The row ``{"prompt", "label", "metadata"}`` of one record, checked.

    Keys may name nested values (:func:`lookup`); ``metadata_key`` may name several, comma-separated.

    :param where: the record's place for messages (``file:line``, ``file, row 3``).
    :raises PluginError: not an object; no ``input_key`` (or ``label_key`` when given); an empty
        prompt, or a chat message without a string ``role`` and a ``content``; metadata that is not an
        object; tools that are not a list. The message names ``where`` and the flag.
    """
    if not isinstance(record, dict):
        raise PluginError(f"{where}: expected a JSON object, got {type(record).__name__}.")
    prompt = lookup(record, input_key)
    if prompt is MISSING:
        raise _missing_key(where, record, input_key, "--input-key")
    if not isinstance(prompt, (str, list)):
        raise PluginError(f"{where}: '{input_key}' must be a string or a list of chat messages.")
    if not prompt or (isinstance(prompt, str) and not prompt.strip()):
        raise PluginError(f"{where}: '{input_key}' (--input-key) is empty.")
    if isinstance(prompt, list):
        _check_messages(where, input_key, prompt)
    label = lookup(record, label_key) if label_key else None
    if label is MISSING:
        raise _missing_key(where, record, label_key, "--label-key")
    metadata = _metadata(where, record, metadata_key)
    tools = lookup(record, tool_key) if tool_key else MISSING
    if tools is not MISSING and tools is not None:
        tools = json.loads(tools) if isinstance(tools, str) else tools
        if not isinstance(tools, list):
            raise PluginError(f"{where}: '{tool_key}' (--tool-key) must be a list.")
        metadata = {**metadata, "tools": tools}
    return {"prompt": prompt, "label": label, "metadata": metadata}


def rows_of(records: list, spec: str, path: str, start: int | None, stop: int | None, keys: tuple, flag: str,
            what: str) -> list[dict]:
    """The checked rows of a whole file's ``records`` (each named ``path, row N``), sliced ``[start:stop]``.

    :param keys: ``(input_key, label_key, metadata_key, tool_key)`` as :func:`row_from_record` takes them.
    :param what: what ``path`` is, for messages ("file", "data set").
    :raises PluginError: no records; a bad record (see :func:`row_from_record`); a slice that selects none.
    """
    if not records:
        raise PluginError(f"{flag} '{path}': the {what} has no rows.")
    rows = [row_from_record(f"{path}, row {i}", record, *keys) for i, record in enumerate(records, 1)][start:stop]
    if not rows:
        raise PluginError(f"{flag} '{spec}': the slice selects no rows (the {what} has some).")
    return rows
