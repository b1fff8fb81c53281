"""Temporary GPU check (not part of the suite)."""
import asyncio, os, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import build_tiny_model
from tiny_model import make_batch, train_args

async def single(d):
    from furlong.builtin_plugins.engines.embedded import load_engine
    from furlong.builtin_plugins.backends.fsdp import train_backend
    from furlong.hooks import TrainBatch
    eng = load_engine(str(d))
    print("engine", eng.device, next(eng.model.parameters()).dtype)
    tok = eng.tokenizer
    torch.manual_seed(0)
    outs = await asyncio.gather(*[eng.generate(tok.encode(p), {"temperature": 0.7, "max_new_tokens": 12, "ignore_eos": True}) for p in ["abc", "Hello"]])
    print("gen", [o.finish_reason for o in outs], [len(o.output_ids) for o in outs])
    await eng.release_memory(); print("released", next(eng.model.parameters()).device)
    await eng.resume_memory(); print("resumed", next(eng.model.parameters()).device)
    b = train_backend(args=train_args(d, bf16=True))
    await b.init(b.args)
    tokens = [tok.encode(p) + o.output_ids for p, o in zip(["abc", "Hello"], outs)]
    lens = [len(o.output_ids) for o in outs]
    tb = TrainBatch(tokens=tokens, response_lengths=lens, loss_masks=[torch.ones(n) for n in lens], temperature=0.7)
    lp = (await b.log_probs(tb))["log_probs"]
    print("max |engine - trainer| logprob (bf16 both):", max((torch.tensor(o.output_log_probs) - l).abs().max().item() for o, l in zip(outs, lp)))
    batch = make_batch(b.tokenizer, [[[0, 1], [2, 3]]])
    m = await b.train(0, batch); print("train", m)
    await b.offload(); print("offloaded", next(b.model.parameters()).device, torch.cuda.memory_allocated())
    await b.onload(); print("onloaded", next(b.model.parameters()).device)
    m = await b.train(1, make_batch(b.tokenizer, [[[0, 1], [2, 3]]])); print("train2", m)
    w = await b.named_weights()
    await eng.update_weights(w, 3)
    o = await eng.generate(tok.encode("abc"), {"temperature": 0, "max_new_tokens": 4})
    print("after update", o.weight_version, o.output_ids)
    await b.save("/tmp/gpuckpt"); await b.load("/tmp/gpuckpt"); print("save/load ok", b.global_step)

async def dist_main(d):
    import torch.distributed as dist
    from furlong.builtin_plugins.backends.fsdp import train_backend
    from furlong.core.batching import plan_steps
    b = train_backend(args=train_args(d, bf16=True))
    await b.init(b.args)
    r = dist.get_rank()
    probe = make_batch(b.tokenizer, [])
    steps = plan_steps([len(t) for t in probe.tokens], 4, 1, 2, r, 1, None, False, False)
    batch = make_batch(b.tokenizer, steps)
    lp = await b.log_probs(batch)
    m = await b.train(0, batch)
    print(r, "fsdp train", m, type(next(b.model.parameters())).__name__)
    await b.offload(); print(r, "offloaded", next(b.model.parameters()).device)
    await b.onload(); print(r, "onloaded", next(b.model.parameters()).device)
    m = await b.train(1, make_batch(b.tokenizer, steps)); print(r, "train2", m)
    w = await b.named_weights(); print(r, "named", len(w), w[0][1].device, w[0][1].dtype)
    await b.save("/tmp/gpuckpt2"); print(r, "saved")
    await b.load("/tmp/gpuckpt2"); print(r, "loaded", b.global_step)
    m = await b.train(2, make_batch(b.tokenizer, steps)); print(r, "train3", m)
    dist.destroy_process_group()

if __name__ == "__main__":
    d = Path("/tmp/tinygpu")
    if sys.argv[1] == "single":
        build_tiny_model(d); asyncio.run(single(d))
    else:
        asyncio.run(dist_main(d))
