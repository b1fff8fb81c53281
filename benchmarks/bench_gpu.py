"""The embedded engine and the fsdp train path on one GPU, at the Qwen2.5-0.5B shape (random weights).

One command, from the repository root, on a machine with a CUDA GPU::

    python benchmarks/bench_gpu.py              # --json PATH writes every figure; --help for the rest

0. **Kernels** (part ``kernels``): the engine's Triton decode attention and sampler against the torch
   code they replace, in bfloat16 at this shape: largest differences, token agreement, milliseconds
   per call, and the attention kernel's launch options timed (27 choices).
1. **Engine**: ``--requests`` (256) requests of ``--prompt-len`` (128) random prompt tokens, each
   generating exactly ``--new-tokens`` (256) tokens (``ignore_eos``, temperature 1), all
   submitted at once to the embedded engine (``--embedded-max-batch-size`` = requests),
   then to the engine with ``--embedded-torch-compile`` (part ``engine_compiled``), then the
   same without the decode kernels and fused projections (part ``engine_compiled_torch``), then
   the same batch through transformers ``generate`` with a static cache
   (``cache_implementation="static"``, sampling, ``min_new_tokens`` = ``max_new_tokens``).
   Each is run once to warm up (CUDA graphs, compilation) and then timed; tok/s = new
   tokens / wall seconds. The engine's timed runs alternate with runs that read each decode
   step's finish flags before launching the next (``tok_per_s_without_overlap``). ``--stop S``
   gives every request the stop string ``S`` (choose one that never occurs: the decoded-text
   checks then run at every step without ending a request). ``--profile`` adds part ``engine_profile``:
   one compiled run under ``torch.profiler``, with the GPU-busy share and the top kernels. Each part
   runs in a process of its own, so that one part's GPU memory (the engine's key/value cache,
   CUDA graph pools) is not held while the next runs.
2. **GRPO steps, side by side** (``--runs``, :data:`RUNS`): ``furlong train`` (sync, embedded
   engine, the run's train backend) for ``--rollouts`` (20) rollouts of ``requests / 8`` prompts x
   8 samples, responses of ``--new-tokens`` tokens, one optimizer step per rollout. A ``*-default``
   run gives no tuning flag (the machine chooses the micro-batch token budget, the engine's
   batch and compilation: ``machine_defaults`` of ``--print-config``, listed in the result); a
   ``*-best`` run gives the best flags measured by hand. From ``metrics.jsonl``, medians over the
   rollouts after the first ``--warmup-rollouts`` (3): the step split (rollout, log-probs, train,
   weight sync, the whole step ``perf/step_time``), tokens/s per GPU over the whole step (prompt
   and response tokens of the step / step seconds), and the train MFU
   (``6 x params x tokens / actor-train seconds / 989e12``, the H200's dense bf16 peak;
   ``--peak-tflops`` to change). ``--train-flags`` adds flags to every run. Each run has a
   ``*-async`` twin under ``furlong train-async`` (generation of the next rollout overlaps training).

The model (Llama architecture at Qwen2.5-0.5B's sizes: 24 layers, hidden 896, 14 heads, 2 KV heads, vocabulary
151,936, tied embeddings) and a word-level tokenizer of the same vocabulary are written to
a temporary folder; no download is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda"
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, 
                  rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643)


def build_model(folder: Path) -> Path:
    """Random Qwen2.5-0.5B-shaped weights (bfloat16) and a word-level tokenizer ``t0 .. t151935``.

    The architecture is Llama's with Qwen2.5-0.5B's sizes (Qwen2 differs only by biases on the
    query, key and value projections, 0.1% of the parameters): transformers gives a ``qwen2``
    model directory its own byte-level tokenizer class, which cannot read a word-level vocabulary.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**QWEN25_05B, pad_token_id=0, attention_bias=False)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    write_word_tokenizer(folder, config.vocab_size, config.eos_token_id)
    return folder


def write_word_tokenizer(folder: Path, vocab_size: int, eos_token_id: int) -> None:
    """A word-level tokenizer ``t0 .. t{vocab_size - 1}`` (pad ``t0``, unknown ``t1``) saved to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=f"t{eos_token_id}", pad_token="t0",
                            unk_token="t1").save_pretrained(folder)


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 151000, (count, length), generator=gen).tolist()


def bench_engine(folder: Path, opts, compile: str | None = None, kernels: bool = True) -> dict:
    import torch

    from furlong.builtin_plugins.engines import embedded

    engine = embedded.load_engine(str(folder), max_batch_size=opts.requests, seed=0, compile=compile,
                                  decode_kernels=kernels)
    batch = prompts(opts.requests, opts.prompt_len)
    params = {"temperature": 1.0, "max_new_tokens": opts.new_tokens, "ignore_eos": True}
    if opts.stop:
        params["stop"] = [opts.stop]

    async def run():
        return await asyncio.gather(*[engine.generate(p, dict(params)) for p in batch])

    def timed(overlap: bool) -> tuple[float, list]:
        engine._decoder.overlap = overlap
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = asyncio.run(run())
        return time.perf_counter() - start, outs

    warmup, outs = timed(True)
    times, plain = [], []  # timed runs alternate: overlapped steps (the default), then steps read one by one
    for _ in range(opts.repeats):
        times.append(timed(True)[0])
        plain.append(timed(False)[0])
    tokens = sum(len(o.output_ids) for o in outs)
    assert tokens == opts.requests * opts.new_tokens, tokens
    best = min(times)
    return {"tokens": tokens, "warmup_s": warmup, "times_s": times, "tok_per_s": tokens / best,
            "times_without_overlap_s": plain, "tok_per_s_without_overlap": tokens / min(plain),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def bench_generate(folder: Path, opts) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    model.eval()
    ids = torch.tensor(prompts(opts.requests, opts.prompt_len), device="cuda")
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  max_new_tokens=opts.new_tokens, min_new_tokens=opts.new_tokens, cache_implementation="static",
                  pad_token_id=0)
    times = []
    with torch.no_grad():
        for _ in range(1 + opts.repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    tokens = int((out.shape[1] - ids.shape[1]) * out.shape[0])
    return {"tokens": tokens, "warmup_s": times[0], "times_s": times[1:], "tok_per_s": tokens / min(times[1:])}


def bench_grpo(folder: Path, opts, out: Path, flags: list[str], command: str = "train") -> dict:
    """``furlong COMMAND`` (``train`` or ``train-async``) with ``flags`` in a subprocess; the step split,
    tokens/s/GPU and MFU from its metrics.jsonl.

    Figures are medians over the rollouts after the first ``--warmup-rollouts`` (compilation,
    CUDA graph capture and the allocator's growth happen there); ``warmup_step_s`` lists those.
    """
    group = 8
    n_prompts = max(1, opts.requests // group)
    data = out / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(f"t{t}" for t in p), "label": "0"}) + "\n"
                            for p in prompts(n_prompts * opts.rollouts, opts.prompt_len, seed=1)))
    cmd = [sys.executable, "-m", "furlong.core", command, "--hf-checkpoint", str(folder), "--prompt-data", str(data),
           "--input-key", "prompt", "--label-key", "label", "--rm-type", "deterministic_random",
           "--num-rollout", str(opts.rollouts), "--rollout-batch-size", str(n_prompts),
           "--n-samples-per-prompt", str(group), "--global-batch-size", str(n_prompts * group),
           "--rollout-max-response-len", str(opts.new_tokens), "--lr", "1e-6", "--log-dir", str(out / "logs"), *flags]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return {"error": done.stderr[-3000:], "command": " ".join(cmd[1:])}
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    every = [r for r in rows if "rollout/step" in r]
    rollouts = every[opts.warmup_rollouts:] or every
    steps = [r for r in rows if "train/step" in r]
    params = sum(v for v in _param_count(folder).values())
    tokens = statistics.median(n_prompts * group * (opts.prompt_len + r["rollout/response_lengths"]) for r in rollouts)
    median = lambda key: statistics.median(r.get(key, 0.0) for r in rollouts)  # noqa: E731
    step_s, train_s = median("perf/step_time"), median("perf/actor_train_time")
    shown = subprocess.run([*cmd, "--print-config"], cwd=ROOT, capture_output=True, text=True)
    try:
        config = json.loads(shown.stdout)
    except ValueError:  # the run's figures still count; say why the chosen values are missing
        config = {"args": {}, "machine_defaults": [], "print_config_error": (shown.stderr or shown.stdout)[-2000:]}
    return {
        "command": " ".join(cmd[1:]), "wall_s": wall, "params": params,
        "chosen": {k: config["args"].get(k) for k in ("train_backend", "rollout_backend", "max_tokens_per_gpu",
                                                       "train_torch_compile", "embedded_max_batch_size",
                                                       "embedded_torch_compile", "bf16")},
        "machine_defaults": sorted(config["machine_defaults"]),
        **({"print_config_error": config["print_config_error"]} if "print_config_error" in config else {}),
        "split_s": {k: median(f"perf/{k}") for k in ("rollout_time", "log_probs_time", "actor_train_time",
                                                       "train_time", "update_weights_time", "step_time")},
        "warmup_step_s": [r.get("perf/step_time") for r in every[:opts.warmup_rollouts]],
        "tokens_per_step": tokens,
        "step_tokens_per_s_per_gpu": tokens / step_s if step_s else None,
        "train_mfu": 6 * params * tokens / train_s / (opts.peak_tflops * 1e12) if train_s else None,
        "train_tokens_per_s": tokens / train_s if train_s else None,
        "peak_memory_gib": max((s.get("train/peak_memory_gib", 0.0) for s in steps), default=None),
        "response_length": median("rollout/response_lengths"),
        "train_rollout_logprob_abs_diff": statistics.median(
            [s["train/train_rollout_logprob_abs_diff"] for s in steps if "train/train_rollout_logprob_abs_diff" in s]
            or [float("nan")]),
    }


RUNS = {
    "fsdp-default": "--train-backend fsdp",
    "fsdp-best": "--train-backend fsdp --train-torch-compile --max-tokens-per-gpu 32768 --embedded-max-batch-size 256 "
                 "--embedded-torch-compile",
    "megatron-default": "--train-backend megatron",
    "megatron-best": "--train-backend megatron --max-tokens-per-gpu 65536 --embedded-max-batch-size 256 "
                     "--embedded-torch-compile",
}
RUNS.update({f"{name}-async": flags for name, flags in list(RUNS.items())})
"""GRPO runs side by side (``--runs``): the flags a user gives without tuning (the machine picks the rest),
and the best flags measured by hand (docs/benchmarks.md). A ``*-async`` run is the same under
``furlong train-async`` (rollout r + 1 generated while rollout r trains, on the same GPU)."""


def _param_count(folder: Path) -> dict:
    from safetensors import safe_open

    counts = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as fh:
            for name in fh.keys():
                counts[name] = fh.get_slice(name).get_shape()
    import math

    return {k: math.prod(v) for k, v in counts.items()}


PART_PREFIX = "PART "


def run_part(script: str, argv: list[str]) -> dict:
    """Run ``python script argv`` (one benchmark part) in a fresh process, so nothing it allocates on the GPU
    outlives it; its result is the JSON of its last stdout line that starts with :data:`PART_PREFIX`
    (:func:`print_part`), or ``{"error": ...}`` with the end of its output."""
    done = subprocess.run([sys.executable, script, *argv], cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(PART_PREFIX)]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr or done.stdout)[-3000:]}
    return json.loads(lines[-1][len(PART_PREFIX):])


def print_part(result: dict) -> None:
    """In a part's process: hand ``result`` back to :func:`run_part`."""
    print(PART_PREFIX + json.dumps(result), flush=True)


def save_json(path: Path | None, result: dict) -> None:
    """Write ``result`` to ``path`` (``--json``; nothing when None): called after every part, so that a run cut
    short (a time limit, a crash) keeps the figures of the parts that finished."""
    if path is not None:
        path.write_text(json.dumps(result, indent=2, default=str))


def _part_in_subprocess(name: str, folder: Path, opts) -> dict:
    """Run one part (``engine`` or ``generate``) in a fresh process: nothing it allocates outlives it."""
    argv = ["--part", name, "--model-dir", str(folder), "--requests", str(opts.requests), "--prompt-len",
            str(opts.prompt_len), "--new-tokens", str(opts.new_tokens), "--repeats", str(opts.repeats),
            "--profile-top", str(opts.profile_top)]
    argv += ["--trace", str(opts.trace)] if opts.trace and name == "engine_profile" else []
    return run_part(__file__, argv + (["--stop", opts.stop] if opts.stop else []))


def bench_engine_compiled(folder: Path, opts) -> dict:
    """The engine with ``--embedded-torch-compile`` (its warm-up includes the compilation)."""
    return bench_engine(folder, opts, compile="inductor")


def bench_engine_compiled_torch(folder: Path, opts) -> dict:
    """``engine_compiled`` as before the decode kernels (``--no-embedded-decode-kernels``): torch's attention and
    sampler instead of furlong's Triton kernels, and separate query/key/value and gate/up projections: what
    the three change together (part ``kernels`` times the first two alone)."""
    return bench_engine(folder, opts, compile="inductor", kernels=False)


def cuda_ms(fn, warmup: int = 5, calls: int = 50) -> float:
    """Milliseconds per call of ``fn`` on the current CUDA stream: ``warmup`` calls, then the mean of ``calls``
    between two CUDA events (host launch time included where it exceeds the kernels')."""
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def bench_kernels(folder: Path, opts) -> dict:
    """The decode step's Triton kernels against the torch code they replace, in bfloat16 at the benchmark's
    shape (``--requests`` rows, 14 query and 2 key/value heads of 64, a cache of prompt + new tokens, each
    row at its own position; logits of 151,936 tokens): largest differences, token agreement, and the
    milliseconds of each per call (CUDA events, mean of 50 calls after 5)."""
    import torch

    from furlong.builtin_plugins.engines.embedded import decode_kernels
    from furlong.builtin_plugins.engines.embedded.sampling import sample_batch
    from furlong.builtin_plugins.engines.embedded.slots import SlotCache, SlotPass, slot_attention

    dev, rows, heads, kv_heads, dim = "cuda", opts.requests, 14, 2, 64
    capacity = opts.prompt_len + opts.new_tokens
    gen = torch.Generator(device=dev).manual_seed(0)
    cache = SlotCache(1, kv_heads, dim, torch.bfloat16, torch.device(dev))
    cache.ensure(rows, capacity)
    for buffer in (*cache.keys, *cache.values):
        buffer.normal_(generator=gen)
    query = torch.randn(rows, heads, 1, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    key, value = (torch.randn(rows, kv_heads, 1, dim, device=dev, dtype=torch.bfloat16, generator=gen)
                  for _ in range(2))
    pos = torch.randint(0, capacity, (rows,), device=dev, generator=gen)
    module = type("Layer", (), {"layer_idx": 0})()

    def torch_path():
        width = capacity
        visible = (torch.arange(width, device=dev)[None, :] <= pos[:, None])[:, None, None, :]
        step = SlotPass(cache=cache, rows=torch.arange(rows, device=dev), columns=pos[:, None], visible=visible,
                        width=width)
        return slot_attention(module, query, key, value, None, slot_pass=step)[0]

    def kernel_path():
        step = SlotPass(cache=cache, rows=torch.arange(rows, device=dev), columns=pos[:, None], kernel=True)
        return slot_attention(module, query, key, value, None, slot_pass=step)[0]

    ref, got = torch_path().float(), kernel_path().float()
    result = {"attention_max_abs_diff": (ref - got).abs().max().item(), "attention_max_abs": ref.abs().max().item(),
              "attention_ms": {"torch": cuda_ms(torch_path), "kernel": cuda_ms(kernel_path)}}
    # launch options of the attention kernel, at this shape and at 64 rows of a 4,096-column cache (at this
    # shape a call is short enough that launch time dominates: the "long" figures rank the options)
    long_rows = min(64, rows)
    long_cache = SlotCache(1, kv_heads, dim, torch.bfloat16, torch.device(dev))
    long_cache.ensure(long_rows, 4096)
    long_pos = torch.randint(2048, 4096, (long_rows,), device=dev, generator=gen)
    shapes = {"bench": (cache, query, key, value, pos),
              "long": (long_cache, query[:long_rows], key[:long_rows], value[:long_rows], long_pos)}
    sweep = {}
    for block_n in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (1, 2, 3):
                name = f"n{block_n}_w{warps}_s{stages}"
                sweep[name] = {shape: cuda_ms(lambda c=c, q=q, k=k, v=v, p=p: decode_kernels.decode_attention(
                    q, k, v, c.keys[0], c.values[0], p, dim ** -0.5, block_n=block_n, num_warps=warps,
                    num_stages=stages)) for shape, (c, q, k, v, p) in shapes.items()}
    result["attention_sweep_ms"] = sweep
    logits = (torch.randn(rows, 151936, device=dev, generator=gen) * 4).to(torch.bfloat16)
    temp = torch.full((rows,), 1.0, device=dev)
    greedy = torch.zeros(rows, dtype=torch.bool, device=dev)
    greedy[::16] = True
    seeds = torch.arange(rows, device=dev) * 7919 + 3
    counters = torch.full((rows,), 11, device=dev)
    tok_ref, lp_ref = sample_batch(logits.float(), temp, greedy, seeds, counters)
    tok, lp = decode_kernels.sample_plain(logits, temp, greedy, seeds, counters)
    result |= {"sampling_token_agreement": (tok_ref == tok).float().mean().item(),
               "sampling_max_abs_logprob_diff": (lp_ref - lp).abs().max().item(),
               "sampling_ms": {"torch": cuda_ms(lambda: sample_batch(logits.float(), temp, greedy, seeds, counters)),
                               "kernel": cuda_ms(lambda: decode_kernels.sample_plain(logits, temp, greedy, seeds,
                                                                                   counters))}}
    return result


def bench_engine_profile(folder: Path, opts) -> dict:
    """Where a decode run's time goes: the engine with ``--embedded-torch-compile``, one warm-up run, then one run
    under ``torch.profiler`` (CPU and CUDA activity). Reports the run's wall seconds, the summed time of its CUDA
    kernels (the GPU-busy share = kernel seconds / wall seconds; what is left is host time between kernels), and
    the ``--profile-top`` kernels by total time. (CUDA activity is recorded process-wide; CPU operators only in
    the profiling thread, not the engine's decode thread, so none are reported.)"""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from furlong.builtin_plugins.engines import embedded

    engine = embedded.load_engine(str(folder), max_batch_size=opts.requests, seed=0, compile="inductor")
    batch = prompts(opts.requests, opts.prompt_len)
    params = {"temperature": 1.0, "max_new_tokens": opts.new_tokens, "ignore_eos": True}

    async def run():
        return await asyncio.gather(*[engine.generate(p, dict(params)) for p in batch])

    asyncio.run(run())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        outs = asyncio.run(run())
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if opts.trace:
        prof.export_chrome_trace(str(opts.trace))
    tokens = sum(len(o.output_ids) for o in outs)
    return {"tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall, **kernel_summary(prof, wall, opts.profile_top)}


KERNEL_KINDS = (("gemm", re.compile(r"gemm|nvjet|cutlass|sm90_|sm80_|xmma|splitk", re.I)),
                ("attention", re.compile(r"flash|fmha|attention|attn", re.I)),
                ("triton", re.compile(r"^triton", re.I)),
                ("copy", re.compile(r"copy|memcpy|memset|fill|cat", re.I)))


def kernel_summary(prof, wall_s: float, top: int) -> dict:
    """A ``torch.profiler`` run's CUDA kernels: their summed seconds, the GPU-busy share (kernel seconds / the
    run's ``wall_s``; what is left is host time between kernels), seconds by kind (matrix products, attention,
    Triton (inductor's fused element-wise kernels and ours), copies and fills, the rest), and the ``top``
    kernels by total time."""
    import torch

    kernels = sorted((e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.self_device_time_total, reverse=True)
    kernel_s = sum(e.self_device_time_total for e in kernels) / 1e6
    kinds = {name: 0.0 for name, _ in KERNEL_KINDS} | {"other": 0.0}
    for e in kernels:
        kind = next((name for name, pattern in KERNEL_KINDS if pattern.search(e.key)), "other")
        kinds[kind] += e.self_device_time_total / 1e6
    return {"kernel_s": kernel_s, "gpu_busy": kernel_s / wall_s, "kernel_s_by_kind": kinds,
            "kernels": [{"name": e.key[:120], "s": e.self_device_time_total / 1e6, "calls": e.count}
                        for e in kernels[:top]]}


PARTS = {"kernels": bench_kernels, "engine": bench_engine, "engine_compiled": bench_engine_compiled,
         "engine_compiled_torch": bench_engine_compiled_torch, "generate": bench_generate,
         "engine_profile": bench_engine_profile}
OPT_IN = {"engine_profile"}
"""Parts that run only when asked for (``--profile``)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256, help="engine parts: requests submitted at once; "
                        "GRPO runs: samples per rollout (groups of 8)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs after the warm-up (best is reported)")
    parser.add_argument("--rollouts", type=int, default=20, help="GRPO runs: rollouts per run (20 or more turns the "
                        "machine-default compilation on)")
    parser.add_argument("--warmup-rollouts", type=int, default=3, help="GRPO runs: first rollouts left out of medians")
    parser.add_argument("--runs", nargs="*", default=["fsdp-default", "fsdp-best"], choices=sorted(RUNS),
                        help="GRPO runs, side by side")
    parser.add_argument("--stop", default=None, help="engine parts: a stop string on every request (one that never "
                                                     "occurs times the decoded-text checks without ending requests)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H200: 989)")
    parser.add_argument("--skip", nargs="*", default=[], choices=[*PARTS, "grpo"],
                        help="parts not to run (all run by default except engine_profile, which --profile adds)")
    parser.add_argument("--profile", action="store_true", help="also profile one compiled engine run "
                        "(part engine_profile: GPU-busy share and top kernels)")
    parser.add_argument("--profile-top", type=int, default=15, help="engine_profile: kernels listed")
    parser.add_argument("--trace", type=Path, default=None, help="engine_profile: also write the run's "
                        "chrome trace (kernels in order, with their CUDA graph) to this path")
    parser.add_argument("--train-flags", nargs=argparse.REMAINDER, default=[],
                        help="extra furlong train flags for every GRPO run (last on the line)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this file (after "
                        "each part, so a run cut short keeps the parts that finished)")
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.part:  # a child process of the run below
        print_part(PARTS[opts.part](opts.model_dir, opts))
        return 0
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA GPU.")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "options": vars(opts) | {"json": None}}
    import transformers

    result["transformers"] = transformers.__version__
    tmp = tempfile.mkdtemp(prefix="bench_gpu_")
    try:
        folder = build_model(Path(tmp) / "model")
        for name in PARTS:
            if name not in opts.skip and (name not in OPT_IN or opts.profile):
                result[name] = _part_in_subprocess(name, folder, opts)
                print(name, json.dumps(result[name]), flush=True)
                save_json(opts.json, result)
        if "grpo" not in opts.skip:
            result["grpo"] = {}
            for name in opts.runs:
                (Path(tmp) / name).mkdir()
                flags = [*RUNS[name].split(), *opts.train_flags]
                command = "train-async" if name.endswith("-async") else "train"
                result["grpo"][name] = bench_grpo(folder, opts, Path(tmp) / name, flags, command)
                print("grpo", name, json.dumps(result["grpo"][name]), flush=True)
                save_json(opts.json, result)
    finally:
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)
    if "tok_per_s" in result.get("engine", {}) and "tok_per_s" in result.get("generate", {}):
        result["engine_over_generate"] = result["engine"]["tok_per_s"] / result["generate"]["tok_per_s"]
    print(json.dumps({k: v for k, v in result.items() if k != "options"}, indent=1))
    save_json(opts.json, result)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
