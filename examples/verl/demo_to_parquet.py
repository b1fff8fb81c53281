"""Write the demo's data (examples/demo/data) as verl's data preparation writes a data set: Parquet files.

Each row is shaped like the rows of verl's ``examples/data_preprocess`` scripts::

    {"data_source": "furlong/demo-arithmetic",
     "prompt": [{"role": "user", "content": "8 - 7 - 6 = "}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "-5"},
     "extra_info": {"split": "train", "index": 0}}

Run from the repository root (needs pyarrow: ``pip install "furlong[parquet]"``)::

    python examples/verl/demo_to_parquet.py --out runs/verl-demo/data   # train.parquet, test.parquet

docs/from-verl.md trains on them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEMO_DATA = Path(__file__).resolve().parent.parent / "demo" / "data"
DATA_SOURCE = "furlong/demo-arithmetic"


def verl_row(row: dict, split: str, index: int) -> dict:
    """One demo row ``{"prompt", "label"}`` in verl's layout."""
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": row["prompt"]}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": row["label"]},
            "extra_info": {"split": split, "index": index}}


def main(argv: list[str] | None = None) -> int:
    """Write ``train.parquet`` and ``test.parquet`` under ``--out``; print where they went."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (created if missing).")
    parser.add_argument("--limit", type=int, default=None, help="keep the first N rows of each split.")
    args = parser.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq

    args.out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        with open(DEMO_DATA / f"{split}.jsonl", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f][: args.limit]
        table = pa.Table.from_pylist([verl_row(row, split, i) for i, row in enumerate(rows)])
        pq.write_table(table, args.out / f"{split}.parquet")
        print(f"{split}: {len(rows)} rows -> {args.out / f'{split}.parquet'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
