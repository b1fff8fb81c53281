"""Worker of test_fsdp_shared_prompts.py::test_two_rank_fsdp2_shares_prompts (torchrun, 2 ranks, gloo).

Usage: ``torchrun --standalone --nproc_per_node 2 fsdp_shared_prompts_two_ranks.py HF_DIR OUT_DIR``. Each rank
runs a micro-batch of its own (two prompts, three samples each) through the FSDP2-sharded model with and
without prompt sharing, a forward and backward each, then once more where only rank 0's micro-batch could
share, then once where rank 0 plans the ``rows`` layout and rank 1 ``two_passes``, and writes the results
(log-probs, entropy, the full parameter gradients) and the layouts of the passes that shared prompts to
``OUT_DIR/rank<r>.pt``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tiny_model import TWO_RANK_FLAGS, train_config

from furlong.builtin_plugins.backends.fsdp import logprobs, shared_prompts, train_backend


def run(model, tokens, lengths, share: bool):
    model.zero_grad(set_to_none=True)
    lp, ent = logprobs.forward_log_probs(model, tokens, lengths, 0.7, torch.device("cpu"), grad=True,
                                         entropy_grad=True, share_prompts=share)
    (sum(x.sum() for x in lp) + 0.1 * sum(e.sum() for e in ent)).backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    return [x.detach() for x in lp], [e.detach() for e in ent], grads


async def main(hf_dir: str, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    backend = train_backend(config=train_config(hf_dir, **TWO_RANK_FLAGS))
    await backend.init(backend.config)
    rank = dist.get_rank()
    calls = []
    original = shared_prompts.shared_forward

    def spy(model, decoder, shared, device):
        calls.append(shared.layout)
        return original(model, decoder, shared, device)

    shared_prompts.shared_forward = spy
    g = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(4, 90, (n,), generator=g).tolist() for n in (11, 6 + rank)]
    tokens, lengths = [], []
    for prompt in prompts:
        for k in (2, 5, 3):
            tokens.append(prompt + torch.randint(4, 90, (k,), generator=g).tolist())
            lengths.append(k)
    result = {"shared": run(backend.model, tokens, lengths, True), "unshared": run(backend.model, tokens, lengths, False),
              "lengths": lengths, "shared_calls": len(calls)}
    # rank 0's micro-batch shares, rank 1's does not: both run the one-pass path (same collectives)
    mixed = run(backend.model, tokens if rank == 0 else tokens[::3], lengths if rank == 0 else lengths[::3], True)
    result.update(mixed=mixed, mixed_calls=len(calls) - result["shared_calls"])
    if rank == 1:  # rank 1's rows would need a mask over the limit, so it plans two passes
        shared_prompts.ROWS_MASK_LIMIT = 0
        shared_prompts.PASS_OVERHEAD = 0  # (on this tiny model the second pass's fixed cost would rule them out)
    result.update(layouts=run(backend.model, tokens, lengths, True), shared_layouts=list(calls))
    torch.save(result, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
