"""Worker of test_fsdp_backend.py::test_two_rank_fsdp2_matches_one_process (run by torchrun, 2 ranks, gloo).

Usage: ``torchrun --standalone --nproc_per_node 2 fsdp_two_ranks.py HF_DIR OUT_DIR``. Each
rank trains one step on its share of the 4 fixed samples (planned by the core's
``plan_steps``), then rank 0 writes the full weights, grad norm and loss to
``OUT_DIR/rank0.pt``, each rank its log-probs to ``OUT_DIR/logprobs<r>.pt``, and all
ranks save a checkpoint to ``OUT_DIR/ckpt``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tiny_model import TWO_RANK_FLAGS, make_batch, train_config

from furlong.builtin_plugins.backends.fsdp import train_backend
from furlong.core.train.batching import plan_steps


async def main(hf_dir: str, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    backend = train_backend(config=train_config(hf_dir, **TWO_RANK_FLAGS))
    await backend.init(backend.config)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    probe = make_batch(backend.tokenizer, [])
    steps = plan_steps([len(t) for t in probe.tokens], global_batch_size=4, num_steps=1, dp_size=world, rank=rank,
                       micro_batch_size=1, max_tokens_per_gpu=None, dynamic=False, balance=False)
    batch = make_batch(backend.tokenizer, steps)
    log_probs = (await backend.log_probs(batch))["log_probs"]
    torch.save({i: lp for i, lp in enumerate(log_probs) if lp is not None}, out / f"logprobs{rank}.pt")
    metrics = (await backend.train(0, batch))[0]
    weights = {name: t.clone() for name, t in await backend.named_weights()}
    await backend.save(str(out / "ckpt"))
    if rank == 0:
        torch.save({"weights": weights, "grad_norm": metrics["grad_norm"], "loss": metrics["loss"]}, out / "rank0.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
