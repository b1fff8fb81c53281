"""The megatron backend on one GPU at the Qwen2.5-0.5B shape (random weights): bf16 log-probs
against Hugging Face, and training throughput as model FLOPs utilisation.

    python benchmarks/megatron_gpu.py --out results.json            # every part
    python benchmarks/megatron_gpu.py --part mfu --micro-batch 8    # one part

The model is built with ``transformers`` from a Qwen2 config of Qwen2.5-0.5B's shape (24
layers, hidden 896, 14 heads, 2 KV groups, ffn 4864, vocab 151936, tied embeddings), with
the library's random initialisation, and written to a temporary directory; the backend
loads it like any ``--hf-checkpoint``. See docs/megatron.md for the recorded figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_gpu  # noqa: E402

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
H200_BF16_DENSE_TFLOPS = 989.0


def write_model(path: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B))
    model.save_pretrained(path)


def backend_for(path: str, micro_batch: int, steps_of: int, *extra: str, bf16: bool = True):
    from furlong.builtin_plugins.backends.megatron import train_backend
    from furlong.core.config.launch_args import launch_config

    config = launch_config("--hf-checkpoint", path, "--train-backend", "megatron", "--num-rollout", "100",
                           "--rollout-batch-size", str(steps_of), "--n-samples-per-prompt", "1", "--global-batch-size",
                           str(steps_of), "--micro-batch-size", str(micro_batch), "--lr", "1e-6", *extra,
                           configure=False, bf16=bf16)  # --bf16 defaults to on with CUDA
    backend = train_backend(config=config)
    asyncio.run(backend.init(config))
    return backend


def save_out(path: str | None, result: dict) -> None:
    """Write ``result`` to ``path`` (``--out``; nothing when None): called after every part, so that a run cut
    short (a time limit, a crash) keeps the figures of the parts that finished."""
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(result, indent=2, default=str))


def guarded(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or ``{"error": the end of its traceback}`` when it raises (out of memory, a kernel
    that does not run here): the failure is recorded and the next part still runs. Frees what the failed part held
    (megatron-core's wrappers hold reference cycles, so a collection is needed before the cache is emptied)."""
    import gc
    import traceback

    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - recorded in the result
        error = {"error": traceback.format_exc()[-3000:]}
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(json.dumps(error), flush=True)
    return error


class MeanLogProb:
    """Objective of the throughput run: minus the mean response log-prob over the step's samples."""

    def __init__(self, n: int):
        self.n = n

    async def __call__(self, sample_ids, log_probs, entropy, values=None):
        loss = sum(-lp.mean() for lp in log_probs) / self.n
        return loss, {"loss": float(loss.detach())}


def batch_of(n: int, length: int, prompt: int, micro_batch: int, seed: int):
    from furlong.hooks import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, QWEN25_05B["vocab_size"], (length,), generator=g).tolist() for _ in range(n)]
    steps = [[list(range(i, min(i + micro_batch, n))) for i in range(0, n, micro_batch)]]
    batch = TrainBatch(tokens=tokens, response_lengths=[length - prompt] * n,
                       loss_masks=[torch.ones(length - prompt) for _ in range(n)], steps=steps, temperature=1.0)
    batch.objective = MeanLogProb(n)
    return batch


def hf_log_probs(path: str, dtype, batch) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").cuda().eval()
    out = []
    with torch.no_grad():
        for tokens, t in zip(batch.tokens, batch.response_lengths):
            ids = torch.tensor([tokens], device="cuda")
            logp = torch.log_softmax(model(ids).logits[0, -t - 1:-1].float(), dim=-1)
            out.append(logp.gather(-1, ids[0, -t:, None]).squeeze(-1).cpu())
    del model
    torch.cuda.empty_cache()
    return out


def part_logprobs(path: str) -> dict:
    """Megatron (bf16 parameters; and fp32) and HF bf16 log-probs against HF fp32, on 4 random sequences of 512 tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    batch = batch_of(4, 512, 16, 4, seed=1)
    ref = hf_log_probs(path, torch.float32, batch)
    hf_bf16 = hf_log_probs(path, torch.bfloat16, batch)
    backend = backend_for(path, 4, 4)
    mine = asyncio.run(backend.log_probs(batch))["log_probs"]
    del backend
    backend = backend_for(path, 4, 4, bf16=False)
    mine_fp32 = asyncio.run(backend.log_probs(batch))["log_probs"]
    del backend
    torch.cuda.empty_cache()

    def gap(a, b):
        d = torch.cat([(x - y).abs() for x, y in zip(a, b)])
        return {"max": float(d.max()), "mean": float(d.mean())}

    return {"megatron_bf16_vs_hf_fp32": gap(mine, ref), "hf_bf16_vs_hf_fp32": gap(hf_bf16, ref),
            "megatron_bf16_vs_hf_bf16": gap(mine, hf_bf16), "megatron_fp32_vs_hf_fp32": gap(mine_fp32, ref),
            "mean_log_prob_hf_fp32": float(torch.cat(ref).mean()), "tokens": sum(batch.response_lengths)}


def model_flops_per_token(backend, seq: int) -> float:
    """6 N per token for the matmuls (N counts the tied embedding once, as the output layer) plus
    causal attention ``6 L s (heads x head_dim)`` per token (QK^T and AV, half of the square)."""
    n = sum(p.numel() for p in backend.model.parameters())
    s = backend.shape
    return 6.0 * n + 6.0 * s.num_layers * seq * s.num_attention_heads * s.kv_channels


def part_mfu(path: str, micro_batch: int, samples: int, seq: int, steps: int, profile: bool = False,
             flags: tuple = ()) -> dict:
    """Optimizer steps of ``samples`` x ``seq`` tokens (micro-batches of ``micro_batch``): time, tokens/s, MFU.
    ``flags``: more launch flags (``--train-torch-compile``)."""
    backend = backend_for(path, micro_batch, samples, *flags)
    batch = batch_of(samples, seq, 1, micro_batch, seed=2)
    times = []
    for _ in range(steps + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        asyncio.run(backend.train(0, batch))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step = sorted(times[2:])[len(times[2:]) // 2]
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            asyncio.run(backend.train(0, batch))
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
        print("profile:", json.dumps(bench_gpu.kernel_summary(prof, wall, 25)), flush=True)
    tokens = samples * seq
    flops = model_flops_per_token(backend, seq) * tokens
    torch.cuda.synchronize()
    start = time.perf_counter()
    asyncio.run(backend.log_probs(batch))
    torch.cuda.synchronize()
    forward = time.perf_counter() - start
    return {"micro_batch": micro_batch, "samples": samples, "seq": seq, "step_s": step, "all_steps_s": times,
            "tokens_per_s": tokens / step, "model_tflops_per_s": flops / step / 1e12,
            "mfu": flops / step / 1e12 / H200_BF16_DENSE_TFLOPS, "log_probs_s": forward,
            "params": sum(p.numel() for p in backend.model.parameters()),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def part_recompute(path: str, micro_batch: int, seq: int) -> dict:
    """One step with and without ``--recompute-granularity full``: grad norm, time and peak memory."""
    out = {}
    for name, extra in (("none", ()), ("full", ("--recompute-granularity", "full", "--recompute-method", "uniform",
                                                "--recompute-num-layers", "1"))):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        backend = backend_for(path, micro_batch, micro_batch, *extra)
        batch = batch_of(micro_batch, seq, 1, micro_batch, seed=3)
        asyncio.run(backend.train(0, batch))  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = asyncio.run(backend.train(0, batch))[0]
        torch.cuda.synchronize()
        out[name] = {"grad_norm": metrics["grad_norm"], "step_s": time.perf_counter() - start,
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        del backend
    return out


def part_kernels(rows: int = 16384, vocab: int = 151936) -> dict:
    """The vocab-parallel log-prob Function on ``[rows, vocab]`` bfloat16 logits, compiled (CUDA's
    default: the rows dynamic, the width fixed) against the same functions compiled with every
    dimension dynamic and run eagerly: the largest differences and the times of forward + backward."""
    from furlong.builtin_plugins.backends.megatron import logprobs
    from furlong.builtin_plugins.backends.megatron.model import init_parallel
    from furlong.kit import vocab_softmax

    init_parallel(1, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(5)
    logits = (3 * torch.randn(rows, vocab, generator=g, device="cuda")).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), generator=g, device="cuda")
    weights = torch.randn(2, rows, generator=g, device="cuda")
    all_dynamic: dict = {}

    def every_dimension_dynamic(fn, device):
        return all_dynamic.setdefault(fn, torch.compile(fn, dynamic=True))

    out = {}
    for name, kernel in (("compiled", vocab_softmax.fused), ("all_dynamic", every_dimension_dynamic),
                         ("eager", lambda fn, device: fn)):
        original, vocab_softmax.fused = vocab_softmax.fused, kernel
        try:
            times = []
            for _ in range(4):
                x = logits.detach().requires_grad_(True)
                torch.cuda.synchronize()
                start = time.perf_counter()
                lp, ent = logprobs.vocab_parallel_log_probs(x, targets, 0.8, vocab)
                ((weights[0] * lp).sum() + (weights[1] * ent).sum()).backward()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            out[name] = {"s": min(times[1:]), "lp": lp.detach(), "ent": ent.detach(), "grad": x.grad.float()}
        finally:
            vocab_softmax.fused = original
    a, b = out["compiled"], out["eager"]
    return {"rows": rows, "vocab": vocab, "compiled_s": a["s"], "all_dynamic_s": out["all_dynamic"]["s"],
            "eager_s": b["s"], "max_diff": {k: float((a[k] - b[k]).abs().max()) for k in ("lp", "ent", "grad")}}


def part_packed_attention(samples: int = 256, seed: int = 6) -> dict:
    """Packed (thd) attention of ``samples`` sequences of 128-384 tokens at the 0.5B head shape:
    one ``varlen_attn`` call (CUDA, bf16) against one SDPA call per sequence; output difference and times."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from furlong.builtin_plugins.backends.megatron.attention import SDPACoreAttention
    from furlong.builtin_plugins.backends.megatron.config import model_shape
    from furlong.builtin_plugins.backends.megatron.model import transformer_config
    from transformers import Qwen2Config

    shape = model_shape(Qwen2Config(**QWEN25_05B))
    attention = SDPACoreAttention(transformer_config(shape, 1, torch.bfloat16, torch.device("cuda")))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(128, 385, (samples,), generator=g).tolist()
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    t, heads, groups, d = sum(lengths), shape.num_attention_heads, shape.num_query_groups, shape.kv_channels
    q = torch.randn(t, heads, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(t, groups, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def loop():
        cuts = bounds.tolist()
        return torch.cat([attention._causal(q[a:b, None], k[a:b, None], v[a:b, None])
                          for a, b in zip(cuts[:-1], cuts[1:])]).squeeze(1)

    def timed(fn):
        out, best = None, float("inf")
        for _ in range(4):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return out, best

    (packed, packed_s), (looped, loop_s) = timed(lambda: attention(q, k, v, packed_seq_params=params)), timed(loop)
    return {"tokens": t, "varlen_s": packed_s, "loop_s": loop_s,
            "max_diff": float((packed.float() - looped.float()).abs().max())}


def _forward_backward_s(fn, x, grad, params=(), repeats: int = 20):
    """Seconds per forward + backward of ``fn(x)`` with ``grad``, over ``repeats`` calls queued between two
    synchronisations (after a warm-up), and the output and gradients of the last call."""
    for timed in (False, True):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats if timed else 2):
            leaf = x.detach().requires_grad_(True)
            for p in params:
                p.grad = None
            out = fn(leaf)
            out.backward(grad)
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    return seconds, (out.detach().float(), leaf.grad.float(), *(p.grad.float() for p in params))


def part_layers(rows: int = 49152) -> dict:
    """furlong's Triton SwiGLU and RMSNorm (``layers.py``) against megatron-core's compiled SwiGLU and
    torch's RMSNorm on ``rows`` bfloat16 tokens at the 0.5B shape (ffn 4864, hidden 896): forward +
    backward times, and each one's largest difference from a float32 computation of the same input."""
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    from furlong.builtin_plugins.backends.megatron.layers import FusedRMSNorm, FusedSwiGLU

    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(rows, 2 * 4864, generator=g, device="cuda").to(torch.bfloat16)
    grad = torch.randn(rows, 4864, generator=g, device="cuda").to(torch.bfloat16)

    def swiglu_fp32(t):
        a, b = t.float().chunk(2, -1)
        return F.silu(a) * b

    out = {"rows": rows}
    _, exact = _forward_backward_s(swiglu_fp32, x.float(), grad.float())
    for name, fn in (("swiglu_furlong", FusedSwiGLU()), ("swiglu_megatron", lambda t: bias_swiglu_impl(t, None))):
        seconds, got = _forward_backward_s(fn, x, grad)
        out[name] = {"s": seconds, "max_diff": [float((a - b).abs().max()) for a, b in zip(got, exact)]}

    class Config:
        normalization = "RMSNorm"

    h = 896
    x = (3 * torch.randn(rows, h, generator=g, device="cuda")).to(torch.bfloat16)
    grad = torch.randn(rows, h, generator=g, device="cuda").to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(h, generator=g, device="cuda")).to(torch.bfloat16)
    fused = FusedRMSNorm(Config(), h, eps=1e-6).cuda().to(torch.bfloat16)
    plain = torch.nn.RMSNorm(h, eps=1e-6).cuda().to(torch.bfloat16)
    fp32 = torch.nn.RMSNorm(h, eps=1e-6).cuda()
    for module in (fused, plain, fp32):
        module.weight.data.copy_(weight)
    _, exact = _forward_backward_s(fp32, x.float(), grad.float(), (fp32.weight,))
    for name, module in (("rms_norm_furlong", fused), ("rms_norm_torch", plain)):
        seconds, got = _forward_backward_s(module, x, grad, (module.weight,))
        out[name] = {"s": seconds, "max_diff": [float((a - b).abs().max()) for a, b in zip(got, exact)]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "logprobs", "kernels", "layers", "mfu", "recompute"], default="all")
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one step (mfu part)")
    parser.add_argument("--train-flags", nargs=argparse.REMAINDER, default=[],
                        help="more launch flags for the backend of the mfu part, e.g. --train-torch-compile")
    ns = parser.parse_args()
    result: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    import megatron.core
    import transformers

    result.update(megatron_core=megatron.core.__version__, transformers=transformers.__version__)
    with tempfile.TemporaryDirectory() as path:
        write_model(path)
        if ns.part in ("all", "logprobs"):
            result["logprobs"] = part_logprobs(path)
            print(json.dumps(result["logprobs"]), flush=True)
        if ns.part in ("all", "kernels"):
            result["kernels"] = part_kernels() | {"packed_attention": part_packed_attention()}
            print(json.dumps(result["kernels"]), flush=True)
        if ns.part in ("all", "layers"):
            result["layers"] = part_layers()
            print(json.dumps(result["layers"]), flush=True)
        if ns.part == "recompute":
            result["recompute"] = part_recompute(path, ns.micro_batch[0], ns.seq)
            print(json.dumps(result["recompute"]), flush=True)
        if ns.part in ("all", "mfu"):
            torch.backends.cuda.matmul.allow_tf32 = True
            result["mfu"] = []
            for mb in ns.micro_batch:
                torch.cuda.reset_peak_memory_stats()
                result["mfu"].append(part_mfu(path, mb, ns.samples, ns.seq, ns.steps, ns.profile, tuple(ns.train_flags)))
                print(json.dumps(result["mfu"][-1]), flush=True)
    text = json.dumps(result, indent=2)
    print(text)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
