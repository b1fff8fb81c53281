"""GLM-4 and LoRA on the megatron backend on one GPU: log-probs against transformers, and a LoRA step.

    python benchmarks/megatron_families_gpu.py --out glm4_lora.json              # on a GPU
    python benchmarks/megatron_families_gpu.py --device cpu --small --out x.json  # a CPU smoke run

The model is a GLM-4 (``Glm4ForCausalLM``) built by transformers from a config of GLM-4-9B's layer
layout (head_dim 128, RoPE on half of each head, interleaved; q/k/v bias; the four norms per layer) with
8 layers and hidden 2048 (``--small``: 2 layers, hidden 256), random weights, written to a temporary
directory and loaded by the backend like any ``--hf-checkpoint``. Parts:

- ``logprobs``: float32 (TF32 off) and bfloat16 megatron log-probs against transformers' float32 and
  bfloat16 ones on 4 random sequences of 512 tokens (GPU: the Triton RMSNorm of the post-sublayer norms
  and the compiled interleaved partial RoPE run here, not on CPU);
- ``lora``: LoRA rank 16 on all linears, bfloat16: the optimizer's parameters (adapters only), the time of
  an optimizer step of 8 x 512 tokens (median of 5 after 2) against the same step without LoRA, and the
  merged weights' difference from ``W + (alpha / r) B A``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_gpu  # noqa: E402  (the sibling benchmark's backend and objective)

GLM4 = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=2, head_dim=128, vocab_size=151552, max_position_embeddings=32768,
            rms_norm_eps=1.5625e-07, attention_bias=True, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
SMALL = dict(GLM4, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, head_dim=64,
             vocab_size=1024, pad_token_id=0)


def write_model(path: str, shape: dict) -> None:
    from transformers import Glm4Config, Glm4ForCausalLM

    torch.manual_seed(0)
    Glm4ForCausalLM(Glm4Config(**shape)).save_pretrained(path)


def backend_for(path: str, n: int, bf16: bool, *extra: str):
    """megatron_gpu's backend for ``n`` samples a step in micro-batches of 4, at lr 1e-4."""
    return megatron_gpu.backend_for(path, min(n, 4), n, "--lr", "1e-4", *extra, bf16=bf16)


def batch_of(n: int, length: int, vocab: int, seed: int):
    from furlong.hooks import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]
    prompt = 16
    batch = TrainBatch(tokens=tokens, response_lengths=[length - prompt] * n,
                       loss_masks=[torch.ones(length - prompt) for _ in range(n)],
                       steps=[[list(range(i, min(i + 4, n))) for i in range(0, n, 4)]], temperature=1.0)
    batch.objective = megatron_gpu.MeanLogProb(n)
    return batch


def hf_log_probs(path: str, dtype, batch, device) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(device).eval()
    out = []
    with torch.no_grad():
        for tokens, t in zip(batch.tokens, batch.response_lengths):
            ids = torch.tensor([tokens], device=device)
            logp = torch.log_softmax(model(ids).logits[0, -t - 1:-1].float(), dim=-1)
            out.append(logp.gather(-1, ids[0, -t:, None]).squeeze(-1).cpu())
    return out


def gap(a, b) -> dict:
    d = torch.cat([(x.cpu() - y.cpu()).abs() for x, y in zip(a, b)])
    return {"max": float(d.max()), "mean": float(d.mean())}


def part_logprobs(path: str, vocab: int, device, length: int) -> dict:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    batch = batch_of(4, length, vocab, seed=1)
    ref = hf_log_probs(path, torch.float32, batch, device)
    hf_bf16 = hf_log_probs(path, torch.bfloat16, batch, device)
    fp32 = asyncio.run(backend_for(path, 4, False).log_probs(batch))["log_probs"]
    bf16 = asyncio.run(backend_for(path, 4, True).log_probs(batch))["log_probs"]
    return {"megatron_fp32_vs_hf_fp32": gap(fp32, ref), "megatron_bf16_vs_hf_fp32": gap(bf16, ref),
            "hf_bf16_vs_hf_fp32": gap(hf_bf16, ref), "megatron_bf16_vs_hf_bf16": gap(bf16, hf_bf16)}


def step_time(backend, batch, device, steps: int = 5) -> float:
    times = []
    for _ in range(steps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        asyncio.run(backend.train(0, batch))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[2:])[len(times[2:]) // 2]


def part_lora(path: str, vocab: int, device, length: int, bf16: bool) -> dict:
    batch = batch_of(8, length, vocab, seed=2)
    full = backend_for(path, 8, bf16)
    full_time = step_time(full, batch, device)
    full_params = sum(p.numel() for g in full.optimizer.param_groups for p in g["params"])
    del full
    lora = backend_for(path, 8, bf16, "--lora-rank", "16", "--lora-alpha", "32")
    base = {k: v.float().clone() for k, v in asyncio.run(lora.named_weights())}
    lora_time = step_time(lora, batch, device)
    names = {id(p): n for n, p in lora.model.named_parameters()}
    trained = [names.get(id(p), "master") for g in lora.optimizer.param_groups for p in g["params"]]
    merged = dict(asyncio.run(lora.named_weights()))
    qkv = lora.model.decoder.layers[0].self_attention.linear_qkv
    delta = (qkv.lora_B.weight.float() @ qkv.lora_A.weight.float()) * qkv.lora_scaling
    n, g, d = lora.shape.num_attention_heads, lora.shape.num_query_groups, lora.shape.kv_channels
    q_rows = delta.view(g, n // g + 2, d, -1)[:, : n // g].reshape(n * d, -1).cpu()
    q_name = "model.layers.0.self_attn.q_proj.weight"
    return {"full_step_s": full_time, "lora_step_s": lora_time, "full_trained_elements": full_params,
            "lora_trained_elements": sum(p.numel() for g in lora.optimizer.param_groups for p in g["params"]),
            "lora_trained_are_adapters": all(".lora_" in t for t in trained if t != "master"),
            "q_proj_merged_minus_base_plus_delta_max": float(
                (merged[q_name].float().cpu() - (base[q_name].cpu() + q_rows)).abs().max()),
            "q_proj_delta_max": float(q_rows.abs().max()), "tokens_per_step": 8 * length}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--part", choices=["logprobs", "lora", "all"], default="all")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="2 layers, hidden 256 (a smoke run)")
    opts = parser.parse_args()
    device = torch.device(opts.device)
    shape = SMALL if opts.small else GLM4
    length = 64 if opts.small else 512
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "shape": shape,
               "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as path:
        write_model(path, shape)
        if opts.part in ("logprobs", "all"):
            results["logprobs"] = megatron_gpu.guarded(part_logprobs, path, shape["vocab_size"], device, length)
            megatron_gpu.save_out(opts.out, results)
        if opts.part in ("lora", "all"):
            results["lora"] = megatron_gpu.guarded(part_lora, path, shape["vocab_size"], device, length,
                                                   bf16=device.type == "cuda")
    megatron_gpu.save_out(opts.out, results)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
