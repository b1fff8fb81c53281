"""Write the demo's data (examples/demo/data) as a TRL user keeps a data set: a Hugging Face ``DatasetDict``
saved with ``save_to_disk``, in TRL's conversational format (``prompt`` a list of chat messages) with the
answer in a ``solution`` column.

Run from the repository root (needs ``pip install "furlong[datasets]"``)::

    python examples/trl/demo_to_dataset.py --out runs/trl-demo/data   # data/train, data/test

docs/from-trl.md trains on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEMO_DATA = Path(__file__).resolve().parent.parent / "demo" / "data"


def trl_row(row: dict) -> dict:
    """One demo row ``{"prompt", "label"}`` in TRL's conversational prompt-only format, plus ``solution``."""
    return {"prompt": [{"role": "user", "content": row["prompt"]}], "solution": row["label"]}


def main(argv: list[str] | None = None) -> int:
    """Save the ``train`` and ``test`` splits under ``--out``; print where they went."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (created if missing).")
    parser.add_argument("--limit", type=int, default=None, help="keep the first N rows of each split.")
    args = parser.parse_args(argv)
    from datasets import Dataset, DatasetDict, disable_progress_bars

    disable_progress_bars()
    splits = {}
    for split in ("train", "test"):
        with open(DEMO_DATA / f"{split}.jsonl", encoding="utf-8") as f:
            splits[split] = Dataset.from_list([trl_row(json.loads(line)) for line in f][: args.limit])
    DatasetDict(splits).save_to_disk(str(args.out))
    for split, data in splits.items():
        print(f"{split}: {len(data)} rows -> {args.out / split}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
