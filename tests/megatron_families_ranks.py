"""Worker of test_megatron_families.py::test_glm4_and_lora_on_two_ranks (torchrun, 2 gloo ranks).

Usage: ``torchrun --standalone --nproc_per_node 2 megatron_families_ranks.py HF_DIR OUT_DIR``.

1. GLM-4 at TP=2, then at TP=2 with ``--sequence-parallel`` (packed): log-probs and one AdamW step on the four
   fixed samples (``tp.pt``, ``sp.pt``: log-probs, metrics and the exported HF weights, from rank 0).
2. LoRA at TP=2, plain and with ``--sequence-parallel`` (packed): log-probs and one step (``lora_tp.pt``,
   ``lora_sp.pt``), the first also saved as a checkpoint (``lora_ckpt``, with its peft ``adapter/``).
3. LoRA at TP=1 x DP=2 (each rank one half of the samples): one step (``lora_dp.pt``: metrics and the merged
   HF weights, from rank 0).
4. LoRA at PP=2 (a layer per stage): log-probs and one step (``lora_pp.pt``, from the last stage) and a
   checkpoint (``lora_pp_ckpt``, its peft ``adapter/`` gathered over the stages).
5. LoRA at CP=2: log-probs and one step (``lora_cp.pt``).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tiny_model import make_batch, train_config

from furlong.builtin_plugins.backends.megatron import train_backend
from furlong.builtin_plugins.backends.megatron.model import init_parallel

STEPS = [[[0, 1], [2, 3]]]
LORA = dict(lora_rank=4, lora_alpha=8, lr=5e-2)


async def step(hf_dir: str, steps, save: Path | None = None, **flags) -> dict:
    from transformers import AutoTokenizer

    backend = train_backend(config=train_config(hf_dir, adam_eps=1e-3, **flags))
    await backend.init(backend.config)
    batch = make_batch(AutoTokenizer.from_pretrained(hf_dir), steps)
    if flags.get("sequence_parallel"):
        backend._packed = lambda tokens: True
    log_probs = await backend.log_probs(batch) if any(
        flags.get(f"{kind}_model_parallel_size") for kind in ("tensor", "pipeline")) or flags.get(
        "context_parallel_size") else None
    metrics = (await backend.train(0, batch))[0]
    if save is not None:
        await backend.save(str(save))
    return {"log_probs": log_probs, "metrics": metrics, "weights": dict(await backend.named_weights())}


async def main(hf_dir: str, out: Path) -> None:
    from megatron.core import parallel_state

    from furlong.core.train.batching import plan_steps

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    init_parallel(2, torch.device("cpu"))
    for name, flags in (("tp", {}), ("sp", {"sequence_parallel": True}), ("lora_tp", LORA),
                        ("lora_sp", {**LORA, "sequence_parallel": True})):
        save = out / "lora_ckpt" if name == "lora_tp" else None
        result = await step(hf_dir, STEPS, save, tensor_model_parallel_size=2, **flags)
        if rank == 0:
            torch.save(result, out / f"{name}.pt")
        dist.barrier()
    parallel_state.destroy_model_parallel()
    from transformers import AutoTokenizer

    probe = make_batch(AutoTokenizer.from_pretrained(hf_dir), [])
    steps = plan_steps([len(t) for t in probe.tokens], global_batch_size=4, num_steps=1, dp_size=2, rank=rank,
                       micro_batch_size=1, max_tokens_per_gpu=None, dynamic=False, balance=False)
    result = await step(hf_dir, steps, None, **LORA)
    if rank == 0:
        torch.save(result, out / "lora_dp.pt")
    dist.barrier()
    parallel_state.destroy_model_parallel()
    result = await step(hf_dir, STEPS, out / "lora_pp_ckpt", pipeline_model_parallel_size=2, **LORA)
    if rank == 1:  # the last stage: its log-probs
        torch.save(result, out / "lora_pp.pt")
    dist.barrier()
    parallel_state.destroy_model_parallel()
    result = await step(hf_dir, STEPS, None, context_parallel_size=2, **LORA)
    if rank == 0:
        torch.save(result, out / "lora_cp.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
