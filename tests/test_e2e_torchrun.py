"""`furlong train` under torchrun with two trainer ranks (gloo on CPU) against one process.

Rank 0 generates; both ranks train on their share of every step with the whole step's
denominators, so the two-rank run must reproduce the one-process run: the same rollouts
(rewards), the same step losses and gradient norms, the same checkpointed weights; and
only rank 0 writes metrics, checkpoint state and the marker.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from furlong.builtin_plugins.executors.local import InProcessWorkers, LocalExecutor, configure, executor
from furlong.builtin_plugins.executors.torchrun import TorchrunExecutor
from furlong.core.config.launch_args import launch_args
from furlong.hooks.config_report import ConfigReport


def _flags(model, data, rollouts=2):
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "prompt",
            "--label-key", "label", "--rm-type", "deterministic_random", "--num-rollout", str(rollouts),
            "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "4", "--global-batch-size", "8", "--micro-batch-size", "2",
            "--rollout-max-response-len", "6", "--lr", "1e-3", "--use-kl-loss", "--kl-loss-coef", "0.1",
            "--eval-prompt-data", "arith", str(data), "--eval-interval", "1", "--n-samples-per-eval-prompt", "1",
            "--save-interval", "1"]


def _rows(save, key):
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return {r[key]: r for r in rows if key in r}


def _run(cmd, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", ["train", "train-async"])
def test_two_trainer_ranks_reproduce_one_process(tmp_path, tiny_model_dir, arithmetic_jsonl, command):
    one, two = tmp_path / "one", tmp_path / "two"
    flags = [command, *_flags(tiny_model_dir, arithmetic_jsonl)]
    _run([sys.executable, "-m", "furlong.core", *flags, "--save", str(one)], tmp_path)
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "-m", "furlong.core", *flags, "--save", str(two), "--actor-num-gpus-per-node", "2"], tmp_path)
    summaries = [line for line in proc.stdout.splitlines() if line.startswith("rollout ")]
    assert len(summaries) == 2  # one summary line per rollout: rank 0 prints, rank 1 does not

    for key in ("rollout/step", "eval/step"):
        assert _rows(one, key).keys() == _rows(two, key).keys()
    for rid, row in _rows(one, "rollout/step").items():
        other = _rows(two, "rollout/step")[rid]
        assert other["rollout/raw_reward"] == row["rollout/raw_reward"]  # same rollouts: rank 0 generated them
        assert other["rollout/response_lengths"] == row["rollout/response_lengths"]
    assert 0 < _rows(one, "rollout/step")[0]["rollout/raw_reward"] < 1  # non-zero advantages move the weights
    train_one, train_two = _rows(one, "train/step"), _rows(two, "train/step")
    assert sorted(train_one) == sorted(train_two) == [0, 1]
    for step, row in train_one.items():
        for name in ("train/loss", "train/pg_loss", "train/kl_loss", "train/grad_norm", "train/pg_clipfrac"):
            assert train_two[step][name] == pytest.approx(row[name], rel=1e-4, abs=1e-6), name

    for save in (one, two):
        assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
        assert json.loads((save / "rollout" / "state_1.json").read_text())
    assert not list(two.glob("iter_*.tmp"))
    w_one = load_file(one / "iter_0000001" / "model" / "model.safetensors")
    w_two = load_file(two / "iter_0000001" / "model" / "model.safetensors")
    assert w_one.keys() == w_two.keys()
    for name, tensor in w_one.items():
        torch.testing.assert_close(w_two[name], tensor, rtol=0, atol=2e-5)
    start = load_file(tiny_model_dir / "model.safetensors")
    assert max(float((w_one[k] - start[k]).abs().max()) for k in start) > 1e-4  # the two steps did train
    if command == "train":  # two ranks resume from their own checkpoint
        more = [*flags, "--save", str(two), "--load", str(two), "--actor-num-gpus-per-node", "2"]
        more[more.index("--num-rollout") + 1] = "3"
        resumed = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "furlong.core", *more], tmp_path)
        assert f"resuming from {two / 'iter_0000001'} at rollout 2" in resumed.stderr
        assert [line.split()[1] for line in resumed.stdout.splitlines() if line.startswith("rollout ")] == ["2"]
        assert (two / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        assert sorted(_rows(two, "train/step")) == [0, 1, 2]


def test_torchrun_size_must_match_the_trainer_flags(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    report = ConfigReport("local", ("--executor",))
    configure(launch_args(actor_num_nodes=1, actor_num_gpus_per_node=1), report)
    assert report.errors == [
        "torchrun started 2 trainer processes but --actor-num-nodes 1 x --actor-num-gpus-per-node 1 = 1; pass "
        "flags whose product is 2 (e.g. --actor-num-gpus-per-node 2) or change --nproc-per-node."]
    matching = ConfigReport("local", ("--executor",))
    configure(launch_args(actor_num_nodes=1, actor_num_gpus_per_node=2), matching)
    assert matching.errors == []


def test_one_process_runs_its_one_worker_in_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    local = executor(launch_args(actor_num_nodes=1, actor_num_gpus_per_node=1))
    assert isinstance(local, LocalExecutor) and local.is_driver and local.weights_in_process

    class Worker:
        async def double(self, x):
            return 2 * x

    workers = asyncio.run(local.start_train_workers(None, lambda rank, world: Worker()))
    assert isinstance(workers, InProcessWorkers) and workers.size == 1
    assert asyncio.run(workers.call("double", [(21,)])) == [42]
    assert asyncio.run(workers.call("double", [None])) == [None]  # a skipped rank answers None


def test_torchrun_processes_are_the_torchrun_executor(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    ranks = executor(launch_args(actor_num_nodes=1, actor_num_gpus_per_node=2))
    assert isinstance(ranks, TorchrunExecutor) and not ranks.is_driver and ranks.size == 2


@pytest.mark.timeout(200)
def test_a_failure_on_rank_0_stops_every_rank_with_one_line_each(tmp_path, tiny_model_dir, arithmetic_jsonl):
    (tmp_path / "failing_reward.py").write_text("def reward(args, sample):\n    raise RuntimeError('grader down')\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    flags = ["train", *_flags(tiny_model_dir, arithmetic_jsonl)[:-9]]  # no eval or saves: rollout 0 fails
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "furlong.core", *flags, "--save", str(tmp_path / "run"), "--actor-num-gpus-per-node",
                           "2", "--custom-rm-path", "failing_reward.reward"],
                          env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith("error: rollout 0 failed: reward plugin 'failing_reward.reward' (from "
                                "--custom-rm-path) failed on sample "), errors
    assert errors[0].endswith(": RuntimeError: grader down")
    # the problem's second line, with the prefix too
    assert errors[1] == f"error:   The rollout's samples are in {tmp_path / 'run' / 'failed_rollout_0.jsonl'}."
    assert errors[2:] in ([], ["error: trainer rank 1: lost contact with rank 0 (RuntimeError); its own error above "
                               "says what went wrong. Stopping this rank."])
    # rank 1 either says in one line that it lost rank 0, or torchrun stopped it first; never a furlong traceback
    assert "furlong/core" not in proc.stderr and "core/run/loop.py" not in proc.stderr, proc.stderr[-3000:]
    assert len((tmp_path / "run" / "failed_rollout_0.jsonl").read_text().splitlines()) == 8


LONG_RUN = 200


@pytest.mark.signals
@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_to_torchrun_stops_every_rank(signal_after_rollout_1, tmp_path, tiny_model_dir, arithmetic_jsonl,
                                               signum):
    """torchrun passes the signal on to the ranks (each in a session of its own, out of a terminal's reach);
    they exit on it without torchrun having to kill them, and none is left; the last checkpoint is complete."""
    save = tmp_path / "run"
    flags = ["train", *_flags(tiny_model_dir, arithmetic_jsonl, rollouts=LONG_RUN)[:-9], "--save-interval", "1"]
    code, output = signal_after_rollout_1(signum, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                          "2", "-m", "furlong.core", *flags, "--save", str(save),
                                          "--actor-num-gpus-per-node", "2")
    assert code != 0, output[-3000:]  # torchrun reports that it was signalled
    assert "Unable to shutdown process" not in output, output[-3000:]  # no rank needed SIGKILL
    if signum == signal.SIGINT:
        assert output.splitlines().count("interrupted") == 2, output[-3000:]
    ranks = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(save) not in ranks
    last = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= last < LONG_RUN - 1
    assert load_file(save / f"iter_{last:07d}" / "model" / "model.safetensors")


def test_a_flag_problem_under_torchrun_is_printed_once(tmp_path, tiny_model_dir, arithmetic_jsonl):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "furlong.core", "train", *_flags(tiny_model_dir, arithmetic_jsonl), "--save",
                           str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: torchrun started 2 trainer processes but --actor-num-nodes 1 x --actor-num-gpus-per-node "
                      "1 = 1; pass flags whose product is 2 (e.g. --actor-num-gpus-per-node 2) or change "
                      "--nproc-per-node."], proc.stderr[-4000:]
    assert sum("--save-interval defaults" in line for line in proc.stderr.splitlines()) <= 1


def test_local_executor_outside_torchrun_refuses_several_train_ranks(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    report = ConfigReport("local", ("--executor",))
    configure(launch_args(actor_num_nodes=1, actor_num_gpus_per_node=2), report)
    assert report.errors == [
        "--executor local runs one train rank in this process, but --actor-num-nodes 1 x --actor-num-gpus-per-node "
        "2 = 2; start one process per rank (torchrun --nproc-per-node 2 -m furlong.core train ...), use --executor "
        "ray, or pass --actor-num-gpus-per-node 1."]


@pytest.mark.parametrize("rank, waits", [("0", []), ("1", [30.0])])
def test_a_flag_problem_on_a_secondary_rank_waits_for_rank_0_then_is_still_printed(monkeypatch, capsys, rank, waits):
    """Rank 0 prints the launch flags' problems; another rank waits first, so that exiting before rank 0
    cannot make torchrun stop rank 0 before it prints (then torchrun stops it). Were rank 0 slower than
    the wait, that rank would still print its own report: a flag problem is never silent."""
    from furlong.core.cli import commands as cli

    slept = []
    monkeypatch.setattr(cli.time, "sleep", slept.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    code = cli.main(["train", "--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rollout-batch-size", "4",
                     "--n-samples-per-prompt", "3", "--global-batch-size", "5"])
    assert code == 2 and slept == waits
    assert capsys.readouterr().err.startswith("error: ")


def test_a_secondary_rank_quiets_the_config_warnings_only_while_main_runs(monkeypatch, capsys, caplog):
    """Rank 1 leaves the launch flags' warnings to rank 0, during its main() only: the logger's level is
    restored when main() returns, so what runs next in the process (a test, an embedding program) logs as before."""
    import logging

    from furlong.core.cli import commands as cli
    from furlong.core.config import parse_args

    monkeypatch.setattr(cli.time, "sleep", lambda s: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    config_log = logging.getLogger("furlong.config")
    before = config_log.level
    flags = ["--num-rollout", "3", "--rollout-batch-size", "4", "--ft-components", "rollout"]
    ignored = "--ft-components rollout is ignored without --use-fault-tolerance."
    with caplog.at_level(logging.WARNING):  # the root's level: furlong.config's own level decides
        cli.main(["train", *flags, "--print-config"])
        assert ignored not in caplog.messages
        assert config_log.level == before
        parse_args(flags)
    assert caplog.messages.count(ignored) == 1
    capsys.readouterr()


@pytest.mark.timeout(300)
def test_a_ppo_run_on_two_trainer_ranks_reproduces_one_process(tmp_path, tiny_model_dir, arithmetic_jsonl):
    """Each torchrun process holds an actor rank and a critic rank (FSDP2 over both processes each); the two
    groups take turns on the processes they share."""
    one, two = tmp_path / "one", tmp_path / "two"
    flags = ["train", *_flags(tiny_model_dir, arithmetic_jsonl), "--advantage-estimator", "ppo", "--critic-lr", "1e-2"]
    _run([sys.executable, "-m", "furlong.core", *flags, "--save", str(one)], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "furlong.core",
          *flags, "--save", str(two), "--actor-num-gpus-per-node", "2"], tmp_path)
    train_one, train_two = _rows(one, "train/step"), _rows(two, "train/step")
    assert sorted(train_one) == sorted(train_two) == [0, 1]
    for step, row in train_one.items():
        for name in ("train/loss", "critic/value_loss", "critic/vpred_mean", "critic/grad_norm"):
            assert train_two[step][name] == pytest.approx(row[name], rel=1e-4, abs=1e-6), (step, name)
    for folder in ("one_critic", "two_critic"):
        assert (tmp_path / folder / "iter_0000001" / "model" / "model.safetensors").is_file()
    w_one = load_file(tmp_path / "one_critic" / "iter_0000001" / "model" / "model.safetensors")
    w_two = load_file(tmp_path / "two_critic" / "iter_0000001" / "model" / "model.safetensors")
    for name, tensor in w_one.items():
        torch.testing.assert_close(w_two[name], tensor, rtol=0, atol=2e-5)
