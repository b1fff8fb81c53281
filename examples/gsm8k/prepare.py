"""Convert GSM8K (Cobbe et al. 2021) into furlong's prompt/label JSONL.

Reads ``train.jsonl`` and ``test.jsonl`` from ``--src`` (rows ``{"question", "answer"}``, the
answer ending with ``#### <number>``) and writes the same two file names under ``--out``, one
``{"prompt": ..., "label": ...}`` per line: the prompt is the question followed by an instruction
to give the final answer in ``\\boxed{}``, the label is the number after ``####`` with its
thousands separators removed (``"1,234"`` -> ``"1234"``). The data stays outside the repository:
the default ``--out`` is git-ignored.

Run from anywhere::

    python examples/gsm8k/prepare.py --src /path/to/gsm8k             # -> examples/gsm8k/data
    python examples/gsm8k/prepare.py --src /path/to/gsm8k --limit 100 --out /tmp/gsm8k

``--src`` is a folder holding GSM8K's ``train.jsonl`` and ``test.jsonl`` (as published by its
authors, github.com/openai/grade-school-math, ``grade_school_math/data``).

Then train with ``--prompt-data examples/gsm8k/data/train.jsonl --input-key prompt
--label-key label --rm-type math``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
INSTRUCTION = "Solve the problem step by step, then write the final answer as \\boxed{answer}."
SPLITS = ("train", "test")


def label_of(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after the last ``####``, without commas.

    :param answer: a GSM8K ``answer`` field, e.g. ``"... = 1,234\\n#### 1,234"``.
    :returns: the label string, e.g. ``"1234"``.
    :raises ValueError: the answer has no ``####`` marker or nothing after it.
    """
    if "####" not in answer:
        raise ValueError("the answer has no '####' marker")
    label = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not label:
        raise ValueError("nothing follows '####'")
    return label


def convert_row(row: dict) -> dict:
    """One GSM8K row ``{"question", "answer"}`` -> ``{"prompt", "label"}``.

    :raises ValueError: see :func:`label_of`; a ``KeyError`` when a field is missing.
    """
    return {"prompt": f"{row['question'].strip()}\n\n{INSTRUCTION}", "label": label_of(row["answer"])}


def convert_file(src: Path, dst: Path, limit: int | None = None) -> int:
    """Convert the JSONL file ``src`` into ``dst`` (its folder is created), first ``limit`` rows.

    :returns: number of rows written.
    :raises SystemExit: ``src`` is missing, or a line is not JSON or not a GSM8K row (the
        message names the file and line).
    """
    if not src.is_file():
        raise SystemExit(f"{src}: no such file; point --src at the folder holding train.jsonl "
                         "and test.jsonl of GSM8K")
    dst.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(src, encoding="utf-8") as source, open(dst, "w", encoding="utf-8", newline="\n") as out:
        for number, line in enumerate(source, start=1):
            if limit is not None and written >= limit:
                break
            if not line.strip():
                continue
            try:
                row = convert_row(json.loads(line))
            except (json.JSONDecodeError, KeyError, ValueError, AttributeError) as exc:
                raise SystemExit(f"{src}, line {number}: not a GSM8K row ({type(exc).__name__}: {exc})")
            out.write(json.dumps(row) + "\n")
            written += 1
    return written


def main(argv: list[str] | None = None) -> int:
    """Convert both splits; print where they went."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, required=True,
                        help="folder with GSM8K train.jsonl and test.jsonl.")
    parser.add_argument("--out", type=Path, default=HERE / "data",
                        help="output folder (default: examples/gsm8k/data, git-ignored).")
    parser.add_argument("--limit", type=int, default=None, help="keep the first N rows of each split.")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 0:
        parser.error("--limit must be 0 or more")
    for split in SPLITS:
        count = convert_file(args.src / f"{split}.jsonl", args.out / f"{split}.jsonl", args.limit)
        print(f"{split}: {count} rows -> {args.out / f'{split}.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
