"""Worker of test_megatron_backend.py::test_tensor_parallel_two_ranks (torchrun, 2 gloo ranks, TP=2).

Usage: ``torchrun --standalone --nproc_per_node 2 megatron_two_ranks.py HF_DIR OUT_DIR``.

1. Builds the model of HF_DIR with megatron-core's own random CPU initialisation (seed 7) at
   TP=2 and writes each rank's parameters to ``OUT_DIR/init<r>.pt`` (the test compares them
   with the converter's split of the TP=1 initialisation).
2. Runs the megatron backend at TP=2 on the four fixed samples (the first prompt holding the pad
   token): log-probs (``logprobs.pt``),
   one AdamW step (``step.pt``: metrics and the exported HF weights), and a ``torch_dist``
   checkpoint in ``OUT_DIR/ckpt``; the same with ``--sequence-parallel``, right-padded and packed
   (``sp.pt``).
3. At TP=1 x DP=2: one step (``dp.pt``, checkpoint ``dp_ckpt``); the same with
   ``--use-distributed-optimizer`` (``zero<r>.pt`` with each rank's share of the AdamW state,
   checkpoint ``zero_ckpt``), and ``dp_ckpt`` loaded into the sharded optimizer.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tiny_model import make_batch, train_config

from furlong.builtin_plugins.backends.megatron import train_backend
from furlong.builtin_plugins.backends.megatron.config import model_shape
from furlong.builtin_plugins.backends.megatron.model import build_gpt, init_parallel


def megatron_init(hf_dir: str) -> dict:
    from transformers import AutoConfig

    torch.manual_seed(7)
    shape = model_shape(AutoConfig.from_pretrained(hf_dir))
    model = build_gpt(shape, 2, shape.vocab_size, torch.float32, torch.device("cpu"), perform_initialization=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


async def main(hf_dir: str, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    init_parallel(2, torch.device("cpu"))
    torch.save(megatron_init(hf_dir), out / f"init{rank}.pt")
    backend = train_backend(config=train_config(hf_dir, tensor_model_parallel_size=2, adam_eps=1e-3))
    await backend.init(backend.config)
    layout = backend.layout()
    assert (layout.dp_size, layout.dp_rank, layout.returns_outputs) == (1, 0, rank == 0), layout
    from transformers import AutoTokenizer

    steps = [[[0, 1], [2, 3]]]
    batch = make_batch(AutoTokenizer.from_pretrained(hf_dir), steps, pad_in_prompt=True)
    log_probs = await backend.log_probs(batch)
    metrics = (await backend.train(0, batch))[0]
    weights = dict(await backend.named_weights())
    await backend.save(str(out / "ckpt"))
    if rank == 0:
        torch.save(log_probs, out / "logprobs.pt")
        torch.save({"metrics": metrics, "weights": weights}, out / "step.pt")
    dist.barrier()
    await sequence_parallel(hf_dir, out, rank, steps)
    await data_parallel(hf_dir, out, rank)
    dist.destroy_process_group()


async def sequence_parallel(hf_dir: str, out: Path, rank: int, steps: list) -> None:
    """TP=2 with --sequence-parallel, right-padded and packed: log-probs and one step (``sp.pt``, by layout)."""
    from transformers import AutoTokenizer

    results = {}
    for layout in ("padded", "packed"):
        backend = train_backend(config=train_config(hf_dir, tensor_model_parallel_size=2, sequence_parallel=True,
                                                adam_eps=1e-3))
        await backend.init(backend.config)
        assert backend.model.config.sequence_parallel
        backend._packed = lambda tokens, packed=layout == "packed": packed
        batch = make_batch(AutoTokenizer.from_pretrained(hf_dir), steps, pad_in_prompt=True)
        log_probs = await backend.log_probs(batch)
        metrics = (await backend.train(0, batch))[0]
        results[layout] = {"log_probs": log_probs, "metrics": metrics, "weights": dict(await backend.named_weights())}
    if rank == 0:
        torch.save(results, out / "sp.pt")
    dist.barrier()


async def data_parallel(hf_dir: str, out: Path, rank: int) -> None:
    from megatron.core import parallel_state
    from transformers import AutoTokenizer

    from furlong.core.train.batching import plan_steps

    parallel_state.destroy_model_parallel()
    backend = train_backend(config=train_config(hf_dir, adam_eps=1e-3))
    await backend.init(backend.config)
    layout = backend.layout()
    assert (layout.dp_size, layout.dp_rank, layout.returns_outputs) == (2, rank, True), layout
    probe = make_batch(AutoTokenizer.from_pretrained(hf_dir), [], pad_in_prompt=True)
    steps = plan_steps([len(t) for t in probe.tokens], global_batch_size=4, num_steps=1, dp_size=2, rank=rank,
                       micro_batch_size=1, max_tokens_per_gpu=None, dynamic=False, balance=False)
    batch = make_batch(AutoTokenizer.from_pretrained(hf_dir), steps, pad_in_prompt=True)
    metrics = (await backend.train(0, batch))[0]
    weights = dict(await backend.named_weights())
    await backend.save(str(out / "dp_ckpt"))
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights}, out / "dp.pt")
    await distributed_optimizer(hf_dir, out, rank, steps, backend)


async def distributed_optimizer(hf_dir: str, out: Path, rank: int, steps: list, plain) -> None:
    """DP=2 with --use-distributed-optimizer: each rank holds the AdamW state of its share of the parameters;
    one step and a checkpoint (``zero<rank>.pt``, ``zero_ckpt``); the plain DP=2 checkpoint loads into the sharded
    optimizer with the plain run's moments."""
    from transformers import AutoTokenizer

    from furlong.kit.trainer import local_optimizer

    def owned(backend) -> dict:
        names = {id(p): n for n, p in backend.model.named_parameters()}
        local = local_optimizer(backend.optimizer)
        return {names[id(p)]: local.state[p] for group in local.param_groups for p in group["params"]}

    config = train_config(hf_dir, adam_eps=1e-3, use_distributed_optimizer=True)
    backend = train_backend(config=config)
    await backend.init(backend.config)
    assert local_optimizer(backend.optimizer) is not backend.optimizer
    batch = make_batch(AutoTokenizer.from_pretrained(hf_dir), steps, pad_in_prompt=True)
    metrics = (await backend.train(0, batch))[0]
    weights = dict(await backend.named_weights())
    mine = owned(backend)
    await backend.save(str(out / "zero_ckpt"))
    torch.save({"metrics": metrics, "weights": weights, "owned": sorted(mine)}, out / f"zero{rank}.pt")

    resumed = train_backend(config=config)
    await resumed.init(resumed.config)
    await resumed.load(str(out / "dp_ckpt"))
    assert resumed.global_step == plain.global_step == 1
    expected = {n: plain.optimizer.state[p] for n, p in plain.model.named_parameters()}
    got = owned(resumed)
    assert sorted(got) == sorted(mine), (sorted(got), sorted(mine))
    for name, state in got.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], expected[name][key]), (name, key)
        assert float(state["step"]) == 1.0
    dist.barrier()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
