"""Worker of test_megatron_backend.py::test_pipeline_two_stages (torchrun, 2 gloo ranks, PP=2).

Usage: ``torchrun --standalone --nproc_per_node 2 megatron_pipeline_ranks.py OUT_DIR NAME...``.

For each model ``OUT_DIR/NAME/hf`` (the test wrote it, and a TP=1 PP=1 checkpoint in
``OUT_DIR/NAME/pp1ckpt``) the megatron backend at PP=2: log-probs of the four fixed samples
(from the rank that returns outputs), two AdamW steps (their metrics), the exported HF
weights of every rank (``OUT_DIR/NAME/pp2_rank<r>.pt``), a ``torch_dist`` checkpoint in
``OUT_DIR/NAME/pp2ckpt``, the weights of the PP=1 checkpoint loaded at PP=2, and the
log-probs of the initial model with a packed micro-batch. For the
last model also one ``--bf16`` step and its checkpoint (:func:`bf16_masters`).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tiny_model import make_batch, train_config

from furlong.builtin_plugins.backends.megatron import train_backend

STEPS = [[[0, 1], [2]], [[3], [0, 2], [1]]]  # two optimizer steps; micro-batches of different shapes
PACKED = [[[2, 3], [0, 1]]]  # with --use-dynamic-batch-size, [2, 3] (6 and 21 tokens) is packed (thd)


async def stages(out: Path, rank: int) -> None:
    from megatron.core import parallel_state
    from transformers import AutoTokenizer

    hf_dir = out / "hf"
    config = train_config(hf_dir, pipeline_model_parallel_size=2, adam_eps=1e-3)
    backend = train_backend(config=config)
    await backend.init(config)
    layout = backend.layout()
    assert (layout.dp_size, layout.dp_rank, layout.returns_outputs) == (1, 0, rank == 1), layout
    batch = make_batch(AutoTokenizer.from_pretrained(hf_dir), STEPS)
    log_probs = await backend.log_probs(batch)
    metrics = await backend.train(0, batch)
    weights = dict(await backend.named_weights())
    await backend.save(str(out / "pp2ckpt"))
    resumed = train_backend(config=config)
    parallel_state.destroy_model_parallel()
    await resumed.init(config)
    await resumed.load(str(out / "pp1ckpt"))
    loaded = dict(await resumed.named_weights())
    parallel_state.destroy_model_parallel()
    packed = train_backend(config=train_config(hf_dir, pipeline_model_parallel_size=2, use_dynamic_batch_size=True))
    await packed.init(packed.config)
    packed_batch = make_batch(AutoTokenizer.from_pretrained(hf_dir), PACKED)
    assert packed._packed([packed_batch.tokens[i] for i in PACKED[0][0]])
    packed_log_probs = await packed.log_probs(packed_batch)
    torch.save({"log_probs": log_probs, "metrics": metrics, "weights": weights, "loaded": loaded,
                "global_step": resumed.global_step, "packed_log_probs": packed_log_probs}, out / f"pp2_rank{rank}.pt")
    parallel_state.destroy_model_parallel()


async def bf16_masters(out: Path, rank: int) -> None:
    """One step at PP=2 with --bf16; its checkpoint (float32 masters) in ``OUT_DIR/NAME/bf16ckpt`` and each
    rank's masters under their PP=1 names in ``bf16_rank<r>.pt``."""
    from megatron.core import parallel_state
    from transformers import AutoTokenizer

    from furlong.builtin_plugins.backends.megatron.convert import placed_units

    config = train_config(out / "hf", pipeline_model_parallel_size=2, adam_eps=1e-3, bf16=True)
    backend = train_backend(config=config)
    await backend.init(config)
    await backend.train(0, make_batch(AutoTokenizer.from_pretrained(out / "hf"), STEPS[:1]))
    await backend.save(str(out / "bf16ckpt"))
    names = {local: unit.mcore for unit, local in placed_units(backend.shape, backend.stage)}
    masters = {names[n]: m.detach().clone() for n, m in backend.masters.named_parameters()}
    torch.save(masters, out / f"bf16_rank{rank}.pt")
    parallel_state.destroy_model_parallel()


async def main(out: Path, names: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for name in names:
        await stages(out / name, dist.get_rank())
    await bf16_masters(out / names[-1], dist.get_rank())
    dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2:]))
