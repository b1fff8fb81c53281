"""The fsdp backend's training math alone on one GPU: forward, backward and AdamW over a GRPO batch.

One command on a CUDA machine, from the repository root::

    python benchmarks/bench_fsdp_step.py --variants autocast:8192 bf16:8192:compile bf16:16384:compile

Each variant is ``PRECISION:TOKENS[:compile]``: ``autocast`` (float32 weights under bfloat16 autocast)
or ``bf16`` (bfloat16 parameters over float32 master weights, as ``--bf16`` in one process);
micro-batches of ``TOKENS // 384`` samples; ``compile`` compiles the decoder layers as
``--train-torch-compile`` does. The batch is that of ``bench_gpu.py``'s GRPO iteration (256
samples of 128 prompt + 256 response tokens, random ids, random advantages) and the model its
Qwen2.5-0.5B-shaped one; a step is every micro-batch's :func:`forward_log_probs` (split output
projection, vocabulary chunks), a policy-gradient loss, backward, gradient clipping and fused
AdamW. The gap between this step and ``bench_gpu.py``'s train time is the cost of furlong's loop
around it (objective, metrics, host work).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_gpu  # noqa: E402

from furlong.builtin_plugins.backends.fsdp.logprobs import forward_log_probs  # noqa: E402
from furlong.hooks.hf import compile_decoder_layers  # noqa: E402
from furlong.hooks.master_weights import MasterWeights  # noqa: E402

SAMPLES, PROMPT, RESPONSE = 256, 128, 256


def step_time(folder: Path, precision: str, tokens: int, compiled: bool, steps: int, peak_tflops: float) -> dict:
    from transformers import AutoModelForCausalLM

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(3, 151000, (SAMPLES, PROMPT + RESPONSE), generator=gen)
    advantages = torch.randn(SAMPLES, generator=gen).cuda()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").cuda().eval()
    model.config.use_cache = False
    masters = None
    if precision == "bf16":
        master_params = dict(model.named_parameters())
        compute = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        compute = compute.cuda().eval()
        compute.load_state_dict(model.state_dict())
        for p in compute.parameters():
            p.data = p.data.to(torch.bfloat16)
        masters = MasterWeights(compute, masters=master_params)
        run_model, autocast = compute, None
    else:
        run_model, autocast = model, torch.autocast("cuda", dtype=torch.bfloat16)
    if compiled:
        torch._dynamo.reset()
        compile_decoder_layers(run_model, "--train-torch-compile", dynamic=True)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
    per = max(1, tokens // (PROMPT + RESPONSE))
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for a in range(0, SAMPLES, per):
            ids = list(range(a, min(SAMPLES, a + per)))
            lp, _ = forward_log_probs(run_model, [seqs[i] for i in ids], [RESPONSE] * len(ids), 1.0,
                                      torch.device("cuda"), grad=True, entropy_grad=False, autocast=autocast,
                                      share_prompts=False)
            loss = sum(-(x * advantages[i]).sum() for i, x in zip(ids, lp)) / (SAMPLES * RESPONSE)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        if masters is not None:
            masters.copy_to_model()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    best = min(times[2:] if compiled else times[1:])
    n_params = sum(p.numel() for p in model.parameters())
    return {"variant": f"{precision}:{tokens}{':compile' if compiled else ''}", "step_s": best,
            "times_s": [round(t, 3) for t in times],
            "mfu": 6 * n_params * SAMPLES * (PROMPT + RESPONSE) / best / (peak_tflops * 1e12),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["autocast:8192", "bf16:8192", "bf16:8192:compile",
                                                          "bf16:16384:compile"])
    parser.add_argument("--steps", type=int, default=4, help="steps per variant (the first, two when compiled, "
                                                             "are warm-up)")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_fsdp_step_") as tmp:
        folder = bench_gpu.build_model(Path(tmp))
        for variant in opts.variants:
            precision, tokens, *rest = variant.split(":")
            r = step_time(folder, precision, int(tokens), rest == ["compile"], opts.steps, opts.peak_tflops)
            print(f"{r['variant']:>20}: step {r['step_s']:.3f} s {r['times_s']}, MFU {100 * r['mfu']:.1f} %, "
                  f"peak {r['peak_memory_gib']:.1f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
