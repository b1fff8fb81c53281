"""`--executor ray` on a CPU machine: real Ray, two train actors and an engine actor, against the local executor.

Every run starts its own local Ray and must leave no Ray process behind. Sampling seeds
are fixed per sample, so a Ray run reproduces the local run's rollouts exactly and its
losses to float tolerance (two gloo ranks sum what one process computes at once); an
engine actor killed mid-rollout is replaced and its requests retried, which leaves the
run unchanged; a train actor killed mid-run stops the run with one error naming it and
leaves the last checkpoint readable.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from safetensors.torch import load_file

from furlong.hooks.testing.processes import signal_state

RAY_PROCESS_MARKERS = ("raylet", "gcs_server", "ray::", "ray/dashboard", "ray/autoscaler", "log_monitor")


def _flags(model, data, rollouts=3):
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
            "--rm-type", "deterministic_random", "--num-rollout", str(rollouts), "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "4", "--global-batch-size", "8", "--micro-batch-size", "2",
            "--rollout-max-response-len", "6", "--lr", "1e-3", "--use-kl-loss", "--kl-loss-coef", "0.1",
            "--save-interval", "1"]


def _rows(save, key):
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return {r[key]: r for r in rows if key in r}


def _ray_processes() -> set[str]:
    # -ww: whole command lines; under pytest COLUMNS may cut them before the marker
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    return {line.strip() for line in out if any(m in line for m in RAY_PROCESS_MARKERS)}


def _furlong(args, cwd, env=None, timeout=240):
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a private Ray unless the test sets one
    env = dict(base, OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0", **(env or {}))
    return subprocess.run([sys.executable, "-m", "furlong.core", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def _stop_processes(lines: set[str]) -> None:
    """SIGTERM the processes of ``ps`` lines, then SIGKILL what is left after 10 s."""
    pids = [int(line.split()[0]) for line in lines]
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
            time.sleep(0.5)


@pytest.fixture(autouse=True)
def no_ray_left():
    """After each test, no Ray process that was not there before it (a run's own Ray is gone)."""
    before = _ray_processes()
    yield
    deadline = time.monotonic() + 20
    while _ray_processes() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sorted(_ray_processes() - before) == []


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, tiny_model_dir, arithmetic_jsonl):
    """The reference: the same flags with the local executor in one process."""
    save = tmp_path_factory.mktemp("local") / "run"
    proc = _furlong(["train", *_flags(tiny_model_dir, arithmetic_jsonl), "--save", str(save)], save.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return save


def _assert_same_run(local, ray_run):
    for rid, row in _rows(local, "rollout/step").items():
        other = _rows(ray_run, "rollout/step")[rid]
        assert other["rollout/raw_reward"] == row["rollout/raw_reward"]
        assert other["rollout/response_lengths"] == row["rollout/response_lengths"]
    train_local, train_ray = _rows(local, "train/step"), _rows(ray_run, "train/step")
    assert sorted(train_local) == sorted(train_ray) == [0, 1, 2]
    for step, row in train_local.items():
        for name in ("train/loss", "train/pg_loss", "train/kl_loss", "train/grad_norm"):
            assert train_ray[step][name] == pytest.approx(row[name], rel=1e-4, abs=1e-6), (step, name)
    w_local = load_file(local / "iter_0000002" / "model" / "model.safetensors")
    w_ray = load_file(ray_run / "iter_0000002" / "model" / "model.safetensors")
    assert w_local.keys() == w_ray.keys()
    for name, tensor in w_local.items():
        torch.testing.assert_close(w_ray[name], tensor, rtol=0, atol=2e-5)


@pytest.mark.timeout(300)
def test_two_ray_train_actors_reproduce_the_local_executor(local_run, tmp_path, tiny_model_dir, arithmetic_jsonl):
    save = tmp_path / "ray"
    home = tmp_path / "home"  # the run's private Ray writes no auth token (or anything else) into the home folder
    home.mkdir()
    proc = _furlong(["train", *_flags(tiny_model_dir, arithmetic_jsonl), "--save", str(save), "--executor", "ray",
                     "--actor-num-gpus-per-node", "2"], tmp_path, env={"HOME": str(home)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in home.iterdir()) == []
    assert "placement group of 3 bundle(s) {'CPU': 1} ready" in proc.stderr  # 2 train ranks + 1 engine
    assert "2 train actor(s) started (gloo)" in proc.stderr and "rollout-manager actor started" in proc.stderr
    _assert_same_run(local_run, save)
    rollouts = _rows(save, "rollout/step")
    assert all(row["perf/update_weights_time"] > 0 for row in rollouts.values())
    start = load_file(tiny_model_dir / "model.safetensors")
    trained = load_file(save / "iter_0000002" / "model" / "model.safetensors")
    assert max(float((trained[k] - start[k]).abs().max()) for k in start) > 1e-4  # the steps did train


def _ppo_flags(model, data, save):
    return ["train", *_flags(model, data, rollouts=2), "--advantage-estimator", "ppo", "--critic-lr", "1e-2",
            "--save", str(save)]


@pytest.mark.timeout(300)
def test_a_ppo_run_on_ray_trains_actor_and_critic_at_once_and_equals_the_local_run(tmp_path, tiny_model_dir,
                                                                                 arithmetic_jsonl):
    local, ray_run = tmp_path / "local" / "run", tmp_path / "ray" / "run"
    for save in (local, ray_run):
        save.parent.mkdir()
    proc = _furlong(_ppo_flags(tiny_model_dir, arithmetic_jsonl, local), local.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _furlong([*_ppo_flags(tiny_model_dir, arithmetic_jsonl, ray_run), "--executor", "ray"], ray_run.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("1 train actor(s) started (gloo)") == 2  # the actor's group and the critic's
    rows_local, rows_ray = _rows(local, "train/step"), _rows(ray_run, "train/step")
    assert sorted(rows_local) == sorted(rows_ray) == [0, 1]
    for step, row in rows_local.items():
        for name in ("train/loss", "train/pg_loss", "critic/value_loss", "critic/vpred_mean", "critic/grad_norm"):
            assert rows_ray[step][name] == pytest.approx(row[name], rel=1e-5, abs=1e-7), (step, name)
    for rid, row in _rows(local, "rollout/step").items():
        other = _rows(ray_run, "rollout/step")[rid]
        assert other["rollout/raw_reward"] == row["rollout/raw_reward"]
        assert other["critic/explained_variance"] == pytest.approx(row["critic/explained_variance"], abs=1e-6)
    for folder in ("run", "run_critic"):
        w_local = load_file(local.parent / folder / "iter_0000001" / "model" / "model.safetensors")
        w_ray = load_file(ray_run.parent / folder / "iter_0000001" / "model" / "model.safetensors")
        assert w_local.keys() == w_ray.keys()
        for name, tensor in w_local.items():
            torch.testing.assert_close(w_ray[name], tensor, rtol=0, atol=1e-6)


KILLER = '''
import os, signal, subprocess

def reward(args, sample):
    flag = os.path.join(os.environ["KILL_DIR"], "kill-flag")
    if sample.index >= int(os.environ["KILL_AT_SAMPLE"]) and not os.path.exists(flag):
        pids = subprocess.run(["pgrep", "-f", os.environ["KILL_WHAT"]], capture_output=True, text=True).stdout.split()
        open(flag, "w").write(" ".join(pids))
        os.kill(int(pids[-1]), signal.SIGKILL)
    return float(sample.index % 3 == 0)
'''


def _killer(tmp_path, what, at_sample):
    (tmp_path / "killer.py").write_text(KILLER)
    return {"KILL_DIR": str(tmp_path), "KILL_AT_SAMPLE": str(at_sample), "KILL_WHAT": what,
            "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.timeout(300)
def test_an_engine_actor_killed_mid_rollout_is_replaced_and_the_run_is_unchanged(tmp_path, tiny_model_dir,
                                                                                    arithmetic_jsonl):
    # one request at a time, so the kill (scoring the first sample of rollout 1) finds requests in flight; the
    # uninterrupted reference runs under the local executor, whose rollouts a Ray run reproduces (tested above)
    flags = [*_flags(tiny_model_dir, arithmetic_jsonl), "--custom-rm-path", "killer.reward",
             "--embedded-max-batch-size", "1"]
    clean = _furlong(["train", *flags, "--save", str(tmp_path / "clean")], tmp_path,
                     env=_killer(tmp_path, "no-such-process-name", 10**9))
    assert clean.returncode == 0, clean.stderr[-3000:]
    killed = _furlong(["train", *flags, "--save", str(tmp_path / "killed"), "--executor", "ray"], tmp_path,
                      env=_killer(tmp_path, "ray::EngineActor", 8))
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert (tmp_path / "kill-flag").read_text().strip()  # the reward did kill the engine actor
    assert "engine actor 0 on node" in killed.stderr
    assert "died; starting a replacement (2 restart(s) left)" in killed.stderr
    assert killed.stderr.count("starting a replacement") == 1  # one restart, however many requests noticed
    for rid, row in _rows(tmp_path / "clean", "rollout/step").items():
        other = _rows(tmp_path / "killed", "rollout/step")[rid]
        # retried requests keep their sampling seeds: nothing lost, nothing counted twice
        assert other["rollout/raw_reward"] == row["rollout/raw_reward"]
        assert other["rollout/response_lengths"] == row["rollout/response_lengths"]


@pytest.mark.timeout(300)
def test_a_train_actor_killed_mid_run_stops_the_run_with_one_error_and_keeps_the_checkpoint(
        tmp_path, tiny_model_dir, arithmetic_jsonl):
    save = tmp_path / "run"
    proc = _furlong(["train", *_flags(tiny_model_dir, arithmetic_jsonl), "--custom-rm-path", "killer.reward",
                     "--save", str(save), "--executor", "ray", "--actor-num-gpus-per-node", "2"], tmp_path,
                    env=_killer(tmp_path, "ray::TrainActor", 8))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "train actor rank " in errors[0] and " on node " in errors[0] and ", pid " in errors[0]
    assert "the actor died during log_probs" in errors[0]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    weights = load_file(save / "iter_0000000" / "model" / "model.safetensors")
    assert weights and json.loads((save / "rollout" / "state_0.json").read_text())


def _long_ray_run(tiny_model_dir, arithmetic_jsonl, save) -> list[str]:
    return ["-m", "furlong.core", "train", *_flags(tiny_model_dir, arithmetic_jsonl, rollouts=LONG_RUN),
            "--save", str(save), "--executor", "ray"]


LONG_RUN = 200


def _assert_stopped_early_with_a_checkpoint(save):
    """The run stopped long before its last rollout; the checkpoint its marker names is complete (which rollout
    that is depends on how far the run got before the signal arrived)."""
    last = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 0 <= last < LONG_RUN - 1
    assert load_file(save / f"iter_{last:07d}" / "model" / "model.safetensors")


@pytest.mark.signals
@pytest.mark.timeout(300)
def test_ctrl_c_stops_a_ray_run_and_leaves_no_ray_process(signal_after_rollout_1, tmp_path, tiny_model_dir,
                                                           arithmetic_jsonl):
    code, output = signal_after_rollout_1(signal.SIGINT, *_long_ray_run(tiny_model_dir, arithmetic_jsonl,
                                                                        tmp_path / "run"))
    assert code == 130, output[-2000:]
    assert "Task exception was never retrieved" not in output
    _assert_stopped_early_with_a_checkpoint(tmp_path / "run")


@pytest.mark.signals
@pytest.mark.timeout(300)
def test_sigterm_stops_a_ray_run_and_leaves_no_ray_process(signal_after_rollout_1, tmp_path, tiny_model_dir,
                                                           arithmetic_jsonl):
    code, output = signal_after_rollout_1(signal.SIGTERM, *_long_ray_run(tiny_model_dir, arithmetic_jsonl,
                                                                         tmp_path / "run"))
    assert code == 15, output[-2000:]  # Ray's handler exits with the signal's number
    assert "SIGTERM received" not in output and "PC: @" not in output, output[-2000:]  # no C++ stack dump
    _assert_stopped_early_with_a_checkpoint(tmp_path / "run")


@pytest.mark.timeout(300)
def test_under_ray_job_submit_the_run_joins_the_cluster_and_leaves_it_running(tmp_path, tiny_model_dir,
                                                                              arithmetic_jsonl):
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled")  # the job gets the cluster's own setting
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    before = _ray_processes()
    start = subprocess.run(["ray", "start", "--head", "--num-cpus", "4", "--include-dashboard=false",
                            "--port", "0", f"--temp-dir={temp}"], env=env, capture_output=True, text=True, timeout=120,
                           preexec_fn=signal_state())  # _stop_processes signals what it starts
    try:
        assert start.returncode == 0, start.stderr[-2000:]
        address = next(line.split("'")[1] for line in start.stdout.splitlines() if "ray start --address=" in line)
        save = tmp_path / "run"
        proc = _furlong(["train", *_flags(tiny_model_dir, arithmetic_jsonl, rollouts=1), "--save", str(save)],
                        tmp_path, env={"RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "placement group of 2 bundle(s)" in proc.stderr  # --executor ray by default under RAY_ADDRESS
        assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
        alive = subprocess.run(["ray", "status", f"--address={address}"], env=env, capture_output=True, text=True,
                               timeout=60)
        assert alive.returncode == 0, alive.stderr[-2000:]  # the cluster outlives the job
    finally:
        _stop_processes(_ray_processes() - before)  # this test's cluster only, not other Ray users'
        shutil.rmtree(temp, ignore_errors=True)


RAISING_LOSS = '''
def loss(args, batch):
    raise ValueError("loss exploded")
'''


@pytest.mark.timeout(300)
def test_a_train_actor_that_raises_names_itself_and_the_cause(tmp_path, tiny_model_dir, arithmetic_jsonl):
    (tmp_path / "raising_loss.py").write_text(RAISING_LOSS)
    proc = _furlong(["train", *_flags(tiny_model_dir, arithmetic_jsonl, rollouts=1), "--save", str(tmp_path / "run"),
                     "--executor", "ray", "--custom-loss-function-path", "raising_loss.loss"], tmp_path,
                    env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: train actor rank 0 on node "), proc.stderr[-3000:]
    assert "loss exploded" in errors[0]


KILL_ON_TRAIN_STEP = '''
import os, signal, subprocess

from furlong.hooks import hookimpl


@hookimpl
def on_train_step_end(rollout_id):
    flag = os.path.join(os.environ["KILL_DIR"], "kill-flag")
    if rollout_id == 1 and not os.path.exists(flag):
        pids = subprocess.run(["pgrep", "-f", "ray::EngineActor"], capture_output=True, text=True).stdout.split()
        open(flag, "w").write(" ".join(pids))
        os.kill(int(pids[-1]), signal.SIGKILL)
'''


@pytest.mark.timeout(300)
def test_an_engine_actor_dead_at_weight_sync_is_replaced_and_the_run_is_unchanged(
        local_run, tmp_path, tiny_model_dir, arithmetic_jsonl, write_dist):
    site = tmp_path / "site"
    write_dist(site, "furlong-kill-engine", "furlong_kill_engine", KILL_ON_TRAIN_STEP,
               {"kill_engine": "furlong_kill_engine"})
    save = tmp_path / "run"
    proc = _furlong(["train", *_flags(tiny_model_dir, arithmetic_jsonl), "--save", str(save), "--executor", "ray"],
                    tmp_path, env={"KILL_DIR": str(tmp_path),
                                   "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "kill-flag").read_text().strip()  # the observer killed the engine actor after training
    assert "weight sync: engine actor 0 on node" in proc.stderr and "is gone; replacing it" in proc.stderr
    for rid, row in _rows(local_run, "rollout/step").items():  # the replacement got rollout 1's weights
        other = _rows(save, "rollout/step")[rid]
        assert other["rollout/raw_reward"] == row["rollout/raw_reward"]
        assert other["rollout/response_lengths"] == row["rollout/response_lengths"]



@pytest.mark.timeout(300)
def test_megatron_train_actors_at_tp2_with_sequence_parallelism_reproduce_one_process(tmp_path, tiny_model_dir,
                                                                                      arithmetic_jsonl):
    """`--train-backend megatron` under Ray: two train actors form one TP=2 group (megatron-core's parallel state
    built from the actors' ranks, `--sequence-parallel`), train and sync weights to the engine actor; rollouts and
    losses equal the megatron backend's one-process run, and the `torch_dist` checkpoint is written."""
    flags = [*_flags(tiny_model_dir, arithmetic_jsonl, rollouts=2), "--train-backend", "megatron"]
    local, ray_run = tmp_path / "local", tmp_path / "ray"
    proc = _furlong(["train", *flags, "--save", str(local)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _furlong(["train", *flags, "--save", str(ray_run), "--executor", "ray", "--actor-num-gpus-per-node", "2",
                     "--tensor-model-parallel-size", "2", "--sequence-parallel"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 train actor(s) started (gloo)" in proc.stderr
    assert "TP 2 (sequence parallel), PP 1, CP 1, DP 1" in proc.stderr
    for rid, row in _rows(local, "rollout/step").items():
        other = _rows(ray_run, "rollout/step")[rid]
        assert other["rollout/raw_reward"] == row["rollout/raw_reward"]
        assert other["rollout/log_probs"] == pytest.approx(row["rollout/log_probs"], rel=1e-5, abs=1e-6)
    train_local, train_ray = _rows(local, "train/step"), _rows(ray_run, "train/step")
    assert sorted(train_local) == sorted(train_ray) == [0, 1]
    for step, row in train_local.items():
        for name in ("train/loss", "train/pg_loss", "train/kl_loss", "train/grad_norm"):
            assert train_ray[step][name] == pytest.approx(row[name], rel=1e-4, abs=1e-6), (step, name)
    assert sorted(p.name for p in (ray_run / "iter_0000001").glob("__*.distcp")) == \
        ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"]


def _eval_flags(tmp_path):
    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "demo")
    test4 = tmp_path / "test4.jsonl"
    with open(os.path.join(demo, "data", "test.jsonl")) as f:
        test4.write_text("".join(f.readlines()[:4]))
    return ["train", "--hf-checkpoint", os.path.join(demo, "model"), "--prompt-data",
            os.path.join(demo, "data", "train.jsonl"), "--input-key", "prompt", "--label-key", "label",
            "--rm-type", "deterministic_random", "--num-rollout", "2", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--lr", "3e-3", "--seed", "5",
            "--eval-prompt-data", "t", str(test4), "--eval-interval", "1", "--n-samples-per-eval-prompt", "2",
            "--eval-max-response-len", "6"]


EVAL_TIMING = ("perf/eval_time", "eval/lag_steps", "eval/duration_seconds", "eval/export_time_seconds", "time")


def _evals(folder):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return sorted(({k: v for k, v in r.items() if k not in EVAL_TIMING} for r in rows if "eval/step" in r),
                  key=lambda r: r["eval/step"])


@pytest.fixture(scope="module")
def local_inline_eval(tmp_path_factory):
    """The reference: evaluation on the rollout engine, local executor, demo model."""
    folder = tmp_path_factory.mktemp("inline_eval")
    proc = _furlong([*_eval_flags(folder), "--log-dir", str(folder / "log")], folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _evals(folder / "log")


@pytest.mark.timeout(300)
def test_the_eval_fleet_on_ray_logs_the_local_inline_evaluation(tmp_path, local_inline_eval):
    """--eval-num-gpus 1 under Ray: an eval engine actor on a bundle of its own, fed snapshots, gives the
    evaluation the local executor's inline one gives (the demo model)."""
    proc = _furlong([*_eval_flags(tmp_path), "--log-dir", str(tmp_path / "ray"), "--executor", "ray",
                     "--eval-num-gpus", "1", "--eval-hf-dir", str(tmp_path / "snap")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "placement group of 3 bundle(s) {'CPU': 1} ready" in proc.stderr  # trainer + engine + eval engine
    assert "1 eval engine actor(s) started" in proc.stderr
    assert _evals(tmp_path / "ray") == local_inline_eval
    assert [r["eval/step"] for r in local_inline_eval] == [0, 0, 1]
    assert sorted(os.listdir(tmp_path / "snap")) == ["step_0", "step_1"]  # --eval-keep-snapshots 2


@pytest.mark.timeout(300)
def test_an_sglang_eval_server_loads_the_snapshots_off_the_rollout_router(tmp_path, local_inline_eval):
    """The sglang engine with furlong serve as its server (SGLang's HTTP API on CPU): the eval server loads each
    snapshot through /update_weights_from_disk and is asked directly; the evaluation is the inline one."""
    proc = _furlong([*_eval_flags(tmp_path), "--log-dir", str(tmp_path / "sg"), "--rollout-backend", "sglang",
                     "--sglang-server-impl", "furlong", "--eval-num-gpus", "1", "--eval-hf-dir",
                     str(tmp_path / "snap")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count(" registered") == 1  # the rollout server only: the eval server is off the router
    assert _evals(tmp_path / "sg") == local_inline_eval
