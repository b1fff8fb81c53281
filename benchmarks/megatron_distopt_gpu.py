"""megatron-core's distributed optimizer in the megatron backend, on one GPU, beside the backend's own AdamW.

    python benchmarks/megatron_distopt_gpu.py --out distopt.json

At the Qwen2.5-0.5B shape (random weights, ``benchmarks/megatron_gpu.py``'s model), bf16 parameters:
each run takes ``--steps`` optimizer steps on the same batch and records the loss and grad norm of
every step, the step time (median after the first two) and the peak GPU memory; its final weights
are compared with the first run's. Runs (launch flags):

- ``adamw``: ``--use-distributed-optimizer`` (the backend's AdamW over float32 master weights);
- ``distopt``: ``--use-distributed-optimizer --use-precision-aware-optimizer`` (megatron-core's distributed
  optimizer; without Transformer Engine the precision-aware option falls back to plain float32 state);
- ``offload``: Miles' trio ``--use-distributed-optimizer --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d
  --use-precision-aware-optimizer`` (AdamW state on the host);
- ``offload_half``: the trio with ``--optimizer-offload-fraction 0.5``.

Then, for ``offload``: a checkpoint saved after ``--steps - 1`` steps and loaded by a new backend gives
the same weights after one more step as the run that went on; and offloading the training state to
the host and back between two steps (colocated rollouts) gives the same weights as not doing so.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import tempfile
import time

import torch

from megatron_gpu import backend_for, batch_of, guarded, save_out, write_model

RUNS = {
    "adamw": ("--use-distributed-optimizer",),
    "distopt": ("--use-distributed-optimizer", "--use-precision-aware-optimizer"),
    "offload": ("--use-distributed-optimizer", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
                "--use-precision-aware-optimizer"),
    "offload_half": ("--use-distributed-optimizer", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
                     "--use-precision-aware-optimizer", "--optimizer-offload-fraction", "0.5"),
}


def weights(backend) -> dict:
    return {n: p.detach().float().cpu().clone() for n, p in backend.model.named_parameters()}


def optimizer_state(backend) -> dict:
    """The float32 masters and AdamW moments megatron-core's optimizer holds (host copies of the offloaded part
    included), keyed by group and position."""
    out = {}
    for part in backend.optimizer._parts():
        inner = part.optimizer
        for g, group in enumerate(inner.param_groups):
            for i, param in enumerate(group["params"]):
                out[f"{g}.{i}.master"] = param.detach().float().cpu().clone()
                for key, value in inner.state.get(param, {}).items():
                    if torch.is_tensor(value) and value.numel() > 1:
                        out[f"{g}.{i}.{key}"] = value.detach().float().cpu().clone()
    return out


def difference(a: dict, b: dict) -> dict:
    diffs = [(a[n] - b[n]).abs() for n in a]
    changed = sum(int((d > 0).sum()) for d in diffs)
    return {"max_abs": max(float(d.max()) for d in diffs), "elements_differing": changed,
            "elements": sum(d.numel() for d in diffs)}


def train_steps(backend, batch, steps: int) -> tuple[list[dict], list[float]]:
    rows, times = [], []
    for i in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        rows += asyncio.run(backend.train(i, batch))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return rows, times


def free_memory() -> None:
    """Release the backends already deleted: megatron-core's data-parallel wrapper holds reference cycles (its
    gradient hooks), so without a collection their GPU memory would still count in the next run's figures."""
    gc.collect()
    torch.cuda.empty_cache()


def run(path: str, name: str, flags: tuple, opts) -> tuple[dict, dict]:
    torch.manual_seed(0)
    free_memory()
    torch.cuda.reset_peak_memory_stats()
    backend = backend_for(path, opts.micro_batch, opts.samples, "--lr", "1e-5", "--clip-grad", "1.0", *flags)
    built = torch.cuda.max_memory_allocated() / 2**30
    batch = batch_of(opts.samples, opts.seq, 1, opts.micro_batch, seed=2)
    rows, times = train_steps(backend, batch, opts.steps)
    result = {"flags": list(flags), "optimizer": type(backend.optimizer).__name__,
              "loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows],
              "step_s": sorted(times[2:])[len(times[2:]) // 2] if len(times) > 2 else times[-1], "all_steps_s": times,
              "peak_gib_after_init": built, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    final = weights(backend)
    del backend
    free_memory()
    return result, final


def resume_and_offload(path: str, flags: tuple, opts) -> dict:
    """A checkpoint after steps - 1, loaded by a new backend, then one step: the same weights as going on; and
    offload + onload between two steps changes nothing."""
    batch = batch_of(opts.samples, opts.seq, 1, opts.micro_batch, seed=2)
    extra = ("--lr", "1e-5", "--clip-grad", "1.0", *flags)
    free_memory()
    with tempfile.TemporaryDirectory() as save:
        first = backend_for(path, opts.micro_batch, opts.samples, *extra)
        train_steps(first, batch, opts.steps - 1)
        asyncio.run(first.save(os.path.join(save, "iter_0000001")))
        saved_state = optimizer_state(first)
        with open(os.path.join(save, "iter_0000001", "meta.json")) as f:
            meta = json.load(f)
        before_gib = torch.cuda.memory_allocated() / 2**30
        asyncio.run(first.offload())
        offloaded_gib = torch.cuda.memory_allocated() / 2**30
        asyncio.run(first.onload())
        train_steps(first, batch, 1)
        went_on = weights(first)
        del first
        free_memory()
        second = backend_for(path, opts.micro_batch, opts.samples, *extra)
        asyncio.run(second.load(os.path.join(save, "iter_0000001")))
        loaded = optimizer_state(second)
        common = sorted(set(loaded) & set(saved_state))
        loaded_vs_saved = {**difference({k: loaded[k] for k in common}, {k: saved_state[k] for k in common}),
                           "keys_compared": len(common), "keys_only_saved": len(set(saved_state) - set(loaded)),
                           "keys_only_loaded": len(set(loaded) - set(saved_state))}
        del loaded
        del saved_state
        train_steps(second, batch, 1)
        resumed = weights(second)
        del second
        free_memory()
    return {"optimizer_format": meta.get("optimizer_format"), "gib_allocated_before_offload": before_gib,
            "gib_allocated_while_offloaded": offloaded_gib,
            "optimizer_state_loaded_vs_saved": loaded_vs_saved,
            "resumed_vs_went_on_after_offload_onload": difference(resumed, went_on)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--skip-resume", action="store_true")
    parser.add_argument("--resume-runs", nargs="*", default=["distopt", "offload"], choices=list(RUNS),
                        help="runs whose checkpoint resume and offload/onload are checked")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    import megatron.core

    result: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                    "megatron_core": megatron.core.__version__, "runs": {}}
    torch.backends.cuda.matmul.allow_tf32 = True
    with tempfile.TemporaryDirectory() as path:
        write_model(path)
        first = None
        for name in opts.runs:
            done = guarded(run, path, name, RUNS[name], opts)
            if isinstance(done, dict):  # guarded's {"error": ...}: recorded, the other runs still go
                result["runs"][name] = done
            else:
                result["runs"][name], final = done
                if first is None:
                    first, first_name = final, name
                else:
                    result["runs"][name]["weights_vs_" + first_name] = difference(final, first)
            print(name, json.dumps(result["runs"][name]), flush=True)
            save_out(opts.out, result)
        if not opts.skip_resume:
            result["resume_and_offload"] = {}
            for name in opts.resume_runs:
                result["resume_and_offload"][name] = guarded(resume_and_offload, path, RUNS[name], opts)
                print("resume_and_offload", name, json.dumps(result["resume_and_offload"][name]), flush=True)
                save_out(opts.out, result)
    print(json.dumps(result, indent=2))
    save_out(opts.out, result)


if __name__ == "__main__":
    main()
