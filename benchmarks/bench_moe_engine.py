"""The embedded engine on a small Qwen3-MoE (random weights) on one GPU: tok/s with and without CUDA graphs, and
log-prob and routing parity with transformers on the same checkpoint.

One command, from the repository root, on a machine with a CUDA GPU::

    python benchmarks/bench_moe_engine.py         # --json PATH writes every figure; --help for the rest

The model: ``Qwen3MoeForCausalLM`` with hidden 1024, ``--layers`` (12) decoder layers, all MoE,
``--experts`` (64) experts of intermediate size ``--moe-intermediate`` (384), top ``--topk`` (8),
16 query and 4 key/value heads of 64, the Qwen vocabulary (151,936), bfloat16, written with
transformers' ``save_pretrained`` (per-expert names on disk) beside a word-level tokenizer.

Parts, each in a process of its own (one part's cache and graph pools are not held while the next runs):

- ``graphs``: ``--requests`` (256) requests of ``--prompt-len`` (128) random tokens, each generating
  exactly ``--new-tokens`` (256) tokens (temperature 1, ``ignore_eos``), submitted at once
  (``--embedded-max-batch-size`` = requests); one warm-up run (graph captures), then
  ``--repeats`` timed runs; tok/s = new tokens / wall seconds of the best run. Also reports
  whether the decode step stayed captured (``graphs_on``, graphs captured) and the experts
  kernels used (prefill, decode).
- ``no_graphs``: the same with CUDA graphs off (each decode step launched op by op).
- ``routing``: ``graphs`` with the routing of every token recorded (``--use-rollout-routing-replay``).
- ``compiled``: ``graphs`` with ``--embedded-torch-compile`` (its warm-up includes the compilation).
- ``parity_bf16`` and ``parity_fp32``: ``--parity-requests`` (32) sampled requests of ``--new-tokens``
  tokens with routing recorded, in bfloat16 (``grouped_mm`` experts) and float32 (``eager``
  prefill, ``batched_mm`` decode); then transformers' own model on the same checkpoint and dtype
  (its default experts implementation) scores each prompt + response with
  ``output_router_logits=True``. Reported: the largest and the mean absolute difference between
  the engine's log-prob of each generated token and transformers', and the share of (token,
  layer) pairs whose recorded experts equal the top-k of transformers' router logits (as sets).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import print_part, prompts, run_part, save_json, write_word_tokenizer  # noqa: E402

SHARED = ("requests", "prompt_len", "new_tokens", "repeats", "parity_requests", "hidden", "layers", "experts", "topk",
          "moe_intermediate")  # the options a part's process gets


def _device() -> str:
    """``cuda`` (a CPU runs the parts only to check this script, never for figures)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_model(folder: Path, opts) -> Path:
    """Random Qwen3-MoE weights (bfloat16) of the shape the options give, and a word-level tokenizer."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=151936, hidden_size=opts.hidden, intermediate_size=4 * opts.hidden, num_hidden_layers=opts.layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=opts.experts,
        num_experts_per_tok=opts.topk, moe_intermediate_size=opts.moe_intermediate, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1e6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(_device()):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    write_word_tokenizer(folder, config.vocab_size, config.eos_token_id)
    return folder


def _engine(folder: Path, opts, *, requests: int, half: bool = True, compile: str | None = None,
            record_routing: bool = False):
    from furlong.builtin_plugins.engines import embedded

    return embedded.load_engine(str(folder), max_batch_size=requests, half=half, seed=0, compile=compile,
                                record_routing=record_routing)


def _generate(engine, batch: list[list[int]], new_tokens: int) -> list:
    params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}

    async def run():
        return await asyncio.gather(*[engine.generate(p, dict(params)) for p in batch])

    return asyncio.run(run())


def _throughput(folder: Path, opts, graphs: bool = True, **engine_kwargs) -> dict:
    import torch

    engine = _engine(folder, opts, requests=opts.requests, **engine_kwargs)
    decoder = engine._decoder
    if not graphs:
        decoder.graphs_on = False
    batch = prompts(opts.requests, opts.prompt_len)
    times = []
    for _ in range(1 + opts.repeats):
        _sync()
        start = time.perf_counter()
        outs = _generate(engine, batch, opts.new_tokens)
        _sync()
        times.append(time.perf_counter() - start)
    tokens = sum(len(o.output_ids) for o in outs)
    assert tokens == opts.requests * opts.new_tokens, tokens
    result = {"tokens": tokens, "warmup_s": times[0], "times_s": times[1:], "tok_per_s": tokens / min(times[1:]),
              "graphs_on": decoder.graphs_on, "graphs_captured": sum(g is not False for g in decoder._graphs.values()),
              "experts_kernels": list(decoder.experts.kernels),
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}
    if engine_kwargs.get("record_routing"):
        shapes = {tuple(o.routed_experts.shape) for o in outs}
        result["routed_experts_shapes"] = sorted(shapes)
    return result


def _parity(folder: Path, opts, dtype_name: str) -> dict:
    """The engine's log-probs and routing against transformers' on the same checkpoint, in ``dtype_name``."""
    import torch
    from transformers import AutoModelForCausalLM

    half = dtype_name == "bfloat16"
    engine = _engine(folder, opts, requests=opts.parity_requests, half=half, record_routing=True)
    batch = prompts(opts.parity_requests, opts.prompt_len, seed=2)
    outs = _generate(engine, batch, opts.new_tokens)
    kernels = list(engine._decoder.experts.kernels)
    graphs_on = engine._decoder.graphs_on
    del engine
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype_name)).to(_device()).eval()
    topk = model.config.num_experts_per_tok
    diffs, agree, pairs = [], 0, 0
    with torch.no_grad():
        for prompt, out in zip(batch, outs):
            ids = torch.tensor([prompt + out.output_ids], device=_device())
            ref = model(ids, output_router_logits=True)
            log_probs = torch.log_softmax(ref.logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
            expected = log_probs[len(prompt) - 1:].cpu()
            diffs.append((torch.tensor(out.output_log_probs) - expected).abs())
            chosen = torch.stack([r.topk(topk, dim=-1).indices for r in ref.router_logits], dim=1)[:-1].cpu()
            recorded = torch.from_numpy(out.routed_experts).long()
            same = (chosen.sort(-1).values == recorded.sort(-1).values).all(-1)
            agree += int(same.sum())
            pairs += same.numel()
    diff = torch.cat(diffs)
    return {"dtype": dtype_name, "requests": len(outs), "tokens": int(diff.numel()), "experts_kernels": kernels,
            "graphs_on": graphs_on, "transformers_experts": model.config._experts_implementation,
            "max_abs_log_prob_diff": float(diff.max()), "mean_abs_log_prob_diff": float(diff.mean()),
            "routing_agreement": agree / pairs}


PARTS = {
    "graphs": lambda folder, opts: _throughput(folder, opts),
    "no_graphs": lambda folder, opts: _throughput(folder, opts, graphs=False),
    "routing": lambda folder, opts: _throughput(folder, opts, record_routing=True),
    "compiled": lambda folder, opts: _throughput(folder, opts, compile="inductor"),
    "parity_bf16": lambda folder, opts: _parity(folder, opts, "bfloat16"),
    "parity_fp32": lambda folder, opts: _parity(folder, opts, "float32"),
}


def _part_in_subprocess(name: str, folder: Path, argv: list[str]) -> dict:
    return run_part(__file__, [*argv, "--part", name, "--model-dir", str(folder)])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs after the warm-up (best is reported)")
    parser.add_argument("--parity-requests", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--moe-intermediate", type=int, default=384)
    parser.add_argument("--skip", nargs="*", default=[], choices=list(PARTS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.part:  # a child process of the run below
        print_part(PARTS[opts.part](opts.model_dir, opts))
        return 0
    import torch
    import transformers

    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_engine.py needs a CUDA GPU.")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "options": vars(opts) | {"json": None}}
    tmp = tempfile.mkdtemp(prefix="bench_moe_")
    child_argv = [x for k in SHARED for x in (f"--{k.replace('_', '-')}", str(getattr(opts, k)))]
    try:
        folder = build_model(Path(tmp) / "model", opts)
        for name in PARTS:
            if name not in opts.skip:
                result[name] = _part_in_subprocess(name, folder, child_argv)
                print(name, json.dumps(result[name]), flush=True)
                save_json(opts.json, result)
    finally:
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)
    if "tok_per_s" in result.get("graphs", {}) and "tok_per_s" in result.get("no_graphs", {}):
        result["graphs_over_no_graphs"] = result["graphs"]["tok_per_s"] / result["no_graphs"]["tok_per_s"]
    print(json.dumps({k: v for k, v in result.items() if k != "options"}, indent=1))
    save_json(opts.json, result)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
