"""Worker of test_megatron_backend.py::test_context_parallel_four_ranks (torchrun, 4 gloo ranks).

Usage: ``torchrun --standalone --nproc_per_node 4 megatron_context_ranks.py OUT_DIR``.

With the model ``OUT_DIR/hf`` (the test wrote it, and a CP=1 checkpoint in ``OUT_DIR/cp1ckpt``):

1. TP=2 x CP=2 (every sequence split over two ranks, each holding half the heads) with
   token-planned micro-batches, two of them packed (``thd``): log-probs and entropy of the
   four fixed samples (a temperature, lengths that are not multiples of 2 x CP), two AdamW
   steps of an objective with an entropy bonus over the samples of ``STEPS`` (their
   metrics), the exported HF weights (``OUT_DIR/tp2cp2_rank<r>.pt``), a ``torch_dist``
   checkpoint in ``OUT_DIR/cp2ckpt`` and the weights of the CP=1 checkpoint loaded here.
2. CP=2 x DP=2: the same two steps with each step's micro-batches shared out between the
   two data-parallel ranks (``OUT_DIR/cp2dp2_rank<r>.pt``: metrics and weights).
3. PP=2 x CP=2: log-probs and the two steps of 1. (packed micro-batches included) through the
   pipeline schedule (``OUT_DIR/pp2cp2_rank<r>.pt``).
4. TP=2 x PP=2 with sequence parallelism: the same as 3. (``OUT_DIR/tp2pp2sp_rank<r>.pt``).
5. TP=2 x CP=2 with sequence parallelism: log-probs and the two steps of 1. (``OUT_DIR/tp2cp2sp_rank<r>.pt``).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tiny_model import make_batch, train_config

from furlong.builtin_plugins.backends.megatron import train_backend

STEPS = [[[0, 1], [2]], [[3], [0, 2], [1]]]  # as test_megatron_backend.py
DP_STEPS = ([[[0, 1]], [[3], [0, 2]]], [[[2]], [[1]]])  # STEPS shared out between two data-parallel ranks
PACKED_STEPS = [[[0], [1, 2]], [[2, 3], [0, 1]]]  # STEPS' samples; [1, 2] and [2, 3] are packed


def batch(hf_dir: Path, steps):
    from transformers import AutoTokenizer

    return make_batch(AutoTokenizer.from_pretrained(hf_dir), steps, temperature=0.8, entropy_coef=0.01)


async def started(out: Path, layout: tuple, **flags):
    """The backend at the parallel sizes of ``flags``, its ``(dp_size, dp_rank, returns_outputs)`` checked."""
    config = train_config(out / "hf", adam_eps=1e-3, entropy_coef=0.01, **flags)
    backend = train_backend(config=config)
    await backend.init(config)
    got = backend.layout()
    assert (got.dp_size, got.dp_rank, got.returns_outputs) == layout, got
    return backend


async def trained(backend, out: Path, steps) -> dict:
    """Log-probs, then the optimizer steps of ``steps`` (their metrics), then the exported weights."""
    data = batch(out / "hf", steps)
    result = {"log_probs": await backend.log_probs(data), "metrics": await backend.train(0, data)}
    return {**result, "weights": dict(await backend.named_weights())}


async def tensor_and_context_parallel(out: Path, rank: int) -> None:
    from megatron.core import parallel_state

    flags = dict(tensor_model_parallel_size=2, context_parallel_size=2, use_dynamic_batch_size=True)
    backend = await started(out, (1, 0, rank == 0), **flags)
    tokens = batch(out / "hf", []).tokens
    assert [backend._packed([tokens[i] for i in mb]) for step in PACKED_STEPS for mb in step] == [
        False, True, True, False]
    result = await trained(backend, out, PACKED_STEPS)
    await backend.save(str(out / "cp2ckpt"))
    parallel_state.destroy_model_parallel()
    resumed = await started(out, (1, 0, rank == 0), **flags)
    await resumed.load(str(out / "cp1ckpt"))
    result.update(loaded=dict(await resumed.named_weights()), global_step=resumed.global_step)
    torch.save(result, out / f"tp2cp2_rank{rank}.pt")
    parallel_state.destroy_model_parallel()


async def context_and_data_parallel(out: Path, rank: int) -> None:
    from megatron.core import parallel_state

    backend = await started(out, (2, rank // 2, rank % 2 == 0), context_parallel_size=2)
    torch.save(await trained(backend, out, DP_STEPS[rank // 2]), out / f"cp2dp2_rank{rank}.pt")
    parallel_state.destroy_model_parallel()


async def pipeline_and_context_parallel(out: Path, rank: int) -> None:
    from megatron.core import parallel_state

    backend = await started(out, (1, 0, rank == 2), pipeline_model_parallel_size=2, context_parallel_size=2,
                            use_dynamic_batch_size=True)
    torch.save(await trained(backend, out, PACKED_STEPS), out / f"pp2cp2_rank{rank}.pt")
    parallel_state.destroy_model_parallel()


async def sequence_parallel(out: Path, name: str, layout: tuple, **flags) -> None:
    """TP=2 with sequence parallelism and ``flags`` (PP=2 or CP=2): log-probs and the steps of 1."""
    from megatron.core import parallel_state

    backend = await started(out, layout, tensor_model_parallel_size=2, sequence_parallel=True,
                            use_dynamic_batch_size=True, **flags)
    assert backend.model.config.sequence_parallel
    torch.save(await trained(backend, out, PACKED_STEPS), out / f"{name}_rank{dist.get_rank()}.pt")
    parallel_state.destroy_model_parallel()


async def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    await tensor_and_context_parallel(out, dist.get_rank())
    await context_and_data_parallel(out, dist.get_rank())
    await pipeline_and_context_parallel(out, dist.get_rank())
    rank = dist.get_rank()
    await sequence_parallel(out, "tp2pp2sp", (1, 0, rank == 2), pipeline_model_parallel_size=2)
    await sequence_parallel(out, "tp2cp2sp", (1, 0, rank == 0), context_parallel_size=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
