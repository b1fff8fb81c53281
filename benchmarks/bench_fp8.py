"""The embedded engine on FP8 checkpoints against BF16, on one GPU (Hopper or later), random weights.

One command, from the repository root, on a machine with a CUDA GPU::

    python benchmarks/bench_fp8.py --json fp8.json     # --shapes, --requests, ...: --help

For each model shape (``--shapes``: ``qwen2.5-0.5b``, Llama architecture at Qwen2.5-0.5B's sizes, and
``qwen3-4b``, Llama architecture at Qwen3-4B's sizes: 36 layers, hidden 2560, MLP 9728, 32 heads of
128, 8 KV heads; Qwen3's q/k norms left out) a BF16 model with random weights and a word-level tokenizer
is written to a temporary folder, and ``furlong quantize-fp8`` makes its FP8 checkpoint. Then, each part
in a process of its own:

1. **kernels**: for the model's linear shapes and M in (1, 16, 256, 4096) rows: the Triton activation
   quantisation against :func:`furlong.kit.fp8.quantize_activation_groups` (e4m3 values and scales, bit
   for bit), each FP8 GEMM (``scaled_mm``, ``triton``) against the float32 reference
   (:func:`furlong.kit.fp8.fp8_linear_reference`: largest error relative to the largest output), and
   the time of one BF16 ``F.linear`` and of each FP8 layer (activation quantisation included), from
   CUDA events over 50 calls.
2. **engine**: ``--requests`` (256) requests of ``--prompt-len`` (128) random tokens, ``--new-tokens``
   (256) new tokens each (``ignore_eos``, temperature 1), all submitted at once, through the embedded
   engine on the BF16 directory and on the FP8 directory with each GEMM (``fp8_scaled_mm``,
   ``fp8_triton``); ``--compile`` adds the runs with ``--embedded-torch-compile``. One warm-up run, then
   the best of ``--repeats``; tok/s = new tokens / wall seconds.
3. **logprobs**: the FP8 engine (``auto`` GEMM) samples ``--kl-requests`` (64) responses; each response
   token's log-prob as the engine reported it is compared with the BF16 model's (transformers, bfloat16:
   what the trainer computes, so the run's rollout/trainer mismatch) and with transformers' own FP8 path
   on the same FP8 directory (``FineGrainedFP8Config``: its FP8 kernels when they load on this machine,
   else its dequantising path, named in the result): mean and largest |difference|, and the KL estimates
   k1 = mean(engine - other) and k3 = mean(exp(other - engine) - 1 - (other - engine)).

Random weights give near-uniform distributions, so the log-prob gaps are a lower bound of a trained
model's. ``--json PATH`` writes every figure.
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

from bench_gpu import (QWEN25_05B, cuda_ms, print_part, prompts, run_part, save_json,  # noqa: E402
                       write_word_tokenizer)

QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=151643,
                eos_token_id=151645)
SHAPES = {"qwen2.5-0.5b": QWEN25_05B, "qwen3-4b": QWEN3_4B}


def build_models(folder: Path, shape: str) -> tuple[Path, Path]:
    """``(bf16 dir, fp8 dir)`` of random weights at ``shape``; the FP8 one made by ``furlong quantize-fp8``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from furlong.kit.fp8_io import quantize_checkpoint

    config = LlamaConfig(**SHAPES[shape], pad_token_id=0, attention_bias=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    bf16, fp8 = folder / "bf16", folder / "fp8"
    model.save_pretrained(bf16)
    del model
    torch.cuda.empty_cache()
    write_word_tokenizer(bf16, config.vocab_size, config.eos_token_id)
    start = time.perf_counter()
    quantize_checkpoint(str(bf16), str(fp8))
    print(f"{shape}: quantize-fp8 took {time.perf_counter() - start:.1f} s", flush=True)
    return bf16, fp8


def _linear_shapes(config: dict) -> list[tuple[str, int, int]]:
    h, i = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    return [("q_proj", heads * d, h), ("k_proj", kv * d, h), ("o_proj", h, heads * d), ("gate_proj", i, h),
            ("down_proj", h, i)]


def part_kernels(bf16: Path, fp8: Path, opts) -> dict:
    import torch

    from furlong.builtin_plugins.engines.embedded import fp8_kernels as K
    from furlong.kit.fp8 import fp8_linear_reference, quantize_activation_groups, quantize_blocks

    config = json.loads((bf16 / "config.json").read_text())
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {"chosen_by_auto": K.choose_gemm("auto", "cuda"), "layers": []}

    for name, n, k in _linear_shapes(config):
        w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
        wq, ws = quantize_blocks(w)
        store = K.weight_scales_for_scaled_mm(ws)
        for m in (1, 16, 256, 4096):
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            row = {"layer": name, "n": n, "k": k, "m": m}
            xq, xs = K.quantize_activations(x)
            tq, ts = quantize_activation_groups(x)
            row["act_quant_bitwise_equal"] = bool(torch.equal(xq.view(torch.uint8), tq.view(torch.uint8))
                                                  and torch.equal(xs, ts))
            ref = fp8_linear_reference(xq, xs, wq, ws)
            scale = ref.abs().max().item() or 1.0
            row["bf16_ms"] = cuda_ms(lambda: torch.nn.functional.linear(x, w))
            for gemm in ("scaled_mm", "triton"):
                try:
                    got = K.fp8_matmul(xq, xs, wq, ws, gemm, torch.float32, store)
                    row[f"{gemm}_rel_error"] = (got - ref).abs().max().item() / scale

                    def layer(gemm=gemm):
                        q, s = K.quantize_activations(x)
                        return K.fp8_matmul(q, s, wq, ws, gemm, torch.bfloat16, store)

                    row[f"{gemm}_ms"] = cuda_ms(layer)
                except Exception as exc:  # noqa: BLE001 - recorded: which kernel does not run here
                    row[f"{gemm}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            out["layers"].append(row)
            print("kernels", json.dumps(row), flush=True)
    return out


def _engine_run(folder: Path, opts, gemm: str, compile: str | None) -> dict:
    import torch

    from furlong.builtin_plugins.engines import embedded

    engine = embedded.load_engine(str(folder), max_batch_size=opts.requests, seed=0, compile=compile, fp8_gemm=gemm)
    batch = prompts(opts.requests, opts.prompt_len)
    params = {"temperature": 1.0, "max_new_tokens": opts.new_tokens, "ignore_eos": True}

    async def run():
        return await asyncio.gather(*[engine.generate(p, dict(params)) for p in batch])

    def timed() -> tuple[float, list]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = asyncio.run(run())
        return time.perf_counter() - start, outs

    warmup, outs = timed()
    times = [timed()[0] for _ in range(opts.repeats)]
    tokens = sum(len(o.output_ids) for o in outs)
    return {"tokens": tokens, "warmup_s": warmup, "times_s": times, "tok_per_s": tokens / min(times),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def part_engine(bf16: Path, fp8: Path, opts) -> dict:
    """One engine run: ``opts.variant`` is ``bf16``, ``fp8_scaled_mm`` or ``fp8_triton``, ``_compiled`` added
    for ``--embedded-torch-compile``."""
    variant = opts.variant
    compile = "inductor" if variant.endswith("_compiled") else None
    base = variant.removesuffix("_compiled")
    folder = bf16 if base == "bf16" else fp8
    gemm = "auto" if base == "bf16" else base.removeprefix("fp8_")
    return _engine_run(folder, opts, gemm, compile)


def part_logprobs(bf16: Path, fp8: Path, opts) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import FineGrainedFP8Config

    from furlong.builtin_plugins.engines import embedded

    engine = embedded.load_engine(str(fp8), max_batch_size=opts.kl_requests, seed=0)
    batch = prompts(opts.kl_requests, opts.prompt_len, seed=2)
    params = {"temperature": 1.0, "max_new_tokens": opts.new_tokens, "ignore_eos": True}

    async def run():
        return await asyncio.gather(*[engine.generate(p, dict(params)) for p in batch])

    outs = asyncio.run(run())
    del engine
    torch.cuda.empty_cache()

    def score(model) -> list[torch.Tensor]:
        got = []
        with torch.no_grad():
            for prompt, out in zip(batch, outs):
                ids = torch.tensor([prompt + out.output_ids], device="cuda")
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
                picked = logp.gather(1, ids[0, 1:, None])[:, 0]
                got.append(picked[len(prompt) - 1:].cpu())
        return got

    engine_lp = [torch.tensor(o.output_log_probs) for o in outs]

    def gap(other: list[torch.Tensor]) -> dict:
        d = torch.cat([o - e for e, o in zip(engine_lp, other)]).double()
        return {"tokens": d.numel(), "mean_abs": d.abs().mean().item(), "max_abs": d.abs().max().item(),
                "k1": (-d).mean().item(), "k3": (d.exp() - 1 - d).mean().item()}

    result = {}
    model = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    result["vs_bf16_model"] = gap(score(model))
    del model
    torch.cuda.empty_cache()
    for label, kwargs in (("vs_transformers_fp8", dict),
                          ("vs_transformers_fp8_dequantized",
                           lambda: {"quantization_config": FineGrainedFP8Config(dequantize=True)})):
        try:  # the config too: an older transformers without its dequantize option is recorded, not fatal
            model = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                         device_map="cuda", **kwargs()).eval()
            kinds = sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__})
            result[label] = {**gap(score(model)), "linear_classes": kinds}
            del model
        except Exception as exc:  # noqa: BLE001 - recorded: e.g. its kernels need a download
            result[label] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        torch.cuda.empty_cache()
    return result


PARTS = {"kernels": part_kernels, "engine": part_engine, "logprobs": part_logprobs}


def _part(name: str, bf16: Path, fp8: Path, opts, variant: str = "") -> dict:
    return run_part(__file__, ["--part", name, "--bf16-dir", str(bf16), "--fp8-dir", str(fp8), "--requests",
                               str(opts.requests), "--prompt-len", str(opts.prompt_len), "--new-tokens",
                               str(opts.new_tokens), "--repeats", str(opts.repeats), "--kl-requests",
                               str(opts.kl_requests), "--variant", variant])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="timed engine runs after the warm-up (best is reported)")
    parser.add_argument("--kl-requests", type=int, default=64, help="responses scored by the log-prob part")
    parser.add_argument("--compile", action="store_true", help="also time the engines with --embedded-torch-compile")
    parser.add_argument("--skip", nargs="*", default=[], choices=list(PARTS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="", help=argparse.SUPPRESS)
    parser.add_argument("--bf16-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--fp8-dir", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.part:  # a child process of the run below
        print_part(PARTS[opts.part](opts.bf16_dir, opts.fp8_dir, opts))
        return 0
    import torch
    import transformers

    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8.py needs a CUDA GPU.")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
              "options": vars(opts) | {"json": None}}
    variants = ["bf16", "fp8_scaled_mm", "fp8_triton"]
    variants += [f"{v}_compiled" for v in variants] if opts.compile else []
    tmp = tempfile.mkdtemp(prefix="bench_fp8_")
    try:
        for shape in opts.shapes:
            bf16, fp8 = build_models(Path(tmp) / shape, shape)
            mine = result[shape] = {}
            if "kernels" not in opts.skip:
                mine["kernels"] = _part("kernels", bf16, fp8, opts)
                save_json(opts.json, result)
            if "engine" not in opts.skip:
                mine["engine"] = {}
                for variant in variants:
                    mine["engine"][variant] = _part("engine", bf16, fp8, opts, variant)
                    print(shape, "engine", variant, json.dumps(mine["engine"][variant]), flush=True)
                    save_json(opts.json, result)
                base = mine["engine"]["bf16"].get("tok_per_s")
                for variant, row in mine["engine"].items():
                    if base and "tok_per_s" in row:
                        row["over_bf16"] = row["tok_per_s"] / base
            if "logprobs" not in opts.skip:
                mine["logprobs"] = _part("logprobs", bf16, fp8, opts)
                print(shape, "logprobs", json.dumps(mine["logprobs"]), flush=True)
                save_json(opts.json, result)
            shutil.rmtree(Path(tmp) / shape, ignore_errors=True)
    finally:
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if k != "options"}, indent=1, default=str))
    save_json(opts.json, result)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
