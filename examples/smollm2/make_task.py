"""Write an easy verifiable task for SmolLM2-135M-Instruct: small additions and subtractions.

Every problem is ``a + b`` or ``a - b`` with ``1 <= a, b <= --max-operand`` (default 20;
subtractions only when ``a >= b``, so answers are whole numbers from 0 to 40). Each prompt is a
short chat: one worked example (user question, assistant answer in ``\\boxed{}``), then the
question::

    user:      What is 2 + 3? Put the final answer in \\boxed{}.
    assistant: 2 + 3 = 5. The answer is \\boxed{5}.
    user:      What is 17 - 9? Put the final answer in \\boxed{}.

Rows are ``{"prompt": [messages], "label": "8"}`` (train with ``--apply-chat-template
--input-key prompt --label-key label --rm-type math``). Without the worked example the
135M model rarely answers in a box and almost never with the right number; with it, about a
quarter of its samples on the test split are right at temperature 1 (0.24-0.29, see
docs/smollm2.md), which leaves room for RL.
The two splits share no problem; everything is seeded::

    python examples/smollm2/make_task.py --out examples/smollm2/data
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

QUESTION = "What is {}? Put the final answer in \\boxed{{}}."
EXAMPLE = [
    {"role": "user", "content": QUESTION.format("2 + 3")},
    {"role": "assistant", "content": "2 + 3 = 5. The answer is \\boxed{5}."},
]


def problems(max_operand: int) -> list[tuple[str, int]]:
    """Every ``(expression, answer)`` of the task in a fixed order, e.g. ``("17 - 9", 8)``.

    ``a + b`` for all ``1 <= a, b <= max_operand``; ``a - b`` for those with ``a >= b``:
    ``n^2 + n(n+1)/2`` problems (610 for ``n = 20``).
    """
    out = []
    for a in range(1, max_operand + 1):
        for b in range(1, max_operand + 1):
            out.append((f"{a} + {b}", a + b))
            if a >= b:
                out.append((f"{a} - {b}", a - b))
    return out


def row(expression: str, answer: int) -> dict:
    """The JSONL row of one problem: the one-shot chat prompt and the answer as a string."""
    return {"prompt": [*EXAMPLE, {"role": "user", "content": QUESTION.format(expression)}], "label": str(answer)}


def make_splits(max_operand: int, n_test: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Shuffle every problem with ``seed``; the first ``n_test`` are the test split, the rest train.

    :raises SystemExit: ``n_test`` leaves no training problem.
    """
    items = problems(max_operand)
    if not 0 < n_test < len(items):
        raise SystemExit(f"--n-test {n_test}: must be between 1 and {len(items) - 1} ({len(items)} problems).")
    random.Random(seed).shuffle(items)
    rows = [row(e, a) for e, a in items]
    return rows[n_test:], rows[:n_test]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data",
                        help="output folder for train.jsonl and test.jsonl (default: data/ beside this script)")
    parser.add_argument("--max-operand", type=int, default=20, help="largest operand (default 20)")
    parser.add_argument("--n-test", type=int, default=100, help="test problems (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)
    train, test = make_splits(opts.max_operand, opts.n_test, opts.seed)
    write_jsonl(opts.out / "train.jsonl", train)
    write_jsonl(opts.out / "test.jsonl", test)
    print(f"wrote {len(train)} train and {len(test)} test rows to {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
