"""Worker of test_megatron_critic.py::test_tensor_parallel_two_ranks (torchrun, 2 gloo ranks, TP=2), and the
batch and train pass that test module shares with it.

Usage: ``torchrun --standalone --nproc_per_node 2 megatron_critic_ranks.py HF_DIR OUT_DIR``.

At TP=2, then TP=2 with ``--sequence-parallel`` (right-padded and packed), the megatron critic computes the
values of the fixed samples and takes two AdamW steps of the clipped value loss (:func:`values_then_train`);
rank 0 writes ``{layout: {"values", "metrics", "after"}}`` to ``OUT_DIR/tp.pt``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch

from furlong.hooks import TrainBatch

TOKENS = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [5, 6, 7, 8, 9, 10, 11]]
LENGTHS = [3, 2, 4]
RETURNS = [[1.0, -0.5, 2.0], [0.25, 1.5], [0.0, 0.5, 1.0, -1.0]]
TP_STEPS = [[[0, 1], [2]], [[2], [0, 1]]]


def critic_batch(steps) -> TrainBatch:
    """The three fixed samples with their returns, micro-batched as ``steps``."""
    return TrainBatch(tokens=[list(t) for t in TOKENS], response_lengths=list(LENGTHS),
                      loss_masks=[torch.ones(n) for n in LENGTHS], steps=steps,
                      returns=[torch.tensor(r) for r in RETURNS], advantages=[torch.zeros(n) for n in LENGTHS])


def values_then_train(critic, config, plugin_manager, steps):
    """Values, then ``train`` with the clipped value loss against them; ``(values, metrics, values after)``."""
    from furlong.core.train.objective import StepObjective

    batch = critic_batch(steps)
    start = asyncio.run(critic.values(batch))["values"]
    batch.values = start
    batch.objective = StepObjective(config, plugin_manager, batch, "value_loss", "--advantage-estimator",
                                    old_values=start, reducer=False)
    metrics = asyncio.run(critic.train(0, batch))
    return start, metrics, asyncio.run(critic.values(critic_batch(steps)))["values"]


def tp_config(hf_dir: str, **overrides):
    """The critic's run configuration in these tests (:func:`tiny_model.train_config`'s, ppo, value clip 0.2)."""
    try:
        from .tiny_model import train_config
    except ImportError:  # the torchrun worker: tests/ is on the path
        from tiny_model import train_config

    return train_config(hf_dir, advantage_estimator="ppo", critic_lr=0.05, value_clip=0.2, adam_eps=1e-3,
                        global_batch_size=3, **overrides)


def main(hf_dir: str, out: Path) -> None:
    import torch.distributed as dist

    from furlong.builtin_plugins.backends.megatron import critic_backend
    from furlong.builtin_plugins.backends.megatron.model import init_parallel
    from furlong.core.plugins.manager import get_plugin_manager

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    init_parallel(2, torch.device("cpu"))
    pm = get_plugin_manager()
    results = {}
    for layout, extra in (("tp", {}), ("sp-padded", {"sequence_parallel": True}),
                          ("sp-packed", {"sequence_parallel": True})):
        config = tp_config(hf_dir, tensor_model_parallel_size=2, **extra)
        critic = critic_backend(config=config)
        asyncio.run(critic.init(critic.config))
        assert bool(critic.model.config.sequence_parallel) == bool(extra)
        critic._packed = lambda tokens, packed=layout.endswith("packed"): packed
        values, metrics, after = values_then_train(critic, config, pm, TP_STEPS)
        results[layout] = {"values": values, "metrics": metrics, "after": after}
    if dist.get_rank() == 0:
        torch.save(results, out / "tp.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
