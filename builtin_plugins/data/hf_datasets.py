"""Prompt data from a Hugging Face ``datasets`` data set saved to disk, or from a local Arrow, CSV or TSV file.

Chosen by the path (when ``--data-source`` is not given): a folder written by
``Dataset.save_to_disk`` (it holds ``state.json``), a ``DatasetDict`` folder (``dataset_dict.json``:
name a split's sub-folder, ``--prompt-data data/train``), or a ``.arrow``, ``.csv`` or ``.tsv``
file; or by ``--data-source hf_datasets``. Needs ``datasets`` (``pip install "furlong[datasets]"``)
for folders; CSV, TSV and Arrow files are read with pyarrow, which ``datasets`` brings. Nothing is
downloaded and nothing is written to the ``datasets`` cache.
"""

from __future__ import annotations

import json
import os

from furlong.hooks import PluginError, hookimpl

from ._rows import base_path, rows_of, split_slice
from ._source import RowsDataSource

__all__ = ["HfDatasetsDataSource", "data_source", "read_dataset_rows", "reads_path"]

NEEDS_DATASETS = 'the hf_datasets data source needs the datasets package: pip install "furlong[datasets]".'
FILE_SUFFIXES = (".arrow", ".csv", ".tsv")


def _is_saved_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))


def reads_path(path: str) -> bool:
    """Whether this data source reads ``path`` (``PATH@[START:END]`` allowed): a folder written by
    ``save_to_disk``, or an Arrow, CSV or TSV file. The core chooses it by the path when
    ``--data-source`` is not given."""
    base = base_path(path)
    return _is_saved_dataset(base) if os.path.isdir(base) else base.lower().endswith(FILE_SUFFIXES)


@hookimpl
def data_source(config, dataset):
    """Read and check the data set ``dataset.path`` (``--prompt-data``, or an eval set) now, before any model loads.

    :raises PluginError: the package it needs is missing; the path is missing or holds no data set,
        a ``DatasetDict`` without a split named, no rows; a row lacks ``--input-key`` or
        ``--label-key`` (the message names the path and the row).
    """
    return HfDatasetsDataSource(config, dataset)


def read_dataset_rows(spec: str, input_key: str, label_key: str | None, metadata_key: str, tool_key: str | None,
                      flag: str = "--prompt-data") -> list[dict]:
    """The rows of a saved data set or an Arrow/CSV/TSV file, ``path`` or ``path@[a:b]``, every one checked.

    :param flag: the flag that named the path, for messages.
    :raises PluginError: as :func:`data_source` says; rows are named ``path, row N`` (1-based).
    """
    path, start, stop = split_slice(spec, flag)
    if not os.path.exists(path):
        raise PluginError(f"{flag} '{path}': no such file or directory.")
    return rows_of(_records(path, flag), spec, path, start, stop, (input_key, label_key, metadata_key, tool_key),
                   flag, "data set")


def _records(path: str, flag: str) -> list[dict]:
    if os.path.isdir(path):
        return _saved(path, flag)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FILE_SUFFIXES:
        raise PluginError(f"{flag} '{path}': the hf_datasets data source reads folders written by save_to_disk and "
                          f"{', '.join(FILE_SUFFIXES)} files; for JSONL leave --data-source out (jsonl), for Parquet "
                          "use --data-source parquet.")
    try:
        import pyarrow
        import pyarrow.csv
        import pyarrow.ipc
    except ImportError as exc:
        raise PluginError(f"{flag} '{path}': {NEEDS_DATASETS}") from exc
    try:
        if suffix == ".arrow":
            return _arrow_file(pyarrow, path).to_pylist()
        delimiter = "\t" if suffix == ".tsv" else ","
        return pyarrow.csv.read_csv(path, parse_options=pyarrow.csv.ParseOptions(delimiter=delimiter)).to_pylist()
    except (pyarrow.ArrowInvalid, OSError) as exc:
        raise PluginError(f"{flag} '{path}': cannot read it ({type(exc).__name__}: {_first_line(exc)}).") from None


def _arrow_file(pyarrow, path: str):
    """An Arrow file as ``datasets`` writes it (the streaming format), or the random-access file format."""
    try:
        with pyarrow.memory_map(path) as source:
            return pyarrow.ipc.open_stream(source).read_all()
    except pyarrow.ArrowInvalid:
        with pyarrow.memory_map(path) as source:
            return pyarrow.ipc.open_file(source).read_all()


def _saved(path: str, flag: str) -> list[dict]:
    splits_file = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(splits_file):
        with open(splits_file, encoding="utf-8") as f:
            splits = json.load(f).get("splits", [])
        example = os.path.join(path, splits[0]) if splits else os.path.join(path, "train")
        raise PluginError(f"{flag} '{path}': a DatasetDict with the splits {', '.join(splits) or '(none)'}; name one "
                          f"of them: {flag} {example}.")
    if not os.path.isfile(os.path.join(path, "state.json")):
        raise PluginError(f"{flag} '{path}': is a directory without a data set saved by save_to_disk (no state.json "
                          "or dataset_dict.json).")
    try:
        import datasets
    except ImportError as exc:
        raise PluginError(f"{flag} '{path}': {NEEDS_DATASETS}") from exc
    datasets.disable_progress_bars()
    try:
        return datasets.load_from_disk(path, keep_in_memory=True).to_list()
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for a damaged folder
        raise PluginError(f"{flag} '{path}': cannot load the data set ({type(exc).__name__}: {_first_line(exc)}).") \
            from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class HfDatasetsDataSource(RowsDataSource):
    """Rows of a saved data set or an Arrow/CSV/TSV file (:class:`RowsDataSource`: epoch order, chat template)."""

    read = staticmethod(read_dataset_rows)
    needs = "a data set saved with save_to_disk, or an Arrow, CSV or TSV file"
