"""The megatron backend on one GPU at a small Qwen3-MoE shape (random weights, EP=1): bf16 log-probs against
Hugging Face, and training throughput as model FLOPs utilisation of the active parameters.

    python benchmarks/megatron_moe_gpu.py --out moe.json                    # both parts
    python benchmarks/megatron_moe_gpu.py --part mfu --micro-batch 4 8      # one part
    python benchmarks/megatron_moe_gpu.py --part mfu --train-flags --moe-aux-loss-coeff 1e-3

The model is Qwen3-30B-A3B's layer (hidden 2048, 32 heads of 128, 4 KV groups, experts of 768, top 8,
untied vocabulary of 151936) with fewer layers and experts (``--layers`` 8, ``--experts`` 64 by default),
made by ``transformers`` (``Qwen3MoeForCausalLM``, its random initialisation) and written to a temporary
directory; the backend loads it like any ``--hf-checkpoint`` (megatron-core's MoE layers, ``SequentialMLP``
experts, the all-to-all dispatcher). MFU counts ``6 x`` the parameters a token uses (attention, router, its
top-k experts, output layer: not the embedding lookup nor the other experts) plus causal attention.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import torch

from megatron_gpu import H200_BF16_DENSE_TFLOPS, backend_for, batch_of, guarded, part_logprobs, save_out

QWEN3_MOE_SMALL = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                       num_key_value_heads=4, head_dim=128, num_experts_per_tok=8, norm_topk_prob=True,
                       vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])


def write_model(path: str, layers: int, experts: int) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**QWEN3_MOE_SMALL, num_hidden_layers=layers, num_experts=experts)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def active_flops_per_token(backend, seq: int) -> float:
    """``6 x`` the parameters one token runs through (every parameter but the embedding table of an untied model
    and the ``E - k`` experts it is not routed to, per MoE layer) plus causal attention ``6 L s (heads x d)``."""
    s = backend.shape
    total = sum(p.numel() for p in backend.model.parameters())
    embedding = 0 if s.tied else backend.model.embedding.word_embeddings.weight.numel()
    per_expert = 3 * s.hidden_size * s.moe_ffn_hidden_size
    idle = (s.num_experts - s.moe_topk) * per_expert * len(s.moe_layers)
    return 6.0 * (total - embedding - idle) + 6.0 * s.num_layers * seq * s.num_attention_heads * s.kv_channels


def part_mfu(path: str, micro_batch: int, samples: int, seq: int, steps: int, flags: tuple = ()) -> dict:
    """Optimizer steps of ``samples`` x ``seq`` tokens (micro-batches of ``micro_batch``): time, tokens/s, MFU."""
    backend = backend_for(path, micro_batch, samples, *flags)
    batch = batch_of(samples, seq, 1, micro_batch, seed=2)
    times, metrics = [], {}
    for _ in range(steps + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = asyncio.run(backend.train(0, batch))[0]
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step = sorted(times[2:])[len(times[2:]) // 2]
    tokens = samples * seq
    flops = active_flops_per_token(backend, seq) * tokens
    return {"micro_batch": micro_batch, "samples": samples, "seq": seq, "step_s": step, "all_steps_s": times,
            "tokens_per_s": tokens / step, "model_tflops_per_s": flops / step / 1e12,
            "mfu": flops / step / 1e12 / H200_BF16_DENSE_TFLOPS,
            "params": sum(p.numel() for p in backend.model.parameters()),
            "active_flops_per_token": active_flops_per_token(backend, seq), "last_step": metrics,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "logprobs", "mfu"], default="all")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--train-flags", nargs=argparse.REMAINDER, default=[],
                        help="more launch flags for the backend of the mfu part, e.g. --moe-aux-loss-coeff 1e-3")
    ns = parser.parse_args()
    import megatron.core
    import transformers

    result: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                    "megatron_core": megatron.core.__version__, "transformers": transformers.__version__,
                    "shape": {**QWEN3_MOE_SMALL, "num_hidden_layers": ns.layers, "num_experts": ns.experts}}
    with tempfile.TemporaryDirectory() as path:
        write_model(path, ns.layers, ns.experts)
        if ns.part in ("all", "logprobs"):
            result["logprobs"] = guarded(part_logprobs, path)
            print(json.dumps(result["logprobs"]), flush=True)
            save_out(ns.out, result)
        if ns.part in ("all", "mfu"):
            torch.backends.cuda.matmul.allow_tf32 = True
            result["mfu"] = []
            for mb in ns.micro_batch:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                result["mfu"].append(guarded(part_mfu, path, mb, ns.samples, ns.seq, ns.steps, tuple(ns.train_flags)))
                print(json.dumps(result["mfu"][-1]), flush=True)
                save_out(ns.out, result)
    print(json.dumps(result, indent=2))
    save_out(ns.out, result)


if __name__ == "__main__":
    main()
