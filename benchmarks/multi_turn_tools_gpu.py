"""Miles' multi-turn tool flags through a real SGLang server, against the embedded engine.

One command, from the repository root, on a machine with a CUDA GPU and the ``sglang`` package::

    python benchmarks/multi_turn_tools_gpu.py --json multi_turn_tools.json

It writes the scripted tool model of tests/tool_episode.py (a real one-layer Llama that calls
``get_year`` in Qwen 2.5's ``<tool_call>`` form, reads the result and answers; hidden size and
head size 64, which SGLang's attention kernels take), its tools module and a prompt file to a
temporary folder, then runs ``furlong train --debug-rollout-only`` once per engine with Miles'
flags (``--custom-generate-function-path miles.rollout.generate_hub.multi_turn.generate``,
``--generate-tool-call-parser qwen25``, ...) and ``--save-debug-rollout-data``. For each engine it
reports how many samples hold exactly the episode built by hand (tokens and loss masks: the
call and the answer trained, the tool turn masked) and the run's wall seconds; for SGLang, also
whether its samples equal the embedded engine's (tokens, masks) and the largest difference of
their rollout log-probs on trained tokens. Without CUDA or ``sglang`` the SGLang run is
skipped (said in the JSON): the embedded part checks this script on any machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from tool_episode import PROMPT, TOOLS_MODULE, build_tool_model, expected  # noqa: E402


def _sglang_missing() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA"
    if importlib.util.find_spec("sglang") is None:
        return "the sglang package is not installed"
    return None


def _run(folder: Path, model: Path, backend: str, prompts: int, extra: list[str]) -> tuple[list[dict], float, str]:
    out = folder / f"{backend}_{{rollout_id}}.pt"
    argv = [sys.executable, "-m", "furlong.core", "train", "--hf-checkpoint", str(model),
            "--prompt-data", str(folder / "train.jsonl"), "--input-key", "prompt", "--label-key", "label",
            "--rm-type", "deterministic_random", "--num-rollout", "1", "--rollout-batch-size", str(prompts),
            "--n-samples-per-prompt", "2", "--global-batch-size", str(2 * prompts), "--rollout-max-response-len",
            "32", "--debug-rollout-only", "--save-debug-rollout-data", str(out), "--rollout-backend", backend,
            "--custom-generate-function-path", "miles.rollout.generate_hub.multi_turn.generate",
            "--generate-tool-specs-path", "bench_tools.TOOLS", "--generate-execute-tool-function-path",
            "bench_tools.execute", "--generate-tool-call-parser", "qwen25", "--generate-max-turns", "4", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return [], seconds, (done.stdout + done.stderr)[-4000:]
    import torch

    return torch.load(str(out).format(rollout_id=0), weights_only=True)["samples"], seconds, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the figures to this file")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout (2 samples each)")
    parser.add_argument("--sglang-flags", nargs=argparse.REMAINDER, default=[],
                        help="extra flags for the SGLang run (e.g. --sglang-attention-backend triton)")
    opts = parser.parse_args()
    from transformers import AutoTokenizer

    result: dict = {"prompts": opts.prompts, "samples_per_run": 2 * opts.prompts}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "bench_tools.py").write_text(TOOLS_MODULE)
        (folder / "train.jsonl").write_text(
            "".join(json.dumps({"prompt": PROMPT, "label": "2026"}) + "\n" for _ in range(opts.prompts)))
        model = build_tool_model(folder / "model", strength=8.0, hidden=64)
        prompt, call, tool, answer = expected(AutoTokenizer.from_pretrained(model))
        want_tokens = prompt + call + tool + answer
        want_mask = [1] * len(call) + [0] * len(tool) + [1] * len(answer)
        runs = {}
        for backend, extra in (("embedded", []), ("sglang", opts.sglang_flags)):
            missing = _sglang_missing() if backend == "sglang" else None
            if missing:
                result[backend] = {"skipped": missing}
                continue
            samples, seconds, error = _run(folder, model, backend, opts.prompts, extra)
            runs[backend] = samples
            result[backend] = {
                "wall_s": round(seconds, 1), "samples": len(samples), "error": error or None,
                "as_built_by_hand": sum(s["tokens"] == want_tokens and s["loss_mask"] == want_mask for s in samples),
                "round_number": sorted({s["metadata"].get("round_number") for s in samples}),
            }
        if runs.get("embedded") and runs.get("sglang"):
            pairs = list(zip(runs["embedded"], runs["sglang"]))
            result["sglang_equals_embedded"] = {
                "tokens": all(a["tokens"] == b["tokens"] for a, b in pairs),
                "loss_masks": all(a["loss_mask"] == b["loss_mask"] for a, b in pairs),
                "max_abs_logprob_diff_trained": max(
                    (abs(x - y) for a, b in pairs for x, y, m in zip(a["rollout_log_probs"], b["rollout_log_probs"],
                                                                    a["loss_mask"]) if m), default=None),
            }
    text = json.dumps(result, indent=2)
    print(text)
    if opts.json:
        Path(opts.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
