"""Prompt data from a Parquet file (``--prompt-data train.parquet``), as verl's data preparation writes it.

Chosen by the file (a ``.parquet`` path, when ``--data-source`` is not given) or by
``--data-source parquet``. Needs pyarrow (``pip install "furlong[parquet]"``). A verl row
(``{"data_source", "prompt": [chat messages], "ability", "reward_model": {"ground_truth", ...},
"extra_info": {...}}``) reads with ``--input-key prompt --label-key reward_model.ground_truth
--metadata-key data_source,extra_info``: keys may name nested values (docs/from-verl.md).
"""

from __future__ import annotations

import os

from furlong.hooks import PluginError, hookimpl

from ._rows import base_path, rows_of, split_slice
from ._source import RowsDataSource

__all__ = ["ParquetDataSource", "data_source", "read_parquet_rows", "reads_path"]

NEEDS_PYARROW = 'the parquet data source needs pyarrow: pip install "furlong[parquet]" (or pip install pyarrow).'


def reads_path(path: str) -> bool:
    """Whether this data source reads ``path`` (``PATH@[START:END]`` allowed): a ``.parquet`` file.
    The core chooses it by the file when ``--data-source`` is not given."""
    return base_path(path).lower().endswith(".parquet")


@hookimpl
def data_source(config, dataset):
    """Read and check the Parquet file ``dataset.path`` (``--prompt-data``, or an eval set) now, before any model loads.

    :raises PluginError: pyarrow is missing; the file is missing, not Parquet or has no rows; a row
        lacks ``--input-key`` or ``--label-key`` (the message names the file and the row).
    """
    return ParquetDataSource(config, dataset)


def read_parquet_rows(spec: str, input_key: str, label_key: str | None, metadata_key: str, tool_key: str | None,
                      flag: str = "--prompt-data") -> list[dict]:
    """The rows of a Parquet file ``path`` or ``path@[a:b]``, every one checked.

    Columns become keys; struct columns become objects (reachable with dotted keys), list columns
    lists (a column of chat messages is a chat prompt).

    :param flag: the flag that named the file, for messages.
    :raises PluginError: as :func:`data_source` says; rows are named ``file, row N`` (1-based).
    """
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise PluginError(f"{flag} '{spec}': {NEEDS_PYARROW}") from exc
    path, start, stop = split_slice(spec, flag)
    if os.path.isdir(path):
        raise PluginError(f"{flag} '{path}': is a directory; pass a Parquet file.")
    if not os.path.isfile(path):
        raise PluginError(f"{flag} '{path}': no such file.")
    try:
        records = pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        raise PluginError(f"{flag} '{path}': cannot read it as Parquet ({type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc}).") from None
    return rows_of(records, spec, path, start, stop, (input_key, label_key, metadata_key, tool_key), flag, "file")


class ParquetDataSource(RowsDataSource):
    """Rows of a Parquet file (:class:`RowsDataSource`: epoch order, shuffle, chat template)."""

    read = staticmethod(read_parquet_rows)
    needs = "a Parquet file with one prompt per row"
