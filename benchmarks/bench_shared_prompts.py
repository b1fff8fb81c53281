"""Prompt sharing in the fsdp backend's forward: one GRPO rollout batch of the demo, timed with and without.

    python benchmarks/bench_shared_prompts.py            # --threads, --repeats, --seed, --json PATH

Draws the demo's rollout (the first 32 prompts of examples/demo/data/train.jsonl, 8 samples each
at temperature 1.0, at most 12 new tokens, from the demo model with transformers' ``generate``),
plans its micro-batches with the core's planner as ``run_demo.sh`` does (``--micro-batch-size
64``) and as a run without micro-batch flags does (packed by tokens, the default budget), counts
how the groups land in micro-batches, then times over the 256 samples, micro-batch by
micro-batch: the log-prob pass (no grad) and forward + backward of a policy-gradient loss, each
without prompt sharing (``forward_log_probs(share_prompts=False)``), with it in each of its
two layouts (``rows`` and ``two_passes``, forced for every micro-batch) and with the layout
the planner chooses per micro-batch (``planned``, what a run does), alternating, the best of
``--repeats`` runs each.

Prints one JSON object (also written to ``--json PATH``): ``samples``, ``tokens``,
``prompt_tokens``, ``threads``, and per plan under ``plans`` the group placement
(``micro_batches``, ``samples``, ``groups``, ``groups_in_one_micro_batch``, ``prompt_passes``)
the best seconds ``log_probs_s_<way>`` and ``forward_backward_s_<way>`` for each way
(``unshared``, ``two_passes``, ``rows``, ``planned``) and ``planned_layouts``, how many
micro-batches the planner gave each layout (``none``: no sharing).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import attrs
import torch

from furlong.builtin_plugins.backends.fsdp import shared_prompts
from furlong.builtin_plugins.backends.fsdp.logprobs import forward_log_probs
from furlong.core.train.batching import plan_steps
from furlong.core.config.rules import DEFAULT_TOKENS_PER_MICRO_BATCH

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo"


def rollout(model, tokenizer, prompts: int, samples: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompt + response tokens and response lengths of ``prompts x samples`` samples, group by group."""
    rows = [json.loads(line) for line in (DEMO / "data" / "train.jsonl").read_text().splitlines()][:prompts]
    torch.manual_seed(seed)
    tokens, lengths = [], []
    for row in rows:
        prompt = tokenizer.encode(row["prompt"])
        out = model.generate(torch.tensor([prompt]), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=12, num_return_sequences=samples, pad_token_id=tokenizer.pad_token_id)
        for seq in out[:, len(prompt):].tolist():
            response = seq[: seq.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in seq else seq
            response = [t for t in response if t != tokenizer.pad_token_id]
            tokens.append(prompt + response)
            lengths.append(len(response))
    return tokens, lengths


def placement(plan: list[list[int]], samples: int) -> dict:
    """How the groups (``samples`` consecutive indices each) land in the micro-batches of ``plan``.

    ``prompt_passes``: the distinct prompts summed over micro-batches, the prompt passes prompt
    sharing runs (without it, one per sample).
    """
    spans: dict[int, set[int]] = {}
    for m, micro in enumerate(plan):
        for i in micro:
            spans.setdefault(i // samples, set()).add(m)
    return {"micro_batches": len(plan), "samples": sum(map(len, plan)),
            "groups_in_one_micro_batch": sum(len(s) == 1 for s in spans.values()), "groups": len(spans),
            "prompt_passes": sum(len({i // samples for i in micro}) for micro in plan)}


PLANNED = "planned"
WAYS = ("unshared", shared_prompts.TWO_PASSES, shared_prompts.ROWS, PLANNED)


def timed(model, tokens, lengths, plan, *, grad: bool, repeats: int) -> tuple[dict[str, float], dict[str, int]]:
    """Best seconds of one pass over every micro-batch of ``plan`` (forward, plus backward when ``grad``) for
    each of :data:`WAYS`, and how many micro-batches the planner gave each layout; the ways alternate, so
    load from other jobs hits them alike."""
    planner = shared_prompts.plan_sharing
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    layouts: dict[str, int] = {}
    try:
        for repeat in range(repeats):
            for way in WAYS:
                def forced(*args, _way=way, _first=repeat == 0, **kwargs):
                    plan_ = planner(*args, **kwargs)
                    if _way == PLANNED:
                        if _first:
                            key = "none" if plan_ is None else plan_.layout
                            layouts[key] = layouts.get(key, 0) + 1
                        return plan_
                    return None if plan_ is None else attrs.evolve(plan_, layout=_way)

                shared_prompts.plan_sharing = forced
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                for micro in plan:
                    lp, _ = forward_log_probs(model, [tokens[i] for i in micro], [lengths[i] for i in micro], 1.0,
                                              "cpu", grad=grad, entropy_grad=False, share_prompts=way != "unshared")
                    if grad:
                        (sum(-x.mean() for x in lp if len(x)) / len(tokens)).backward()
                times[way].append(time.perf_counter() - start)
    finally:
        shared_prompts.plan_sharing = planner
    return {way: min(t) for way, t in times.items()}, layouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO / "model")
    model = AutoModelForCausalLM.from_pretrained(DEMO / "model", dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    tokens, lengths = rollout(model, tokenizer, 32, 8, args.seed)
    model.config.use_cache = False  # as the fsdp backend loads it
    prompt_tokens = sum(len(t) - n for t, n in zip(tokens, lengths))
    report = {"samples": len(tokens), "tokens": sum(map(len, tokens)), "prompt_tokens": prompt_tokens,
              "threads": args.threads, "plans": {}}
    sizes = [len(t) for t in tokens]
    plans = {
        "--micro-batch-size 64": plan_steps(sizes, 256, 1, 1, 0, 64, None, False, False)[0],
        f"packed by tokens ({DEFAULT_TOKENS_PER_MICRO_BATCH})": plan_steps(
            sizes, 256, 1, 1, 0, 1, DEFAULT_TOKENS_PER_MICRO_BATCH, True, False)[0],
    }
    for name, plan in plans.items():
        row = placement(plan, 8)
        for grad, label in ((False, "log_probs_s"), (True, "forward_backward_s")):
            best, layouts = timed(model, tokens, lengths, plan, grad=grad, repeats=args.repeats)
            row.update({f"{label}_{way}": round(seconds, 4) for way, seconds in best.items()})
            row["planned_layouts"] = layouts
        report["plans"][name] = row
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
