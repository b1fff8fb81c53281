"""Worker of test_megatron_backend.py::test_context_parallel_two_ranks (torchrun, 2 gloo ranks, CP=2).

Usage: ``torchrun --standalone --nproc_per_node 2 megatron_context_ranks.py OUT_DIR``.

With the model ``OUT_DIR/hf`` (the test wrote it, and a CP=1 checkpoint in ``OUT_DIR/cp1ckpt``)
the megatron backend at CP=2 (every sequence split over both ranks): log-probs and entropy of
the four fixed samples (a temperature, lengths that are not multiples of 2 x CP), two AdamW
steps of an objective with an entropy bonus (their metrics), the exported HF weights
(``OUT_DIR/cp2_rank<r>.pt``), a ``torch_dist`` checkpoint in ``OUT_DIR/cp2ckpt`` and the
weights of the CP=1 checkpoint loaded at CP=2.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tiny_model import make_batch, train_args

from furlong.builtin_plugins.backends.megatron import train_backend

STEPS = [[[0, 1], [2]], [[3], [0, 2], [1]]]  # as test_megatron_backend.py


async def main(out: Path) -> None:
    from megatron.core import parallel_state
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args = train_args(out / "hf", context_parallel_size=2, adam_eps=1e-3, entropy_coef=0.01,
                      use_dynamic_batch_size=True)
    backend = train_backend(args=args)
    await backend.init(args)
    layout = backend.layout()
    assert (layout.dp_size, layout.dp_rank, layout.returns_outputs) == (1, 0, rank == 0), layout
    batch = make_batch(AutoTokenizer.from_pretrained(out / "hf"), STEPS, temperature=0.8, entropy_coef=0.01)
    assert not backend._packed([batch.tokens[i] for i in (2, 3)])  # would be packed at CP=1
    log_probs = await backend.log_probs(batch)
    metrics = await backend.train(0, batch)
    weights = dict(await backend.named_weights())
    await backend.save(str(out / "cp2ckpt"))
    parallel_state.destroy_model_parallel()
    resumed = train_backend(args=args)
    await resumed.init(args)
    await resumed.load(str(out / "cp1ckpt"))
    loaded = dict(await resumed.named_weights())
    torch.save({"log_probs": log_probs, "metrics": metrics, "weights": weights, "loaded": loaded,
                "global_step": resumed.global_step}, out / f"cp2_rank{rank}.pt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
