"""The fsdp backend's training math alone on one GPU: forward, backward and AdamW over a GRPO batch.

One command on a CUDA machine, from the repository root::

    python benchmarks/bench_fsdp_step.py --variants autocast:8192 bf16:8192:compile bf16:16384:compile

Each variant is ``PRECISION:TOKENS[:OPTION...]``: ``autocast`` (float32 weights under bfloat16
autocast) or ``bf16`` (bfloat16 parameters over float32 master weights, as ``--bf16`` in one
process); micro-batches of at most ``TOKENS`` tokens; options: ``compile`` compiles the decoder
layers as ``--train-torch-compile`` does, ``pack`` packs each micro-batch into one row (the
backend's default on CUDA, :mod:`furlong.builtin_plugins.backends.fsdp.packing`; without it
micro-batches are right-padded), ``ckpt`` projects the output through activation checkpointing
of ``log_softmax`` instead of the fused projection (:mod:`.head_log_probs`), ``share`` lets the
samples of a group run their prompt once (prompt sharing, as the backend does by default; with
``pack``, :func:`furlong.builtin_plugins.backends.fsdp.packing.pack_shared`). ``--mixed`` draws
response lengths uniformly from 32..256 (micro-batches then mix lengths; MFU counts real
tokens, as the formula does: every sample's prompt and response). The batch is that of
``bench_gpu.py``'s GRPO iteration (256 samples of 128 prompt + 256 response tokens, groups of 8
samples sharing a prompt, random ids, random advantages) and the model its Qwen2.5-0.5B-shaped one;
a step is every micro-batch's :func:`forward_log_probs` (split output projection, vocabulary
chunks), a policy-gradient loss, backward, gradient clipping and fused AdamW. ``--check``
first compares packed, padded and shared log-probs (:func:`check_packing`). The gap between this step
and ``bench_gpu.py``'s train time is the cost of furlong's loop around it (objective,
metrics, host work).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_gpu  # noqa: E402

from furlong.builtin_plugins.backends.fsdp import head_log_probs, packing  # noqa: E402
from furlong.builtin_plugins.backends.fsdp.logprobs import forward_log_probs  # noqa: E402
from furlong.kit.hf import compile_decoder_layers  # noqa: E402
from furlong.kit.master_weights import MasterWeights  # noqa: E402

SAMPLES, PROMPT, RESPONSE, GROUP = 256, 128, 256, 8


def step_time(folder: Path, precision: str, tokens: int, options: set, steps: int, peak_tflops: float,
              mixed: bool = False, profile: bool = False, trace: Path | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(0)
    responses = (torch.randint(32, RESPONSE + 1, (SAMPLES,), generator=gen) if mixed
                 else torch.full((SAMPLES,), RESPONSE)).tolist()
    seqs = grouped_sequences(responses, gen)
    compiled = "compile" in options
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
    if "pack" in options:
        assert packing.use_packed_attention(run_model) is None
    if compiled:
        torch._dynamo.reset()
        compile_decoder_layers(run_model, "--train-torch-compile", dynamic=True)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
    micro = [[]]  # consecutive samples up to `tokens` tokens (padded: rows x longest)
    for i, seq in enumerate(seqs):
        longest = max([len(seq)] + [len(seqs[j]) for j in micro[-1]])
        if micro[-1] and (len(micro[-1]) + 1) * longest > tokens:
            micro.append([])
        micro[-1].append(i)
    fused_head = head_log_probs.takes_fused_head
    if "ckpt" in options:
        head_log_probs.takes_fused_head = lambda head: False

    def step() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for ids in micro:
            lp, _ = forward_log_probs(run_model, [seqs[i] for i in ids], [responses[i] for i in ids], 1.0,
                                      torch.device("cuda"), grad=True, entropy_grad=False, autocast=autocast,
                                      share_prompts="share" in options)
            loss = sum(-(x * advantages[i]).sum() for i, x in zip(ids, lp)) / sum(responses)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        if masters is not None:
            masters.copy_to_model()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    times = [step() for _ in range(steps)]
    profiled = None
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = step()
        if trace:
            prof.export_chrome_trace(str(trace))
        profiled = {"wall_s": wall, **bench_gpu.kernel_summary(prof, wall, 25)}
    head_log_probs.takes_fused_head = fused_head
    best = min(times[2:] if compiled else times[1:])
    n_params = sum(p.numel() for p in model.parameters())
    return {"variant": ":".join([precision, str(tokens), *sorted(options)]), "step_s": best,
            "times_s": [round(t, 3) for t in times], "micro_batches": len(micro),
            "mfu": 6 * n_params * sum(len(s) for s in seqs) / best / (peak_tflops * 1e12),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            **({"profile": profiled} if profiled else {})}


def grouped_sequences(responses: list[int], gen, group: int = GROUP) -> list:
    """Random token ids: a ``PROMPT``-token prompt per ``group`` samples (as GRPO draws them), then each response."""
    prompts = [torch.randint(3, 151000, (PROMPT,), generator=gen) for _ in range(0, len(responses), group)]
    return [torch.cat([prompts[i // group], torch.randint(3, 151000, (r,), generator=gen)])
            for i, r in enumerate(responses)]


def check_packing(folder: Path, samples: int = 24) -> dict:
    """Packed against padded log-probs of ``samples`` sequences of 128 + 16..256 tokens in groups of 8 sharing a
    prompt, and packed with shared prompts against packed: in float32 (packed attention as one SDPA call per
    sequence) and in bfloat16 (one ``varlen_attn`` call), each bfloat16 layout also against float32. Largest and
    mean absolute differences."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    responses = torch.randint(16, RESPONSE + 1, (samples,), generator=gen).tolist()
    seqs = grouped_sequences(responses, gen)

    def values(model, share=False):
        lp, ent = forward_log_probs(model, seqs, responses, 1.0, torch.device("cuda"), grad=False,
                                    entropy_grad=False, share_prompts=share)
        return torch.cat(lp).float(), torch.cat(ent).float()

    def diff(a, b):
        return {"max": float((a - b).abs().max()), "mean": float((a - b).abs().mean())}

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").cuda().eval()
        padded = values(model)
        assert packing.use_packed_attention(model) is None
        packed, shared = values(model), values(model, share=True)
        name = str(dtype).removeprefix("torch.")
        out[name] = {"log_probs": diff(packed[0], padded[0]), "entropy": diff(packed[1], padded[1]),
                     "shared_log_probs": diff(shared[0], packed[0]), "shared_entropy": diff(shared[1], packed[1])}
        if dtype == torch.float32:
            reference = padded[0]
        else:
            out[name] |= {"padded_vs_float32": diff(padded[0], reference),
                          "packed_vs_float32": diff(packed[0], reference),
                          "shared_vs_float32": diff(shared[0], reference)}
        del model
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["autocast:8192", "bf16:8192", "bf16:8192:compile",
                                                          "bf16:16384:compile"])
    parser.add_argument("--steps", type=int, default=4, help="steps per variant (the first, two when compiled, "
                                                             "are warm-up)")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--mixed", action="store_true", help="response lengths uniform in 32..256")
    parser.add_argument("--check", action="store_true", help="compare packed and padded log-probs first")
    parser.add_argument("--profile", action="store_true", help="one more step of each variant under torch.profiler: "
                        "GPU-busy share, kernel seconds by kind, top kernels")
    parser.add_argument("--trace", type=Path, default=None, help="--profile: also write the last variant's chrome "
                        "trace here")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_fsdp_step_") as tmp:
        folder = bench_gpu.build_model(Path(tmp))
        if opts.check:
            print("packed vs padded:", json.dumps(check_packing(folder)), flush=True)
        for variant in opts.variants:
            precision, tokens, *rest = variant.split(":")
            r = step_time(folder, precision, int(tokens), set(rest), opts.steps, opts.peak_tflops, opts.mixed,
                          opts.profile, opts.trace)
            print(f"{r['variant']:>26}: step {r['step_s']:.3f} s {r['times_s']} ({r['micro_batches']} micro-batches), "
                  f"MFU {100 * r['mfu']:.1f} %, "
                  f"peak {r['peak_memory_gib']:.1f} GiB", flush=True)
            if "profile" in r:
                print("profile:", json.dumps(r["profile"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
