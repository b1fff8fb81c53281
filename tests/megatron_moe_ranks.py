"""Worker of test_megatron_moe.py's two-rank tests (torchrun, 2 gloo ranks).

Usage: ``torchrun --standalone --nproc_per_node 2 megatron_moe_ranks.py HF_DIR OUT_DIR COEFF LAYOUT``.

Runs the megatron backend on the tiny Qwen3-MoE of HF_DIR with ``--moe-aux-loss-coeff COEFF`` and LAYOUT:

- ``ep``: ``--expert-model-parallel-size 2`` (DP=2, two experts per rank) on the four fixed samples split over
  the two data-parallel ranks (one micro-batch of two each);
- ``tp``: ``--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1`` (DP=1, every
  expert on both ranks, each routing its half of the positions) with ``--use-routing-replay``, on all four
  samples in two micro-batches;
- ``pp``: ``--pipeline-model-parallel-size 2`` (DP=1, one MoE layer per stage) with ``--use-routing-replay``,
  the same micro-batches through megatron-core's pipeline schedule;
- ``cp``: ``--context-parallel-size 2`` (DP=1, each rank two chunks of every sequence) with
  ``--use-routing-replay``.

Then: log-probs, one AdamW step (metrics, the exported HF weights) and a ``torch_dist`` checkpoint in
``OUT_DIR/ckpt``. Rank r writes ``OUT_DIR/rank<r>.pt``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tiny_model import make_batch, train_config

from furlong.builtin_plugins.backends.megatron import train_backend


async def main(hf_dir: str, out: Path, coeff: float, layout_name: str) -> None:
    from transformers import AutoTokenizer

    from furlong.core.train.batching import plan_steps

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if layout_name == "ep":
        flags = dict(megatron_args={"expert_model_parallel_size": 2, "moe_aux_loss_coeff": [coeff]})
        dp, experts = 2, 2
    elif layout_name == "tp":
        flags = dict(tensor_model_parallel_size=2, sequence_parallel=True, use_routing_replay=True,
                     megatron_args={"expert_tensor_parallel_size": 1, "moe_aux_loss_coeff": [coeff]})
        dp, experts = 1, 4
    elif layout_name == "pp":
        flags = dict(pipeline_model_parallel_size=2, use_routing_replay=True,
                     megatron_args={"moe_aux_loss_coeff": [coeff]})
        dp, experts = 1, 4
    else:
        flags = dict(context_parallel_size=2, use_routing_replay=True, megatron_args={"moe_aux_loss_coeff": [coeff]})
        dp, experts = 1, 4
    config = train_config(hf_dir, adam_eps=1e-3, micro_batch_size=2, **flags)
    backend = train_backend(config=config)
    await backend.init(backend.config)
    layout = backend.layout()
    assert (layout.dp_size, layout.dp_rank) == (dp, rank % dp), layout
    assert len(backend.model.decoder.layers[0].mlp.experts.local_experts) == experts
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    probe = make_batch(tokenizer, [])
    steps = plan_steps([len(t) for t in probe.tokens], global_batch_size=4, num_steps=1, dp_size=dp, rank=rank % dp,
                       micro_batch_size=2, max_tokens_per_gpu=None, dynamic=False, balance=False)
    batch = make_batch(tokenizer, steps)
    log_probs = await backend.log_probs(batch)
    routing = dict(backend._recorded_routing)
    metrics = (await backend.train(0, batch))[0]
    weights = dict(await backend.named_weights())
    await backend.save(str(out / "ckpt"))
    torch.save({"steps": steps, "log_probs": log_probs, "metrics": metrics, "weights": weights, "routing": routing,
                "returns_outputs": layout.returns_outputs}, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4]))
