"""Build furlong's demo: a small arithmetic task and a tiny Llama model with a short warm-up.

Writes, under ``--out`` (default: the folder of this script):

- ``data/train.jsonl`` (4,000 rows) and ``data/test.jsonl`` (200 rows), each row
  ``{"prompt": "7 - 2 + 9 = ", "label": "14"}``; the two splits share no prompt.
- ``model/``: a Hugging Face ``LlamaForCausalLM`` directory (``config.json``,
  ``generation_config.json``, ``model.safetensors``, tokenizer files with a character-level
  tokenizer) made from scratch and trained for a fixed, short number of supervised steps.

The warm-up answers half of the training prompts with ``\\boxed{14}`` and the other half with
the bare ``14``, so the model boxes about half of its answers; a reward that grades the boxed
answer (furlong's ``math``) then starts well below its ceiling, and GRPO has two things to learn:
box every answer, and get more digits right.

Everything is seeded: the JSONL files are identical on every machine; the model files are
identical with the same seed, thread count, CPU and library versions. ``--data-only`` writes
just the JSONL files (fast; torch is not imported).

Run from the repository root::

    python examples/demo/make_demo.py                      # data + model, ~2 min on one core
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
BARE = re.compile(r"-?\d+")
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


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
    """Shuffle every problem with ``seed``; the first ``n_test`` are test rows, the next train rows.

    :param n_train: number of training rows.
    :param n_test: number of test rows.
    :param seed: seed of the ``random.Random`` that shuffles the problems.
    :returns: ``(train, test)``, lists of ``{"prompt": str, "label": str}``; no prompt is in both.
    :raises SystemExit: more rows are asked for than there are problems (4,200).
    """
    problems = all_problems()
    if n_train + n_test > len(problems):
        raise SystemExit(f"--n-train + --n-test must be at most {len(problems)}")
    random.Random(seed).shuffle(problems)
    rows = [{"prompt": prompt, "label": str(answer)} for prompt, answer in problems]
    return rows[n_test : n_test + n_train], rows[:n_test]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write one JSON object per line (UTF-8, ``\\n`` line ends), creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def boxed_response(label: str) -> str:
    """The boxed warm-up response for ``label``: ``\\boxed{14}``."""
    return "\\boxed{" + label + "}"


def boxed_answer(text: str) -> str | None:
    """The integer inside the last ``\\boxed{...}`` of ``text``, or None when there is none."""
    found = BOXED.findall(text)
    return found[-1] if found else None


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer():
    """A character-level tokenizer: one token per character, the special tokens first.

    Encoding adds nothing around the text (no BOS) and decoding concatenates the characters,
    so ``decode(encode(text)) == text`` for any text made of ``CHARACTERS``; any other
    character becomes ``<unk>``.

    :returns: a ``transformers.PreTrainedTokenizerFast`` with pad/bos/eos/unk tokens and a
        chat template that renders the messages' contents one after another.
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
    """Stop unless every text encodes without ``<unk>`` and decodes back to itself exactly.

    :raises SystemExit: a text does not round-trip (the message shows it and its ids).
    """
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        back = tokenizer.decode(ids)
        if back != text or tokenizer.unk_token_id in ids:
            raise SystemExit(f"tokenizer does not round-trip {text!r}: got {back!r} from {ids}")


# --------------------------------------------------------------------------- model


def build_model(tokenizer, args: argparse.Namespace):
    """A freshly initialised model sized by ``args`` (seed torch first): ``LlamaForCausalLM``, or with
    ``--architecture qwen3_moe`` a ``Qwen3MoeForCausalLM`` whose every layer has ``--experts`` experts
    of MLP size ``--intermediate-size``, ``--topk`` of them per token (normalised top-k weights)."""
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if args.architecture == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(**common, head_dim=args.hidden_size // args.heads,
                                intermediate_size=args.intermediate_size,
                                moe_intermediate_size=args.intermediate_size, num_experts=args.experts,
                                num_experts_per_tok=args.topk, norm_topk_prob=True, decoder_sparse_step=1)
        config.architectures = ["Qwen3MoeForCausalLM"]
        return Qwen3MoeForCausalLM(config)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**common, intermediate_size=args.intermediate_size)
    config.architectures = ["LlamaForCausalLM"]
    return LlamaForCausalLM(config)


def warm_up_examples(tokenizer, rows: list[dict], bare_fraction: float, seed: int):
    """Token ids of each row's prompt and of its warm-up response followed by EOS.

    A seeded ``bare_fraction`` of the rows answer bare (``14``), the others boxed (``\\boxed{14}``).

    :returns: list of ``(prompt_ids, response_ids)``.
    """
    rng = random.Random(seed + 1)
    examples = []
    for row in rows:
        bare = rng.random() < bare_fraction
        response = row["label"] if bare else boxed_response(row["label"])
        prompt_ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        examples.append((prompt_ids, response_ids + [tokenizer.eos_token_id]))
    return examples


def lr_factor(step: int, steps: int, warm: int) -> float:
    """Learning-rate multiplier at 0-based ``step``: linear warm-up over ``warm`` steps, then a
    cosine decay from 1 to 0.1 at ``steps`` (Loshchilov & Hutter 2017, SGDR, eq. 5)."""
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def warm_up(model, tokenizer, rows: list[dict], args: argparse.Namespace) -> None:
    """Supervised warm-up: teacher forcing on prompt + response, cross-entropy on the response.

    Exactly ``args.steps`` AdamW steps (no weight decay, gradient norm clipped to 1) of
    ``args.batch_size`` rows, drawn in a seeded order (a fresh permutation each pass), with
    the learning rate of :func:`lr_factor` times ``args.lr``. Prints the loss ten times.
    """
    import torch

    examples = warm_up_examples(tokenizer, rows, args.bare_fraction, args.seed)
    order_rng = random.Random(args.seed)
    order: list[int] = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warm = max(1, args.steps // 10)
    model.train()
    for step in range(args.steps):
        if len(order) < args.batch_size:
            more = list(range(len(examples)))
            order_rng.shuffle(more)
            order += more
        batch = [examples[i] for i in order[: args.batch_size]]
        del order[: args.batch_size]
        width = max(len(p) + len(r) for p, r in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (prompt, response) in enumerate(batch):
            ids = prompt + response
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, len(prompt) : len(ids)] = torch.tensor(response)
            mask[i, : len(ids)] = 1
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(step, args.steps, warm)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % max(1, args.steps // 10) == 0:
            print(f"warm-up step {step + 1}/{args.steps}: loss {loss.item():.3f}", flush=True)
    model.eval()


def generate(model, tokenizer, prompts: list[str], *, greedy: bool, max_new_tokens: int = 16):
    """One response per prompt (a left-padded batch; temperature 1 unless ``greedy``).

    :returns: the decoded responses, special tokens removed.
    """
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
            temperature=None if greedy else 1.0,
            top_k=None,
            top_p=None,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def evaluate(model, tokenizer, rows: list[dict], *, samples: int, greedy: bool) -> dict:
    """Score responses to ``rows`` the way a boxed-answer reward does, with exact integers.

    :param samples: responses per prompt.
    :returns: ``reward`` (fraction whose last boxed integer equals the label), ``boxed``
        (fraction with a boxed integer) and ``right`` (fraction whose boxed integer, or whole
        bare response, equals the label).
    """
    prompts = [row["prompt"] for row in rows for _ in range(samples)]
    labels = [row["label"] for row in rows for _ in range(samples)]
    texts = generate(model, tokenizer, prompts, greedy=greedy)
    boxed = [boxed_answer(text) for text in texts]
    answers = [b if b is not None else (t if BARE.fullmatch(t) else None) for b, t in zip(boxed, texts)]
    n = len(texts)
    return {
        "reward": sum(b == label for b, label in zip(boxed, labels)) / n,
        "boxed": sum(b is not None for b in boxed) / n,
        "right": sum(a == label for a, label in zip(answers, labels)) / n,
    }


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags; the defaults reproduce the committed demo."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="folder that receives data/ and model/ (default: this script's).")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, init and warm-up.")
    parser.add_argument("--n-train", type=int, default=4000, help="training rows.")
    parser.add_argument("--n-test", type=int, default=200, help="test rows.")
    parser.add_argument("--data-only", action="store_true", help="write the JSONL files only.")
    parser.add_argument("--steps", type=int, default=600, help="warm-up optimizer steps.")
    parser.add_argument("--batch-size", type=int, default=64, help="warm-up rows per step.")
    parser.add_argument("--lr", type=float, default=1e-3, help="warm-up peak learning rate.")
    parser.add_argument("--bare-fraction", type=float, default=0.5,
                        help="fraction of warm-up responses that give the answer unboxed.")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--architecture", choices=["llama", "qwen3_moe"], default="llama",
                        help="llama (the committed demo) or qwen3_moe (a mixture-of-experts model).")
    parser.add_argument("--experts", type=int, default=4, help="qwen3_moe: experts per layer.")
    parser.add_argument("--topk", type=int, default=2, help="qwen3_moe: experts per token.")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (the model files depend on it).")
    parser.add_argument("--eval-samples", type=int, default=4,
                        help="sampled responses per test prompt in the final report.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Write the data, then (unless ``--data-only``) build, warm up, save and score the model."""
    args = parse_args(argv)
    train, test = make_splits(args.n_train, args.n_test, args.seed)
    write_jsonl(args.out / "data" / "train.jsonl", train)
    write_jsonl(args.out / "data" / "test.jsonl", test)
    print(f"wrote {len(train)} train and {len(test)} test rows to {args.out / 'data'}")
    if args.data_only:
        return 0

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    texts = [row["prompt"] + boxed_response(row["label"]) for row in train + test]
    check_round_trip(tokenizer, texts)
    model = build_model(tokenizer, args)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")
    start = time.perf_counter()
    warm_up(model, tokenizer, train, args)
    print(f"warm-up: {time.perf_counter() - start:.0f} s")

    model_dir = args.out / "model"
    model.generation_config.max_new_tokens = 16
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    check_round_trip(tokenizer, texts)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(args.seed)
    sampled = evaluate(model, tokenizer, test, samples=args.eval_samples, greedy=False)
    greedy = evaluate(model, tokenizer, test, samples=1, greedy=True)
    for name, scores in ((f"sampled, T=1, {args.eval_samples}/prompt", sampled), ("greedy", greedy)):
        print(f"test {name}: reward {scores['reward']:.3f}, boxed {scores['boxed']:.3f}, "
              f"right boxed or bare {scores['right']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
