"""The ``sglang`` engine's command lines: ``sglang.launch_server``, ``furlong serve`` and the router."""

import json
import logging
import sys

import pytest

from furlong.builtin_plugins.engines.sglang.launch import (FORCED, ServerPlace, router_command, server_command,
                                                           sglang_server_args)
from furlong.core.config import parse_args
from furlong.core.config.launch_args import launch_config
from furlong.core.plugins.manager import get_plugin_manager

BASE = ["--hf-checkpoint", "/models/qwen", "--rollout-backend", "sglang", "--rollout-num-gpus", "4",
        "--rollout-num-gpus-per-engine", "2", "--seed", "7", "--executor", "local", "--num-rollout", "1",
        "--num-gpus-per-node", "8",
        "--rollout-batch-size", "1"]
PLACE = ServerPlace(1, "10.0.0.5", 15001, nccl_port=16001, dist_init_addr="10.0.0.5:17001", base_gpu_id=2)


def run_config(*extra):
    """The configuration of a run with ``BASE`` and ``extra`` (no plugin's ``configure``: nothing is started)."""
    return launch_config(*BASE, *extra, configure=False)


def pairs(argv):
    """``--flag value`` pairs and bare flags of an argument list, in order."""
    out, i = [], 0
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append((argv[i], argv[i + 1]))
            i += 2
        else:
            out.append((argv[i], True))
            i += 1
    return out


def test_forced_arguments_place_the_server_and_tie_it_to_the_run():
    argv = sglang_server_args(run_config(), PLACE)
    assert pairs(argv) == [
        ("--model-path", "/models/qwen"), ("--trust-remote-code", True), ("--random-seed", "8"), ("--tp-size", "2"),
        ("--host", "10.0.0.5"), ("--port", "15001"), ("--nccl-port", "16001"), ("--nnodes", "1"),
        ("--node-rank", "0"), ("--dist-init-addr", "10.0.0.5:17001"), ("--base-gpu-id", "2"),
        ("--gpu-id-step", "1"), ("--skip-server-warmup", True), ("--enable-metrics", True)]


def test_pass_through_flags_follow_and_forced_ones_are_ignored_with_a_warning(caplog):
    config = run_config("--sglang-mem-fraction-static", "0.7", "--sglang-enable-dp-attention", "--sglang-dp-size", "2",
                        "--sglang-port", "9999", "--sglang-random-seed", "1", "--sglang-enable-metrics", "--fp16")
    with caplog.at_level(logging.WARNING, logger="furlong.engines.sglang"):
        argv = sglang_server_args(config, PLACE)
    got = dict(pairs(argv))
    assert (got["--port"], got["--random-seed"]) == ("15001", "8")
    assert (got["--mem-fraction-static"], got["--dp-size"], got["--enable-dp-attention"]) == ("0.7", "2", True)
    assert got["--dtype"] == "float16"
    assert argv.count("--enable-metrics") == 1 and argv.count("--port") == 1
    assert [r.getMessage() for r in caplog.records] == [
        "--sglang-port, --sglang-random-seed: furlong sets these SGLang arguments itself; the values given are "
        "ignored."]


def test_memory_saver_follows_offload_rollout():
    got = dict(pairs(sglang_server_args(run_config("--offload-rollout"), PLACE)))
    assert (got["--enable-memory-saver"], got["--nnodes"], got["--base-gpu-id"]) == (True, "1", "2")
    assert "--enable-memory-saver" not in sglang_server_args(run_config(), PLACE)


def test_deterministic_mode_turns_on_sglang_deterministic_inference():
    assert "--enable-deterministic-inference" in sglang_server_args(run_config("--deterministic-mode"), PLACE)
    assert "--enable-deterministic-inference" not in sglang_server_args(run_config(), PLACE)


def test_every_forced_argument_is_set():
    argv = sglang_server_args(run_config("--offload-rollout"), PLACE)
    assert {"--" + k.replace("_", "-") for k in FORCED} <= set(argv)


def test_server_command_by_implementation():
    config = run_config("--sglang-server-impl", "sglang")
    assert server_command(config, PLACE)[:3] == [sys.executable, "-m", "sglang.launch_server"]
    config = run_config("--sglang-server-impl", "furlong")
    assert server_command(config, PLACE) == [sys.executable, "-m", "furlong.core", "serve", "--hf-checkpoint",
                                             "/models/qwen", "--host", "10.0.0.5", "--port", "15001", "--seed", "8",
                                             "--embedded-max-batch-size", "64"]
    # furlong serve runs the embedded engine: its flags reach it
    config = run_config("--sglang-server-impl", "furlong", "--embedded-max-batch-size", "128", "--embedded-torch-compile")
    assert server_command(config, PLACE)[-3:] == ["--embedded-max-batch-size", "128", "--embedded-torch-compile"]


@pytest.mark.parametrize("impl, refused", [("sglang", True), ("furlong", False)])
def test_embedded_engine_flags_are_refused_for_sglang_servers(impl, refused):
    from furlong.builtin_plugins.engines.sglang import configure
    from furlong.hooks import ConfigReport

    args = parse_args(BASE + ["--embedded-torch-compile", "--sglang-server-impl", impl, "--sglang-router-ip",
                              "127.0.0.1", "--sglang-router-port", "3000"], get_plugin_manager())
    report = ConfigReport("sglang")
    configure(args, report)
    messages = [m for m in report.errors if "--embedded-torch-compile" in m]
    assert bool(messages) == refused
    if refused:
        assert "--sglang-enable-torch-compile" in messages[0]


@pytest.mark.parametrize("extra, expected", [
    ([], ["--host", "127.0.0.1", "--port", "3123", "--request-timeout-secs", "14400", "--prometheus-port", "29123"]),
    (["--sglang-router-policy", "round_robin", "--router-balance-abs-threshold", "0", "--router-prometheus-port",
      "29999"],
     ["--host", "127.0.0.1", "--port", "3123", "--request-timeout-secs", "14400", "--prometheus-port", "29999",
      "--policy", "round_robin", "--balance-abs-threshold", "0"]),
])
def test_router_command(extra, expected):
    args = parse_args(BASE + extra)
    assert router_command(args, "sglang_router.launch_router", "127.0.0.1", 3123, 29123) == [
        sys.executable, "-m", "sglang_router.launch_router", *expected]


def configure(extra):
    from furlong.builtin_plugins.engines import sglang
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.hooks import ConfigReport

    args = parse_args(BASE + ["--sglang-router-ip", "127.0.0.1", "--sglang-router-port", "3999"] + extra,
                      get_plugin_manager())
    report = ConfigReport("sglang")
    sglang.configure(args=args, report=report)
    return args, report


@pytest.mark.parametrize("extra, error", [
    (["--rollout-external"],
     "--rollout-external needs --rollout-external-engine-addrs HOST:PORT ... (one per server)."),
    (["--rollout-external-engine-addrs", "a:1"],
     "--rollout-external-engine-addrs is used only with --rollout-external; add it."),
    (["--rollout-external", "--rollout-external-engine-addrs", "a:1", "b"],
     "--rollout-external-engine-addrs b: each address must be HOST:PORT."),
    (["--rollout-external", "--rollout-external-engine-addrs", "a:1", "b:2", "c:3"],
     "--rollout-num-gpus 4 does not match the 3 external server(s) of --rollout-external-engine-addrs x "
     "--rollout-num-gpus-per-engine 2."),
    (["--sglang-server-restarts", "-1"], "--sglang-server-restarts must be at least 0, got -1."),
    (["--num-gpus-per-node", "1"], "--rollout-num-gpus-per-engine 2 is more than --num-gpus-per-node 1: an SGLang "
     "server spanning nodes is not supported yet; use at most 1 GPUs per engine (or start the servers yourself: "
     "--rollout-external)."),
    (["--executor", "ray"], "--rollout-num-gpus-per-engine 2 under --executor ray: an engine actor sees only its "
     "first GPU, so a tensor-parallel SGLang server is not supported yet there; use --executor local on one "
     "machine, or --rollout-external with servers you start."),
])
def test_configure_refuses_inconsistent_server_flags(extra, error):
    _, report = configure(["--sglang-server-impl", "furlong"] + extra)
    assert report.errors == [error]


def test_external_servers_give_the_engine_count_and_a_given_router_is_used_as_is():
    args, report = configure(["--rollout-external", "--rollout-external-engine-addrs", "a:1", "b:2"])
    assert report.errors == []
    assert (args.rollout_num_gpus, args.sglang_router_ip, args.sglang_router_port, args.sglang_router_given) == (
        4, "127.0.0.1", 3999, True)


def test_the_sglang_server_needs_the_sglang_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    _, report = configure([])
    assert report.errors == ['--sglang-server-impl sglang needs SGLang: pip install "furlong[sglang]" on a GPU '
                             "machine (or --sglang-server-impl furlong to serve the model with furlong's own engine)."]


def test_print_config_only_warns_that_the_sglang_package_is_missing(monkeypatch):
    """--print-config checks a cluster's launch script on a laptop: the missing package is the cluster's business."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    _, report = configure(["--print-config"])
    assert report.errors == [] and report.warnings[0].endswith("(not needed for --print-config)")


@pytest.mark.parametrize("extra, firsts", [
    ([], [1, 3]),  # the trainer's one GPU (the default flags), then two GPUs per engine
    (["--colocate", "--actor-num-gpus-per-node", "4", "--global-batch-size", "4", "--n-samples-per-prompt", "4"], [0, 2]),
    (["--actor-num-gpus-per-node", "2", "--global-batch-size", "4", "--n-samples-per-prompt", "4"], [2, 4]),
    (["--actor-num-gpus-per-node", "4", "--global-batch-size", "4", "--n-samples-per-prompt", "4"], [4, 6]),
])
def test_each_local_engine_s_server_starts_on_its_own_gpus(extra, firsts):
    from furlong.builtin_plugins.engines.sglang import _base_gpu_id

    args = parse_args(BASE + extra, get_plugin_manager())
    assert [_base_gpu_id(args, i) for i in range(2)] == firsts


def test_print_config_does_not_judge_gpus_per_node_by_this_machine():
    """A cluster script checked on a laptop: --num-gpus-per-node defaults to this machine's GPU count."""
    _, report = configure(["--num-gpus-per-node", "1", "--print-config"])
    assert report.errors == []


def test_rollout_external_needs_the_sglang_engine():
    from furlong.core.config.errors import ConfigError
    from furlong.core.config.launch_args import launch_config

    with pytest.raises(ConfigError, match="--rollout-external and --rollout-external-engine-addrs attach to SGLang "
                                          "servers: they need --rollout-backend sglang."):
        launch_config("--num-rollout", "1", "--rollout-batch-size", "1", "--rollout-external")  # embedded's configure


def test_print_config_starts_no_router(capsys):
    from furlong.core.cli.commands import main

    assert main(["train", *BASE, "--sglang-server-impl", "furlong", "--print-config"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["args"]["sglang_router_ip"] is None and data["args"]["sglang_router_port"] is None
