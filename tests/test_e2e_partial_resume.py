"""Partial rollout across a restart: the buffer and sample counters live in the checkpoint.

On the committed timeline, drawn = trained + filtered + surplus + aborted_dropped + buffered
(+ held by a fully async producer), in every saved state and after resuming.
"""

import asyncio
import json

from furlong.core.config.launch_args import launch_config
from furlong.core.run.loop import run
from furlong.core.plugins.manager import get_plugin_manager
from furlong.core.plugins.selection import resolve_selection


def _run(argv):
    pm = get_plugin_manager()
    config = launch_config(*argv, pm=pm)
    asyncio.run(run(config, pm, resolve_selection(config, pm)))


def _balanced(state):
    c = state["counters"]
    buffered = len(state["buffer"])
    return c["drawn"] == c["trained"] + c["filtered"] + c["surplus"] + c["aborted_dropped"] + buffered + c.get("held", 0)


def test_buffer_and_counters_survive_a_restart(tmp_path, tiny_model_dir, arithmetic_jsonl):
    save = tmp_path / "save"
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(arithmetic_jsonl), "--input-key", "prompt",
            "--label-key", "label", "--rm-type", "math", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--over-sampling-batch-size", "4", "--partial-rollout",
            "--rollout-max-response-len", "8", "--save", str(save), "--load", str(save), "--save-interval", "1"]
    _run(argv + ["--num-rollout", "2"])
    first = json.loads((save / "rollout" / "state_1.json").read_text())
    assert _balanced(first)
    # Each rollout draws 4 groups and trains on 2; the rest waits in the buffer (or was surplus).
    assert first["counters"]["trained"] == 4
    assert len(first["buffer"]) + first["counters"]["surplus"] + first["counters"]["aborted_dropped"] > 0
    _run(argv + ["--num-rollout", "4"])
    for rid in (2, 3):
        state = json.loads((save / "rollout" / f"state_{rid}.json").read_text())
        assert _balanced(state), state["counters"]
    last = json.loads((save / "rollout" / "state_3.json").read_text())
    assert last["counters"]["trained"] == 8
    # Buffered groups popped after the restart were trained on: the resumed run started with
    # rollout 1's buffer, so its first rollout drew fewer fresh groups than 4.
    resumed = json.loads((save / "rollout" / "state_2.json").read_text())
    assert resumed["counters"]["drawn"] - first["counters"]["drawn"] <= 4
