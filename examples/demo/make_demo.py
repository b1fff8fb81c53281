"""Build furlong's demo: an integer-arithmetic task and a tiny, briefly warmed-up Llama model.

Writes, under ``--out`` (default: this script's folder):

- ``data/train.jsonl`` and ``data/test.jsonl``: rows ``{"prompt": "23 + 45 - 9 = ", "label": "59"}``;
  the two splits share no prompt.
- ``model/``: a Hugging Face ``LlamaForCausalLM`` directory (``config.json``,
  ``generation_config.json``, ``model.safetensors``, tokenizer files) with a character-level
  tokenizer, trained for a fixed, deliberately short number of supervised steps to answer
  ``\\boxed{59}`` followed by the end-of-sequence token.

The warm-up stops early on purpose: the model knows the answer format but samples the right
number only part of the time, which leaves room for reinforcement learning to improve it.
Everything is seeded; with the same seed, thread count and library versions the files come out
identical. ``--data-only`` writes just the two JSONL files (fast, no torch needed).

Run from the repository root::

    python examples/demo/make_demo.py            # data + model, a few minutes on 2 CPU cores
    python examples/demo/make_demo.py --data-only --out /tmp/demo
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
CHARACTERS = "0123456789+-= \\boxed{}"
BOXED = re.compile(r"\\boxed\{(-?\d+)\}")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
)


# --------------------------------------------------------------------------- data


def all_problems() -> list[tuple[str, int]]:
    """Every problem of the demo task, in a fixed order: single-digit sums and differences.

    ``a + b`` and ``a - b`` (200 problems) and ``a + b + c``, ``a + b - c``, ``a - b + c``,
    ``a - b - c`` (4,000 problems), with ``a, b, c`` in 0..9; answers range from -18 to 27.

    :returns: ``(prompt, answer)`` pairs, e.g. ``("7 - 2 + 9 = ", 14)``.
    """
    sign = {"+": 1, "-": -1}
    problems: list[tuple[str, int]] = []
    for a in range(10):
        for op in "+-":
            for b in range(10):
                problems.append((f"{a} {op} {b} = ", a + sign[op] * b))
    for a in range(10):
        for op1 in "+-":
            for b in range(10):
                for op2 in "+-":
                    for c in range(10):
                        answer = a + sign[op1] * b + sign[op2] * c
                        problems.append((f"{a} {op1} {b} {op2} {c} = ", answer))
    return problems


def make_splits(n_train: int, n_test: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Shuffle every problem with ``seed`` and cut test rows, then train rows, from the front.

    :param n_train: number of training rows.
    :param n_test: number of test rows.
    :param seed: seed of the ``random.Random`` that shuffles the problems.
    :returns: two lists of ``{"prompt": str, "label": str}``; no prompt is in both.
    :raises SystemExit: more rows are asked for than there are problems.
    """
    problems = all_problems()
    if n_train + n_test > len(problems):
        raise SystemExit(f"--n-train + --n-test must be at most {len(problems)}")
    random.Random(seed).shuffle(problems)
    rows = [{"prompt": prompt, "label": str(answer)} for prompt, answer in problems]
    return rows[n_test : n_test + n_train], rows[:n_test]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write one JSON object per line (keys in insertion order, UTF-8, ``\\n`` line ends)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def response_text(label: str) -> str:
    """The response the warm-up teaches for ``label`` (the tokenizer appends no EOS itself)."""
    return "\\boxed{" + label + "}"


def boxed_answer(text: str) -> str | None:
    """The integer inside the last ``\\boxed{...}`` of ``text``, or None when there is none."""
    found = BOXED.findall(text)
    return found[-1] if found else None


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer():
    """A character-level tokenizer: one token per character, special tokens first.

    Nothing is added around the text when encoding (no BOS), and decoding concatenates the
    characters, so ``decode(encode(text)) == text`` for any text made of ``CHARACTERS``.

    :returns: a ``transformers.PreTrainedTokenizerFast``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(list(SPECIAL_TOKENS) + list(CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=64,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def check_round_trip(tokenizer, texts: list[str]) -> None:
    """Fail loudly unless every text encodes and decodes back to itself exactly.

    :raises SystemExit: a text does not round-trip (the message shows it).
    """
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        back = tokenizer.decode(ids)
        if back != text or tokenizer.unk_token_id in ids:
            raise SystemExit(f"tokenizer does not round-trip {text!r}: got {back!r} from {ids}")


# --------------------------------------------------------------------------- model


def build_model(tokenizer, args):
    """A freshly initialised ``LlamaForCausalLM`` sized by ``args`` (tied embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    return LlamaForCausalLM(config)


def _encode(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int], list[bool]]]:
    """Token ids of each row's prompt, of its response plus EOS, and which response ids are answer."""
    encoded = []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        response = tokenizer(response_text(row["label"]), add_special_tokens=False)["input_ids"]
        answer = [False] * len("\\boxed{") + [True] * len(row["label"]) + [False, False]
        encoded.append((prompt, response + [tokenizer.eos_token_id], answer))
    return encoded


def _schedule(step: int, steps: int, warm: int) -> float:
    """Learning-rate factor: linear warm-up over ``warm`` steps, then cosine decay to 0.1."""
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def warm_up(model, tokenizer, rows: list[dict], args) -> None:
    """Supervised warm-up: teacher forcing on prompt + response, loss on response tokens only.

    Runs exactly ``args.steps`` AdamW steps of ``args.batch_size`` rows drawn in a seeded order
    (a fresh permutation each pass), with linear learning-rate warm-up over the first 10% of steps.
    At answer positions the target is smoothed over the ten digits: loss
    ``(1 - eps) * -log p(target) + eps * mean_d -log p(d)`` with ``eps = args.digit_smoothing``
    (label smoothing, Szegedy et al. 2016, sec. 7, restricted to the digit tokens), so the model
    writes the answer format reliably but is left unsure of the digits when sampling.
    """
    import torch

    encoded = _encode(tokenizer, rows)
    digits = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))
    order_rng = random.Random(args.seed)
    order: list[int] = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warm = max(1, args.steps // 10)
    model.train()
    for step in range(args.steps):
        if len(order) < args.batch_size:
            extra = list(range(len(encoded)))
            order_rng.shuffle(extra)
            order += extra
        batch = [encoded[i] for i in order[: args.batch_size]]
        del order[: args.batch_size]
        width = max(len(p) + len(r) for p, r, _ in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
        targets = torch.zeros((len(batch), width), dtype=torch.long)
        weight = torch.zeros((len(batch), width))
        answer = torch.zeros((len(batch), width), dtype=torch.bool)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (prompt, response, is_answer) in enumerate(batch):
            ids = prompt + response
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
            # position t predicts token t + 1
            start = len(prompt) - 1
            targets[i, start : start + len(response)] = torch.tensor(response)
            weight[i, start : start + len(response)] = 1.0
            answer[i, start : start + len(response)] = torch.tensor(is_answer)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * _schedule(step, args.steps, warm)
        logits = model(input_ids=input_ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        smooth = -logp[..., digits].mean(-1)
        eps = args.digit_smoothing
        per_token = torch.where(answer, (1 - eps) * nll + eps * smooth, nll)
        loss = (per_token * weight).sum() / weight.sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % max(1, args.steps // 10) == 0:
            print(f"warm-up step {step + 1}/{args.steps}: loss {loss.item():.3f}", flush=True)
    model.eval()


def sample_answers(model, tokenizer, prompts: list[str], *, greedy: bool, max_new_tokens: int = 16):
    """Generate one response per prompt (left-padded batch) and return the decoded texts."""
    import torch

    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, ids in enumerate(encoded):
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        mask[i, width - len(ids) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=not greedy,
            temperature=1.0 if not greedy else None,
            top_k=None,
            top_p=None,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def evaluate(model, tokenizer, rows: list[dict], *, samples: int, greedy: bool) -> dict:
    """Grade responses to ``rows`` by exact integer match of the last boxed answer.

    :param samples: responses per prompt (temperature 1.0 when not ``greedy``).
    :returns: ``{"accuracy": fraction correct, "boxed": fraction with a boxed integer}``.
    """
    prompts = [row["prompt"] for row in rows for _ in range(samples)]
    labels = [row["label"] for row in rows for _ in range(samples)]
    texts = sample_answers(model, tokenizer, prompts, greedy=greedy)
    answers = [boxed_answer(text) for text in texts]
    correct = sum(a is not None and int(a) == int(l) for a, l in zip(answers, labels))
    boxed = sum(a is not None for a in answers)
    return {"accuracy": correct / len(texts), "boxed": boxed / len(texts)}


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags; every default reproduces the committed demo."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="folder that receives data/ and model/ (default: this script's).")
    parser.add_argument("--seed", type=int, default=0, help="seed for data, init and warm-up.")
    parser.add_argument("--n-train", type=int, default=4000, help="training prompts.")
    parser.add_argument("--n-test", type=int, default=200, help="test prompts.")
    parser.add_argument("--data-only", action="store_true", help="write the JSONL files only.")
    parser.add_argument("--steps", type=int, default=600, help="warm-up optimizer steps.")
    parser.add_argument("--batch-size", type=int, default=64, help="warm-up rows per step.")
    parser.add_argument("--lr", type=float, default=3e-3, help="warm-up peak learning rate.")
    parser.add_argument("--digit-smoothing", type=float, default=0.3,
                        help="label smoothing over the digits at answer positions.")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads.")
    parser.add_argument("--eval-samples", type=int, default=4,
                        help="sampled responses per test prompt in the final report.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    train, test = make_splits(args.n_train, args.n_test, args.seed)
    write_jsonl(args.out / "data" / "train.jsonl", train)
    write_jsonl(args.out / "data" / "test.jsonl", test)
    print(f"wrote {len(train)} train and {len(test)} test rows to {args.out / 'data'}")
    if args.data_only:
        return 0

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    every_text = [row["prompt"] + response_text(row["label"]) for row in train + test]
    check_round_trip(tokenizer, every_text)
    model = build_model(tokenizer, args)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters")

    start = time.perf_counter()
    warm_up(model, tokenizer, train, args)
    print(f"warm-up took {time.perf_counter() - start:.0f} s")

    model_dir = args.out / "model"
    model.generation_config.max_new_tokens = 16
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(model_dir)
    check_round_trip(reloaded, every_text)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(args.seed)
    sampled = evaluate(model, reloaded, test, samples=args.eval_samples, greedy=False)
    greedy = evaluate(model, reloaded, test, samples=1, greedy=True)
    print(f"test accuracy, sampled at temperature 1.0 ({args.eval_samples} per prompt): "
          f"{sampled['accuracy']:.3f} (boxed answer present: {sampled['boxed']:.3f})")
    print(f"test accuracy, greedy: {greedy['accuracy']:.3f} (boxed: {greedy['boxed']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
