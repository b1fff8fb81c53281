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
import json
import signal
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from furlong.hooks import PluginError, hookimpl

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
    def on_rollout_end(self, config, rollout_id, metrics):
        self.router = f"http://{config.sglang_router_ip}:{config.sglang_router_port}"
        urls = self.workers()
        self.versions[rollout_id] = {url: get(url, "/model_info")["weight_version"] for url in urls}
        if self.prompt_ids is None:
            from transformers import AutoTokenizer

            first = json.loads((DEMO / "data" / "train.jsonl").read_text().splitlines()[0])
            self.prompt_ids = AutoTokenizer.from_pretrained(config.hf_checkpoint)(first["prompt"])["input_ids"]
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
    """A user module recording every group each rollout finished (``--rollout-all-samples-process-path``)."""
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


def demo_argv(save: Path) -> list[str]:
    return ["--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--rm-type", "math", "--rollout-shuffle",
            "--num-rollout", str(NUM_ROLLOUT), "--rollout-batch-size", str(PROMPTS),
            "--n-samples-per-prompt", str(SAMPLES), "--global-batch-size", str(PROMPTS * SAMPLES),
            "--rollout-max-response-len", "12", "--rollout-temperature", "1.0", "--advantage-estimator", "grpo",
            "--lr", "2e-4", "--weight-decay", "0.0", "--micro-batch-size", "64", "--save", str(save),
            "--save-interval", "1000", "--executor", "local"]


def train(argv: list[str], *observers) -> None:
    """``furlong train`` in this process (observers registered in-process); the router stops at the end."""
    from furlong.builtin_plugins.engines.sglang import stop_routers
    from furlong.core.config import parse_args
    from furlong.core.config import build_parser
    from furlong.core.config.configure import configure_plugins
    from furlong.core.config.freeze import freeze_config
    from furlong.core.run.loop import run as run_loop
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection

    pm = get_plugin_manager()
    for i, observer in enumerate(observers):
        pm.register(observer, f"observer-{i}")
    args = parse_args(argv, pm)
    selection = resolve_selection(args, pm)
    try:
        configured = configure_plugins(args, pm, selection)
        asyncio.run(run_loop(freeze_config(args, build_parser(pm).plugin_flags, configured.derived), pm, selection))
    finally:
        stop_routers()


def rollout_rows(save: Path) -> list[dict]:
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "rollout/step" in r]


@pytest.fixture(scope="module")
def run(tmp_path_factory, samples_module):
    """The demo for NUM_ROLLOUT rollouts with the sglang engine on two furlong serve processes."""
    save = tmp_path_factory.mktemp("sglang-run")
    probe = Probe()
    train(demo_argv(save) + ["--rollout-backend", "sglang", "--sglang-server-impl", "furlong",
                             "--rollout-num-gpus", "2", "--sglang-router-policy", "round_robin",
                             "--rollout-all-samples-process-path", "sglang_probe_samples.record"], probe)
    return {"probe": probe, "rows": rollout_rows(save), "samples": list(samples_module.ROLLOUTS)}


@pytest.fixture(scope="module")
def embedded_run(tmp_path_factory):
    save = tmp_path_factory.mktemp("embedded-run")
    train(demo_argv(save) + ["--rollout-backend", "embedded"])
    return {"rows": rollout_rows(save)}


def test_rewards_rise_exactly_as_with_the_embedded_engine(run, embedded_run):
    """Sampling seeds are fixed per sample, so routing over two servers (one killed) changes no reward."""
    rewards = [r["rollout/raw_reward"] for r in run["rows"]]
    assert len(rewards) == NUM_ROLLOUT
    assert rewards == [r["rollout/raw_reward"] for r in embedded_run["rows"]]
    assert [r["rollout/response_lengths"] for r in run["rows"]] == [
        r["rollout/response_lengths"] for r in embedded_run["rows"]]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.05, rewards


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


# --- the client alone, against servers someone else started ----------------------------------------------------


@pytest.fixture(scope="module")
def fleet():
    """A router (round robin) and two furlong serve processes registered with it, started here, not by furlong."""
    from furlong.builtin_plugins.engines.sglang.launch import ManagedProcess
    from furlong.builtin_plugins.engines.sglang.router import start_router, stop_routers
    from furlong.core.config import parse_args
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.kit.dist import free_port

    base = ["--hf-checkpoint", str(DEMO / "model"), "--num-rollout", "1", "--rollout-batch-size", "1",
            "--rollout-backend", "sglang", "--executor", "local", "--sglang-router-policy", "round_robin"]
    router_port = free_port()
    start_router(parse_args(base + ["--rollout-num-gpus", "2"], get_plugin_manager()), "127.0.0.1", router_port,
                 free_port())
    ports = [free_port(), free_port()]
    servers = [ManagedProcess(f"serve {p}", [sys.executable, "-m", "furlong.core", "serve", "--hf-checkpoint",
                                              str(DEMO / "model"), "--port", str(p)]) for p in ports]
    try:
        addrs = [f"127.0.0.1:{p}" for p in ports]
        argv = base + ["--rollout-external", "--rollout-external-engine-addrs", *addrs,
                       "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", str(router_port)]
        yield {"argv": argv, "router": f"http://127.0.0.1:{router_port}", "urls": [f"http://{a}" for a in addrs]}
    finally:
        for server in servers:
            server.kill()
        stop_routers()


async def attach(fleet):
    """The two engines of ``--rollout-external``, through the plugin's own hooks; the servers join the router."""
    from furlong.builtin_plugins.engines import sglang
    from furlong.builtin_plugins.engines.sglang.http import shared_http, release_http
    from furlong.builtin_plugins.engines.sglang.router import register
    from furlong.core.config.launch_args import launch_config
    from furlong.core.plugins.manager import get_plugin_manager

    config = launch_config(*fleet["argv"], pm=get_plugin_manager())  # every chosen plugin configures, sglang too
    assert config.rollout_num_gpus == 2 and config.plugin_config("sglang").sglang_router_given
    http = shared_http(1)
    try:
        await asyncio.gather(*(register(http, fleet["router"], url, alive=None) for url in fleet["urls"]))
    finally:
        await release_http()
    engines = []
    for index in range(2):
        engines.append(await sglang.rollout_engine(config=config, engine_index=index))
    assert [e.url for e in engines] == fleet["urls"] and not any(e.register_with_router for e in engines)
    return engines


def test_abort_returns_the_tokens_generated_so_far(fleet):
    async def main():
        engines = await attach(fleet)
        try:
            prompt = [1, 5, 9, 13]
            params = {"temperature": 0, "max_new_tokens": 56, "ignore_eos": True}
            full = await engines[0].generate(prompt, params)
            assert full.finish_reason == "length" and len(full.output_ids) == 56
            partial = []
            for delay in (0.005, 0.01, 0.02, 0.04, 0.08) * 2:
                request = asyncio.ensure_future(engines[0].generate(prompt, params))
                await asyncio.sleep(delay)
                await asyncio.gather(*(e.abort() for e in engines))
                out = await request
                if out.finish_reason == "abort":
                    assert out.output_ids == full.output_ids[:len(out.output_ids)]  # greedy: a prefix of the whole
                    assert out.output_log_probs == pytest.approx(full.output_log_probs[:len(out.output_ids)],
                                                                 abs=1e-5)
                    partial.append(len(out.output_ids))
            assert any(0 < n < 56 for n in partial), partial
        finally:
            await asyncio.gather(*(e.shutdown() for e in engines))

    asyncio.run(main())


def test_weights_reach_every_server_by_broadcast_over_gloo(fleet):
    """The Ray executor's transport: trainer rank 0 broadcasts over a group the servers join through HTTP."""
    import math
    import threading

    import torch

    from furlong.kit.dist import broadcast_bucket, free_port, new_weight_update_group

    async def main():
        engines = await attach(fleet)
        port, name, got = free_port(), "furlong_weight_sync_test", {}

        def trainer():
            got["group"] = new_weight_update_group("127.0.0.1", port, 0, 3, name, "gloo", timeout_s=60)

        thread = threading.Thread(target=trainer)
        thread.start()
        try:
            await asyncio.gather(*(e.init_weights_update_group("127.0.0.1", port, 1 + i, 3, name, "gloo")
                                   for i, e in enumerate(engines)))
            thread.join(60)
            # furlong serve follows SGLang 0.5.23: a broadcast bucket outside a weight-update session is refused
            assert [e.protocol.weight_session for e in engines] == [True, True]
            with pytest.raises(PluginError, match=r"sglang engine 0 .*SGLang 0\.5\.23 refused POST "
                                                  r"/update_weights_from_distributed: .* must run between "
                                                  r"begin_weight_update\(\) and end_weight_update\(\)"):
                await engines[0].update_weights_from_distributed(["lm_head.weight"], ["float32"], [[26, 128]], name)
            zeros = torch.zeros(26, 128)  # lm_head: every token equally likely afterwards
            await asyncio.gather(*(e.begin_weight_update() for e in engines))
            await asyncio.gather(asyncio.to_thread(broadcast_bucket, [zeros], got["group"]),
                                 *(e.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[26, 128]], name)
                                   for e in engines))
            await asyncio.gather(*(e.end_weight_update() for e in engines))
            await asyncio.gather(*(e.set_weight_version(7) for e in engines))
            assert [get(url, "/model_info")["weight_version"] for url in fleet["urls"]] == ["7", "7"]
            await asyncio.gather(*(e.release_memory() for e in engines))  # what --offload-rollout does
            await asyncio.gather(*(e.resume_memory() for e in engines))
            outs = [await e.generate([1, 5, 9], {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True,
                                                 "sampling_seed": 3}) for e in engines]
            for out in outs:
                assert out.weight_version == "7"
                assert out.output_log_probs == pytest.approx([-math.log(26)] * 4, abs=1e-5)
            await asyncio.gather(*(e.destroy_weights_update_group(name) for e in engines))
        finally:
            thread.join(60)
            await asyncio.gather(*(e.shutdown() for e in engines))

    asyncio.run(main())


# --- the Ray executor: engine actors start the servers, weights travel by broadcast -----------------------------


def _server_processes() -> set[str]:
    """Servers and routers this interpreter started (other checkouts on the machine run their own)."""
    import subprocess

    # -ww: whole command lines; under pytest COLUMNS may cut them before the marker
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    return {line.strip() for line in out if sys.executable in line
            and ("furlong.core serve" in line or "sglang_router.launch_router" in line)}


def test_ray_engine_actors_start_servers_that_take_every_weight_version(tmp_path, run_furlong):
    """One server is killed after rollout 0's generation: its engine actor is replaced at that sync."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sglang_versions.py").write_text(textwrap.dedent('''
        import json, os, signal, urllib.request

        import psutil

        KILLED = []

        def record(args, all_groups, data_source):
            # in the rollout-manager actor, as a custom generate function would: the router from args
            router = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
            body = json.dumps({"input_ids": [1, 5, 9], "sampling_params": {"max_new_tokens": 2}}).encode()
            request = urllib.request.Request(router + "/generate", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                routed = json.loads(response.read())["meta_info"]["weight_version"]
            if not KILLED:  # after rollout 0's generation, before its weight sync: one server dies
                with urllib.request.urlopen(router + "/workers", timeout=60) as response:
                    port = int(json.loads(response.read())["workers"][0]["url"].rsplit(":", 1)[1])
                KILLED.extend(c.pid for c in psutil.net_connections("tcp")
                              if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN)
                os.kill(KILLED[0], signal.SIGKILL)
            with open(os.environ["SGLANG_VERSIONS_OUT"], "a") as out:
                out.write(json.dumps([v for g in all_groups for s in g for v in s.weight_versions] + [routed]) + "\\n")
    '''))
    out = tmp_path / "versions.jsonl"
    before = _server_processes()
    proc = run_furlong(
        "train", "--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
        "--input-key", "prompt", "--label-key", "label", "--rm-type", "math", "--num-rollout", "2",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
        "--micro-batch-size", "16", "--rollout-max-response-len", "8", "--lr", "1e-4", "--save", str(tmp_path / "run"),
        "--executor", "ray", "--rollout-backend", "sglang", "--sglang-server-impl", "furlong",
        "--rollout-num-gpus", "2", "--sglang-router-policy", "round_robin",
        "--rollout-all-samples-process-path", "sglang_versions.record",
        sites=[site], env={"SGLANG_VERSIONS_OUT": str(out), "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"},
        timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    versions = [json.loads(line) for line in out.read_text().splitlines()]
    assert [sorted(set(v)) for v in versions] == [["1"], ["2"]] and [len(v) for v in versions] == [17, 17]
    assert "registered" in proc.stderr and proc.stderr.count("sglang server") >= 3
    assert "weight sync: engine actor" in proc.stderr and "is gone; replacing it" in proc.stderr  # the dead server
    deadline = time.monotonic() + 20
    while _server_processes() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sorted(_server_processes() - before) == []
