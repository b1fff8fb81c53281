"""Prompt data from a JSONL file (``--prompt-data``), one JSON object per line: the default data source."""

from __future__ import annotations

import json
import os

from furlong.hooks import PluginError, hookimpl

from ._rows import row_from_record, split_slice
from ._source import RowsDataSource

__all__ = ["JsonlDataSource", "data_source", "read_rows"]

# suffix -> (format, the built-in data source that reads it, or None)
_OTHER_FORMATS = {".parquet": ("Parquet", "parquet"), ".csv": ("CSV", "hf_datasets"), ".tsv": ("TSV", "hf_datasets"),
                  ".arrow": ("Arrow", "hf_datasets"), ".xlsx": ("Excel", None)}


@hookimpl
def data_source(config, dataset):
    """Read and check ``dataset.path`` (``--prompt-data``, or an eval set) now, so a bad file fails before any model loads.

    :raises PluginError: missing, empty or malformed file, or a row without
        ``--input-key`` / ``--label-key`` (the message names file and line).
    """
    return JsonlDataSource(config, dataset)


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
    path, start, stop = split_slice(spec, flag)
    if os.path.isdir(path):
        raise PluginError(f"{flag} '{path}': is a directory; pass a JSONL file (one JSON object per line).")
    if not os.path.isfile(path):
        raise PluginError(f"{flag} '{path}': no such file.")
    suffix = os.path.splitext(path)[1].lower()
    if suffix in _OTHER_FORMATS:
        kind, reader = _OTHER_FORMATS[suffix]
        choose = f"--data-source {reader}" if reader else "a data source plugin that reads it (--data-source NAME)"
        raise PluginError(
            f"{flag} '{path}': {kind} files are not read by the jsonl data source; choose {choose}, or convert it to "
            "JSONL (pandas: df.to_json('data.jsonl', orient='records', lines=True))."
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
    return row_from_record(where, obj, input_key, label_key, metadata_key, tool_key)


class JsonlDataSource(RowsDataSource):
    """Rows of a JSONL file (:class:`RowsDataSource`: epoch order, shuffle, chat template)."""

    read = staticmethod(read_rows)
    needs = "a JSONL file with one prompt per line"
