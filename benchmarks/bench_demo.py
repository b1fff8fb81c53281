"""furlong against TRL's GRPOTrainer on furlong's demo workload, on this machine.

One command, from the repository root (needs ``pip install -e ".[bench]"`` for TRL)::

    python benchmarks/bench_demo.py

It runs the same GRPO workload twice, each in its own process with the same torch thread
count. The defaults are ``examples/demo/run_demo.sh``'s: the demo model and data, 32 prompts
x 8 samples = 256 samples and one optimizer step per iteration, responses of at most 12
tokens, micro-batches of 64, lr 1e-4 (constant, no warm-up), AdamW without weight decay,
clip range 0.2 / 0.28.

1. ``furlong train`` (sync mode, embedded engine, fsdp backend) for ``--rollouts`` rollouts;
   the time split comes from furlong's own ``metrics.jsonl`` (``perf/rollout_time``,
   ``perf/train_time``, ``perf/update_weights_time``, per rollout);
2. TRL's ``GRPOTrainer`` for as many optimizer steps, configured to match: same model and
   tokenizer, same prompts in the same order (neither run shuffles: the demo's train.jsonl is
   shuffled already), ``num_generations`` = samples per prompt, one optimizer step per
   generation batch (``steps_per_generation`` = ``gradient_accumulation_steps`` = batch /
   micro-batch, ``num_iterations=1``), ``max_completion_length``, temperature 1.0 (top-p 1,
   no top-k), ``beta=0`` (no KL, no reference model), ``epsilon`` / ``epsilon_high``,
   group-std-scaled advantages, per-sequence token-mean loss averaged over the batch
   (furlong's default reduction = TRL ``loss_type="grpo"``), AdamW with furlong's betas
   (0.9, 0.98) and eps 1e-8, gradient clipping 1.0, ``lr_scheduler_type="constant"``, float32
   without gradient checkpointing (TRL turns both bf16 and checkpointing on by default), and a
   reward that grades like furlong's ``math`` reward on these integer labels (the last
   ``\\boxed{}`` holds the label). TRL's step time is split into generation + scoring (its
   ``_generate_and_score_completions``) and the rest (forward, backward, optimizer).

With ``--furlong-packing`` furlong runs without ``--micro-batch-size``, so it packs
micro-batches by tokens (its default), while TRL keeps micro-batches of ``--micro-batch``.
With ``--furlong-async`` furlong runs ``train-async`` (the next rollout is generated while this
one trains, one step off-policy); its seconds per iteration are then ``perf/step_time``, the wall
time between two train steps, and the report adds the time the trainer waited for generation.
TRL stays synchronous.

furlong's embedded engine generates the whole batch at once (``--embedded-max-batch-size`` =
prompts x samples; its default is 64), as TRL does (``generation_batch_size``).

It prints seconds per iteration and samples per second side by side with furlong's speed-up (how many
times faster furlong is: above 1x favours furlong on every row), and the
reward of the first and last iterations; ``--json PATH`` also writes every figure.

On a shared or small machine the same invocation moves by 20 % or more from one run to the
next. ``--rounds N`` runs the pair N times, furlong and TRL alternating, prints the full table
of the round whose speed-up is the median (of an even N, the lower of the two middle rounds) and
one line per round, and ends with that median speed-up and the range.
docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo"
BOXED_INT = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")


# --------------------------------------------------------------------------- shared


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def boxed_reward(completion: str, label: str) -> float:
    """1.0 when the last ``\\boxed{}`` of ``completion`` holds the integer ``label``, else 0.0."""
    found = re.findall(r"\\boxed\{([^{}]*)\}", completion)
    if not found:
        return 0.0
    match = BOXED_INT.fullmatch("\\boxed{" + found[-1] + "}")
    return float(match is not None and int(match.group(1)) == int(label))


def machine_info() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = "not installed"
    return info


def summarize(step_times: list[float], parts: dict[str, list[float]], rewards: list[float], samples: int,
              overlapped: bool = False) -> dict:
    """Means over the iterations after the first (the first pays one-off warm-up costs); ``overlapped``
    (train-async) also leaves out the last, which trains with no generation beside it."""
    end = -1 if overlapped and len(step_times) > 2 else None
    steady = slice(1, end) if len(step_times) > 1 else slice(None)
    mean_step = statistics.fmean(step_times[steady])
    return {
        "iterations": len(step_times),
        "s_per_iteration": mean_step,
        "s_per_iteration_median": statistics.median(step_times[steady]),
        "step_times_s": step_times,
        "samples_per_s": samples / mean_step,
        "split_s": {k: statistics.fmean(v[steady]) for k, v in parts.items()},
        "first_iteration_s": step_times[0],
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "reward_mean_last3": statistics.fmean(rewards[-3:]),
        "rewards": rewards,
    }


# --------------------------------------------------------------------------- furlong


def run_furlong(opts, out: Path) -> dict:
    """``furlong train`` (or ``train-async``) in a subprocess; figures from its metrics.jsonl."""
    batch = opts.prompts * opts.group
    cmd = [
        sys.executable, "-m", "furlong.core", "train-async" if opts.furlong_async else "train",
        "--hf-checkpoint", str(opts.model), "--prompt-data", str(opts.data / "train.jsonl"),
        "--input-key", "prompt", "--label-key", "label", "--rm-type", "math",
        *(["--apply-chat-template"] if opts.chat_template else []),
        "--num-rollout", str(opts.rollouts), "--rollout-batch-size", str(opts.prompts),
        "--n-samples-per-prompt", str(opts.group), "--global-batch-size", str(batch),
        *([] if opts.furlong_packing else ["--micro-batch-size", str(opts.micro_batch)]),
        "--rollout-max-response-len", str(opts.max_len),
        "--embedded-max-batch-size", str(batch),  # generate the whole batch at once, as TRL does
        "--rollout-temperature", "1.0", "--lr", str(opts.lr), "--lr-decay-style", "constant",
        "--weight-decay", str(opts.weight_decay), "--advantage-estimator", "grpo", "--eps-clip", "0.2",
        "--eps-clip-high", str(opts.eps_clip_high), "--seed", str(opts.seed),
        "--log-dir", str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(opts.threads)}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"furlong train failed ({done.returncode}):\n{done.stderr[-4000:]}")
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "rollout/step" in r]
    parts = {"rollout": [r["perf/rollout_time"] for r in rows], "train": [r["perf/train_time"] for r in rows],
             "weight_sync": [r["perf/update_weights_time"] for r in rows]}
    if opts.furlong_async:  # generation overlaps training: an iteration is the wall time between two
        steps = [r["perf/step_time"] for r in rows]  # train steps (waiting for generation included)
        parts["wait"] = [r["perf/train_wait_time"] for r in rows]
    else:
        steps = [a + b + c for a, b, c in zip(*parts.values())]
    # inside train: the log-prob pass (pi_old, one forward) and the optimizer step(s)
    parts["log_probs"] = [r.get("perf/log_probs_time", 0.0) for r in rows]
    parts["actor_train"] = [r.get("perf/actor_train_time", 0.0) for r in rows]
    result = summarize(steps, parts, [r["rollout/raw_reward"] for r in rows], batch, overlapped=opts.furlong_async)
    result["wall_s"] = wall
    result["command"] = " ".join(cmd[1:])
    return result


# --------------------------------------------------------------------------- TRL


def run_trl_worker(opts, out: Path) -> dict:
    """Train with TRL's GRPOTrainer in this process; return the figures (see the module docstring)."""
    import torch

    torch.set_num_threads(opts.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    hf_logging.set_verbosity_error()
    batch = opts.prompts * opts.group
    rows = read_jsonl(opts.data / "train.jsonl")[: opts.prompts * opts.rollouts]
    if len(rows) < opts.prompts * opts.rollouts:
        raise SystemExit(f"{opts.data / 'train.jsonl'} has {len(rows)} rows; need {opts.prompts * opts.rollouts}.")
    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    sample = rows[0]["prompt"]
    if not opts.chat_template and tokenizer(sample)["input_ids"] != tokenizer(sample, add_special_tokens=False)["input_ids"]:
        raise SystemExit("the tokenizer adds special tokens to a plain prompt, furlong does not: use --chat-template")

    def prompt(p):  # a prompt that is already a list of chat messages goes to TRL as it is
        return [{"role": "user", "content": p}] if opts.chat_template and isinstance(p, str) else p
    dataset = Dataset.from_list([{"prompt": prompt(r["prompt"]), "label": str(r["label"])} for r in rows])

    def reward_boxed(completions, label, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [boxed_reward(t, lab) for t, lab in zip(texts, label)]

    config = GRPOConfig(
        output_dir=str(out), report_to="none", logging_steps=1, save_strategy="no", seed=opts.seed,
        max_steps=opts.rollouts, per_device_train_batch_size=opts.micro_batch,
        gradient_accumulation_steps=batch // opts.micro_batch, steps_per_generation=batch // opts.micro_batch,
        num_generations=opts.group, num_iterations=1, shuffle_dataset=False,
        max_completion_length=opts.max_len, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=opts.lr, lr_scheduler_type="constant", warmup_steps=0, beta=0.0,
        epsilon=0.2, epsilon_high=opts.eps_clip_high, scale_rewards="group", loss_type="grpo", optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-8, weight_decay=opts.weight_decay, max_grad_norm=1.0,
        use_vllm=False, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,  # TRL defaults: on, on
        disable_tqdm=True, dataloader_num_workers=0,
    )

    class Timed(GRPOTrainer):
        generation_times: list[float] = []

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                self.generation_times.append(time.perf_counter() - start)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    clock = StepClock()
    model = AutoModelForCausalLM.from_pretrained(opts.model, dtype=torch.float32)
    trainer = Timed(model=model, reward_funcs=[reward_boxed], args=config, train_dataset=dataset,
                    processing_class=tokenizer, callbacks=[clock])
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    gen = Timed.generation_times
    parts = {"rollout": gen, "train": [s - g for s, g in zip(clock.times, gen)]}
    result = summarize(clock.times, parts, rewards, batch)
    result["train_wall_s"] = wall
    return result


def run_trl(opts, out: Path) -> dict:
    """The TRL run in a subprocess of this script (``--trl-worker``), so neither run warms the other."""
    result_path = out / "trl_result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", "--result", str(result_path),
           *_shared_argv(opts)]
    env = {**os.environ, "OMP_NUM_THREADS": str(opts.threads), "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"TRL run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(result_path.read_text())
    result["wall_s"] = wall  # the whole process, like furlong's: imports, model load, training
    return result


# --------------------------------------------------------------------------- report


def report(info: dict, opts, furlong: dict, trl: dict) -> str:
    lines = [
        f"machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}, transformers "
        f"{info['transformers']}, trl {info['trl']}; {opts.threads} torch thread(s)",
        f"workload: {_shown(opts.model)}, {opts.rollouts} iterations of {opts.prompts} prompts x {opts.group} "
        f"samples = {opts.prompts * opts.group} samples, responses <= {opts.max_len} tokens, micro-batch "
        f"{opts.micro_batch}{' (TRL; furlong packs by tokens)' if opts.furlong_packing else ''}, lr {opts.lr}",
        *(["furlong: train-async (the next rollout generates while this one trains, one step off-policy); "
           "TRL: synchronous"] if opts.furlong_async else []),
        "",
        f"{'':28}{'furlong':>12}{'TRL':>12}{'furlong speed-up':>18}",
    ]

    def line(label, a, b, fmt="{:.2f}", rate=False):
        """One row; the last column is how many times faster furlong is (TRL's seconds over furlong's,
        furlong's rate over TRL's), so above 1x always favours furlong."""
        speed_up = (a / b if rate else b / a) if a and b else None
        ratio = f"{speed_up:.2f}x" if speed_up is not None else "-"
        lines.append(f"{label:28}{fmt.format(a):>12}{fmt.format(b):>12}{ratio:>18}")

    line("s / iteration", furlong["s_per_iteration"], trl["s_per_iteration"])
    line("  median s / iteration", furlong["s_per_iteration_median"], trl["s_per_iteration_median"])
    line("samples / s", furlong["samples_per_s"], trl["samples_per_s"], rate=True)
    line("  rollout (gen + reward) s", furlong["split_s"]["rollout"], trl["split_s"]["rollout"])
    line("  train s", furlong["split_s"]["train"], trl["split_s"]["train"])
    lines.append(f"{'    log-prob pass s':28}{furlong['split_s']['log_probs']:>12.2f}{'(none)':>12}")
    lines.append(f"{'    forward+backward+step s':28}{furlong['split_s']['actor_train']:>12.2f}"
                 f"{trl['split_s']['train']:>12.2f}")
    rest = furlong["split_s"]["train"] - furlong["split_s"]["log_probs"] - furlong["split_s"]["actor_train"]
    lines.append(f"{'    batching, advantages s':28}{rest:>12.2f}{'-':>12}")
    lines.append(f"{'  weight sync s':28}{furlong['split_s']['weight_sync']:>12.3f}{'(shared)':>12}")
    if "wait" in furlong["split_s"]:
        lines.append(f"{'  waiting for generation s':28}{furlong['split_s']['wait']:>12.3f}{'-':>12}")
    line("first iteration s", furlong["first_iteration_s"], trl["first_iteration_s"])
    line("wall s (incl. start-up)", furlong["wall_s"], trl["wall_s"], "{:.1f}")
    lines.append(f"{'reward first -> last':28}{furlong['reward_first']:>6.2f}->{furlong['reward_last']:.2f}"
                 f"{trl['reward_first']:>8.2f}->{trl['reward_last']:.2f}")
    last = f"reward, mean of last {min(3, opts.rollouts)}"
    lines.append(f"{last:28}{furlong['reward_mean_last3']:>12.3f}{trl['reward_mean_last3']:>12.3f}")
    lines.append("")
    lines.append("Means exclude the first iteration (warm-up). TRL generates with the training model itself, "
                 "so it has no weight sync;\nwith one optimizer step per iteration both take pi_old from the "
                 "training forward pass (furlong: --reuse-train-log-probs, its default; log-prob pass 0).")
    if opts.furlong_async:
        lines.append("furlong's s / iteration is the wall time between two train steps (perf/step_time): its rollout "
                     "and train rows overlap\nand do not add up. Its means also exclude the last iteration, which "
                     "trains with no rollout generating beside it.")
    return "\n".join(lines)


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def _shared_argv(opts) -> list[str]:
    return ["--model", str(opts.model), "--data", str(opts.data), "--rollouts", str(opts.rollouts),
            "--prompts", str(opts.prompts), "--group", str(opts.group), "--micro-batch", str(opts.micro_batch),
            "--max-len", str(opts.max_len), "--lr", str(opts.lr), "--weight-decay", str(opts.weight_decay),
            "--eps-clip-high", str(opts.eps_clip_high), "--threads", str(opts.threads), "--seed", str(opts.seed),
            *(["--chat-template"] if opts.chat_template else [])]


def default_threads() -> int:
    """OMP_NUM_THREADS when it is a positive integer, else this machine's cores capped at 4."""
    flagged = os.environ.get("OMP_NUM_THREADS", "")
    if flagged.isdigit() and int(flagged) > 0:
        return int(flagged)
    return max(1, min(os.cpu_count() or 1, 4))


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO / "model", help="HF model folder")
    parser.add_argument("--data", type=Path, default=DEMO / "data", help="folder with train.jsonl (prompt, label)")
    parser.add_argument("--rollouts", type=int, default=10, help="iterations (rollouts = optimizer steps)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per iteration (demo: 32)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt, TRL num_generations (demo: 8)")
    parser.add_argument("--micro-batch", type=int, default=64,
                        help="samples per forward/backward pass, TRL per_device_train_batch_size (demo: 64)")
    parser.add_argument("--furlong-packing", action="store_true",
                        help="furlong packs micro-batches by tokens (what furlong does without --micro-batch-size) instead "
                             "of taking --micro-batch samples each; TRL keeps --micro-batch")
    parser.add_argument("--furlong-async", action="store_true",
                        help="furlong runs train-async (generation of the next rollout overlaps training, one "
                             "step off-policy) instead of train; TRL stays synchronous")
    parser.add_argument("--max-len", type=int, default=12, help="maximum response tokens (demo: 12)")
    parser.add_argument("--lr", type=float, default=1e-4, help="constant learning rate (demo: 1e-4)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (demo: 0)")
    parser.add_argument("--eps-clip-high", type=float, default=0.28, help="upper clip range (demo: 0.28)")
    parser.add_argument("--threads", type=int, default=default_threads(),
                        help="torch threads (OMP_NUM_THREADS when set, else this machine's cores, at most 4)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of both runs (sampling)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run furlong and TRL this many times, alternating; the full table is the median round's "
                             "(of an even number, the lower of the two middle ones), whose speed-up the summary gives")
    parser.add_argument("--chat-template", action="store_true", help="apply the tokenizer's chat template to prompts")
    parser.add_argument("--out", type=Path, default=None,
                        help="keep the runs' files here, in furlong/ and trl/, replaced by each invocation and round "
                             "(without it: a temporary folder, deleted after)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    for flag, value in (("--rounds", opts.rounds), ("--threads", opts.threads), ("--micro-batch", opts.micro_batch)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if opts.rollouts < 2:
        parser.error(f"--rollouts must be at least 2 (the means leave the first, warm-up, iteration out), got "
                     f"{opts.rollouts}")
    if (opts.prompts * opts.group) % opts.micro_batch:
        parser.error(f"--micro-batch {opts.micro_batch} must divide --prompts x --group = {opts.prompts * opts.group}")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    opts.model, opts.data = opts.model.resolve(), opts.data.resolve()
    if opts.trl_worker:
        result = run_trl_worker(opts, opts.result.parent)
        opts.result.write_text(json.dumps(result))
        return 0
    if not (opts.model / "config.json").is_file():
        raise SystemExit(f"no model at {opts.model}: build the demo first (python examples/demo/make_demo.py)")
    info = machine_info()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench_demo_") as tmp:
        out = (opts.out or Path(tmp)).resolve()
        for k in range(opts.rounds):
            for side in ("furlong", "trl"):  # furlong appends to an existing metrics.jsonl: start each run afresh
                shutil.rmtree(out / side, ignore_errors=True)
                (out / side).mkdir(parents=True)
            label = f" (round {k + 1} of {opts.rounds})" if opts.rounds > 1 else ""
            print(f"furlong: {opts.rollouts} rollouts{label} ...", flush=True)
            furlong = run_furlong(opts, out / "furlong")
            print(f"TRL GRPOTrainer: {opts.rollouts} steps{label} ...", flush=True)
            rounds.append((furlong, run_trl(opts, out / "trl")))
    speed_ups = [trl["s_per_iteration"] / furlong["s_per_iteration"] for furlong, trl in rounds]
    middle = sorted(range(len(rounds)), key=speed_ups.__getitem__)[(len(rounds) - 1) // 2]
    furlong, trl = rounds[middle]
    print(report(info, opts, furlong, trl))
    if len(rounds) > 1:
        print(rounds_summary(rounds, speed_ups, middle))
    if opts.json:
        opts.json.write_text(json.dumps({
            "machine": info, "options": {k: str(v) for k, v in vars(opts).items()}, "furlong": furlong, "trl": trl,
            "rounds": [{"furlong_s_per_iteration": f["s_per_iteration"], "trl_s_per_iteration": t["s_per_iteration"],
                        "speed_up": x} for (f, t), x in zip(rounds, speed_ups)],
            "median_round": middle + 1, "speed_up_median": speed_ups[middle]}, indent=2))
    return 0


def rounds_summary(rounds: list[tuple[dict, dict]], speed_ups: list[float], middle: int) -> str:
    """One line per round (seconds per iteration of each, furlong's speed-up) and the median speed-up."""
    lines = ["", f"{'round':28}{'furlong s/iter':>15}{'TRL s/iter':>12}{'furlong speed-up':>18}"]
    for k, ((furlong, trl), speed_up) in enumerate(zip(rounds, speed_ups)):
        mark = "  (the table above)" if k == middle else ""
        lines.append(f"{k + 1:<28}{furlong['s_per_iteration']:>15.3f}{trl['s_per_iteration']:>12.3f}"
                     f"{speed_up:>17.2f}x{mark}")
    lower = " (the lower of the two middle rounds)" if len(rounds) % 2 == 0 else ""
    lines.append(f"median speed-up over {len(rounds)} rounds: {speed_ups[middle]:.2f}x{lower} "
                 f"(range {min(speed_ups):.2f}x-{max(speed_ups):.2f}x)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
