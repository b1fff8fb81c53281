"""The ``sglang`` engine against two ``furlong serve`` processes behind the real sglang-router, on loopback.

One training run on the demo (the local executor starts the router and both servers):
rewards rise; after every weight sync each server reports the new version and both give
the same greedy output; a server killed in the middle of a rollout's generation loses no
sample (the router fails over) and is restarted with the current weights at the next sync.
Then the client alone against two servers it did not start (``--rollout-external``):
an abort returns the tokens generated so far.
"""

from __future__ import annotations

import asyncio
import copy
import json
import signal
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from furlong.hooks import hookimpl

pytest.importorskip("sglang_router", reason='the router extra: pip install "furlong[router]"')

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "demo"
NUM_ROLLOUT = 6
PROMPTS, SAMPLES = 16, 8
KILL_IN_ROLLOUT, KILL_AFTER_REWARDS = 3, 40


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as response:
        return json.loads(response.read())


def post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def listening_pid(port: int) -> int:
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return conn.pid
    raise AssertionError(f"no process listens on port {port}")


class Probe:
    """An observer registered in-process: after each rollout (its weight sync done) asks every server."""

    def __init__(self):
        self.versions, self.greedy, self.router, self.killed = {}, {}, None, None
        self.rewards_seen = 0
        self.prompt_ids = None

    def workers(self) -> list[str]:
        return sorted(w["url"] for w in get(self.router, "/workers")["workers"])

    @hookimpl
    def on_rollout_end(self, args, rollout_id, metrics):
        self.router = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
        urls = self.workers()
        self.versions[rollout_id] = {url: get(url, "/model_info")["weight_version"] for url in urls}
        if self.prompt_ids is None:
            from transformers import AutoTokenizer

            first = json.loads((DEMO / "data" / "train.jsonl").read_text().splitlines()[0])
            self.prompt_ids = AutoTokenizer.from_pretrained(args.hf_checkpoint)(first["prompt"])["input_ids"]
        greedy = {"input_ids": self.prompt_ids, "return_logprob": True,
                  "sampling_params": {"temperature": 0, "max_new_tokens": 12}}

        def answer(url):
            meta = post(url, "/generate", greedy)["meta_info"]
            return tuple((token, logprob) for logprob, token, _ in meta["output_token_logprobs"])

        outputs = {url: answer(url) for url in urls}
        outputs["router"] = answer(self.router)  # as a custom generate function posting to the router does
        self.greedy[rollout_id] = outputs

    @hookimpl
    def on_hook_call(self, hook, plugin, seconds, error):
        """Kill one server (SIGKILL) in the middle of rollout KILL_IN_ROLLOUT's generation."""
        if hook != "reward" or self.killed is not None or len(self.versions) != KILL_IN_ROLLOUT:
            return
        self.rewards_seen += 1
        if self.rewards_seen == KILL_AFTER_REWARDS:
            url = self.workers()[0]
            self.killed = url
            import os

            os.kill(listening_pid(int(url.rsplit(":", 1)[1])), signal.SIGKILL)


@pytest.fixture(scope="module")
def samples_module(tmp_path_factory):
    """A user module whose function records every group each rollout finished (``--rollout-all-samples-process-path``)."""
    site = tmp_path_factory.mktemp("site")
    (site / "sglang_probe_samples.py").write_text(textwrap.dedent('''
        ROLLOUTS = []

        def record(args, all_groups, data_source):
            ROLLOUTS.append([(s.index, s.status.value, list(s.weight_versions)) for g in all_groups for s in g])
    '''))
    sys.path.insert(0, str(site))
    import sglang_probe_samples

    yield sglang_probe_samples
    sys.path.remove(str(site))
    sys.modules.pop("sglang_probe_samples", None)


@pytest.fixture(scope="module")
def run(tmp_path_factory, samples_module):
    """The demo for NUM_ROLLOUT rollouts with the sglang engine on two furlong serve processes."""
    from furlong.builtin_plugins.engines.sglang import stop_routers
    from furlong.core.config import parse_args
    from furlong.core.configure import configure_plugins
    from furlong.core.loop import run as run_loop
    from furlong.core.plugins import get_plugin_manager
    from furlong.core.selection import resolve_selection

    save = tmp_path_factory.mktemp("sglang-run")
    argv = ["--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--rm-type", "math", "--rollout-shuffle",
            "--num-rollout", str(NUM_ROLLOUT), "--rollout-batch-size", str(PROMPTS),
            "--n-samples-per-prompt", str(SAMPLES), "--global-batch-size", str(PROMPTS * SAMPLES),
            "--rollout-max-response-len", "12", "--rollout-temperature", "1.0", "--advantage-estimator", "grpo",
            "--lr", "2e-4", "--weight-decay", "0.0", "--micro-batch-size", "64", "--save", str(save),
            "--save-interval", "1000", "--executor", "local",
            "--rollout-backend", "sglang", "--sglang-server-impl", "furlong", "--rollout-num-gpus", "2",
            "--sglang-router-policy", "round_robin",
            "--rollout-all-samples-process-path", "sglang_probe_samples.record"]
    pm = get_plugin_manager()
    probe = Probe()
    pm.register(probe, "sglang-probe")
    args = parse_args(argv, pm)
    selection = resolve_selection(args, pm)
    start = time.monotonic()
    try:
        configure_plugins(args, pm, selection)
        asyncio.run(run_loop(args, pm, selection))
    finally:
        stop_routers()
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return {"probe": probe, "args": args, "rows": [r for r in rows if "rollout/step" in r],
            "samples": list(samples_module.ROLLOUTS), "seconds": time.monotonic() - start}


def test_rewards_rise_through_the_router(run):
    rewards = [r["rollout/raw_reward"] for r in run["rows"]]
    assert len(rewards) == NUM_ROLLOUT
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.02, rewards


def test_every_server_reports_each_new_weight_version(run):
    versions = run["probe"].versions
    assert sorted(versions) == list(range(NUM_ROLLOUT))
    for rollout_id, by_server in versions.items():
        assert len(by_server) == 2, by_server  # the killed server is back by then
        assert set(by_server.values()) == {str(rollout_id + 2)}, (rollout_id, by_server)  # the first sync is 1
    for rollout_id, samples in enumerate(run["samples"]):
        assert {v for _, _, vs in samples for v in vs} == {str(rollout_id + 1)}


def test_both_servers_give_the_same_greedy_output_after_each_sync(run):
    greedy = run["probe"].greedy
    for rollout_id, outputs in greedy.items():
        assert len(outputs) == 3 and len(set(outputs.values())) == 1, (rollout_id, outputs)  # ids and log-probs
    assert len({o["router"] for o in greedy.values()}) == NUM_ROLLOUT  # the weights changed at every sync


def test_a_server_killed_mid_rollout_loses_and_duplicates_no_sample(run):
    probe = run["probe"]
    assert probe.killed is not None and probe.rewards_seen >= KILL_AFTER_REWARDS
    assert len(run["samples"]) == NUM_ROLLOUT
    for samples in run["samples"]:
        indices = [index for index, _, _ in samples]
        assert len(indices) == PROMPTS * SAMPLES and len(set(indices)) == len(indices)
        assert {status for _, status, _ in samples} <= {"completed", "truncated"}
