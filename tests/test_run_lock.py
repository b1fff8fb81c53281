"""One run per output folder: ``--save`` (else ``--log-dir``) is locked by the run writing it (core/run/lock.py)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from furlong.core.run.lock import LOCK_NAME, RunLock, lock_output_folders, output_folders
from furlong.hooks import PluginError

BASE = ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--global-batch-size", "4", "--input-key", "prompt", "--label-key", "label", "--rm-type", "math",
        "--rollout-max-response-len", "4"]


@pytest.fixture
def sleeper():
    """A live process of this host (not this one), killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def _holder(pid, host=None, started=1_700_000_000.0, process_start=None):
    return {"pid": pid, "host": host or socket.gethostname(), "started": started, "process_start": process_start}


def _write_lock(folder, record):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_NAME).write_text(json.dumps(record))


def _since(started):
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))


def test_a_lock_names_its_holder_and_goes_with_it(tmp_path):
    lock = RunLock(str(tmp_path / "run"))
    lock.acquire()
    record = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert abs(record["started"] - time.time()) < 60
    lock.release()
    assert not (tmp_path / "run").exists()  # the lock made the folder and nothing was written there


def test_release_keeps_a_folder_that_holds_outputs(tmp_path):
    lock = RunLock(str(tmp_path / "run"))
    lock.acquire()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    lock.release()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]


def test_a_live_run_s_lock_is_one_clear_error(tmp_path, sleeper):
    _write_lock(tmp_path / "run", _holder(sleeper.pid))
    with pytest.raises(PluginError) as excinfo:
        RunLock(str(tmp_path / "run")).acquire()
    assert str(excinfo.value) == (
        f"--save '{tmp_path / 'run'}': another run writes this folder (pid {sleeper.pid} on host "
        f"{socket.gethostname()} since {_since(1_700_000_000.0)}); wait for it to end or choose another --save.")
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == sleeper.pid  # left alone


def test_a_dead_run_s_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write_lock(tmp_path / "run", _holder(gone.pid))
    caplog.set_level(logging.WARNING, logger="furlong")
    lock = RunLock(str(tmp_path / "run"))
    lock.acquire()
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert caplog.messages == [
        f"--save {tmp_path / 'run'}: taking over the lock of a run that is gone (pid {gone.pid} on host "
        f"{socket.gethostname()} since {_since(1_700_000_000.0)}); its outputs stay in the folder."]
    lock.release()


def test_a_reused_pid_does_not_keep_a_stale_lock(tmp_path, sleeper):
    """The pid runs, but a process started long after the lock was written: the lock's run is gone."""
    _write_lock(tmp_path / "run", _holder(sleeper.pid, process_start=1_000.0))
    lock = RunLock(str(tmp_path / "run"))
    lock.acquire()
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_another_host_s_lock_is_not_taken_over(tmp_path):
    _write_lock(tmp_path / "run", _holder(12345, host="node-7"))
    with pytest.raises(PluginError) as excinfo:
        RunLock(str(tmp_path / "run"), "--log-dir").acquire()
    assert str(excinfo.value) == (
        f"--log-dir '{tmp_path / 'run'}': another run writes this folder (pid 12345 on host node-7 since "
        f"{_since(1_700_000_000.0)}); wait for it to end or choose another --log-dir. If that run is gone, delete "
        f"{tmp_path / 'run' / LOCK_NAME}.")


def test_the_folder_the_run_writes_is_the_one_locked(tmp_path, sleeper):
    from furlong.core.config.launch_args import launch_config

    base = launch_config(configure=False)
    assert output_folders(base.replace(save=str(tmp_path / "a"), log_dir=str(tmp_path / "b"))) == [
        ("--save", str(tmp_path / "a"))]
    assert output_folders(base.replace(log_dir=str(tmp_path / "b"))) == [("--log-dir", str(tmp_path / "b"))]
    assert output_folders(base) == []
    (tmp_path / "file").write_text("x")
    assert output_folders(base.replace(save=str(tmp_path / "file"))) == []  # check_paths reports it
    _write_lock(tmp_path / "b", _holder(sleeper.pid))
    with pytest.raises(PluginError, match="^--log-dir"):
        lock_output_folders(base.replace(log_dir=str(tmp_path / "b")))


def test_a_second_run_on_a_held_save_folder_exits_2_before_any_model_loads(tmp_path, tiny_model_dir, sleeper,
                                                                           capsys):
    from furlong.core.cli.commands import main

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    save = tmp_path / "run"
    _write_lock(save, _holder(sleeper.pid))
    code = main(["train", *BASE, "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data),
                 "--save", str(save)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (
        f"error: --save '{save}': another run writes this folder (pid {sleeper.pid} on host {socket.gethostname()} "
        f"since {_since(1_700_000_000.0)}); wait for it to end or choose another --save.")
    assert sorted(p.name for p in save.iterdir()) == [LOCK_NAME]  # nothing written


@pytest.mark.timeout(240)
def test_two_runs_started_at_once_on_one_folder(tmp_path, tiny_model_dir, arithmetic_jsonl):
    """Both start together: one trains, the other stops with exit 2; the folder holds one run's outputs."""
    save = tmp_path / "run"
    flags = [*BASE, "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(arithmetic_jsonl), "--save", str(save)]
    flags[flags.index("--num-rollout") + 1] = "3"
    command = [sys.executable, "-m", "furlong.core", "train", *flags]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=200), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [err[-2000:] for _, _, err in results]
    loser = next(err for code, _, err in results if code == 2)
    assert "Traceback" not in loser
    assert f"error: --save '{save}': another run writes this folder (pid " in loser
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/step"] for r in rows if "rollout/step" in r] == [0, 1, 2]
    assert not (save / LOCK_NAME).exists()


def test_busy_says_why_a_folder_is_in_use_and_nothing_for_a_stale_lock(tmp_path, sleeper):
    assert RunLock(str(tmp_path / "none")).busy() is None
    _write_lock(tmp_path / "live", _holder(sleeper.pid))
    assert "another run writes this folder (pid" in RunLock(str(tmp_path / "live")).busy()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write_lock(tmp_path / "stale", _holder(gone.pid))
    assert RunLock(str(tmp_path / "stale")).busy() is None


def test_the_demo_script_leaves_a_folder_a_live_run_writes_in_place(tmp_path, sleeper):
    """run_demo.sh moves its output folder aside before a run; not while another run writes it."""
    from pathlib import Path

    out = tmp_path / "demo"
    _write_lock(out, _holder(sleeper.pid))
    (out / "metrics.jsonl").write_text('{"rollout/step": 0}\n')
    script = Path(__file__).resolve().parents[1] / "examples" / "demo" / "run_demo.sh"
    done = subprocess.run(["bash", str(script)], env={**os.environ, "OUT": str(out)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"error: --save '{out}': another run writes this folder (pid {sleeper.pid} on "
                                   f"host {socket.gethostname()} since {_since(1_700_000_000.0)}); wait for it to "
                                   "end or choose another --save.")
    assert (out / "metrics.jsonl").exists() and not (tmp_path / "demo.previous").exists()


def _run_demo(tmp_path, out, *flags):
    """examples/demo/run_demo.sh with OUT=``out`` and ``flags``; ``furlong`` is a stand-in that writes one rollout row
    to the run's folder (the last ``--save`` it is given, as furlong reads it) and draws nothing."""
    from pathlib import Path

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_in = bin_dir / "furlong"
    stand_in.write_text('#!/usr/bin/env bash\n[ "$1" = plot ] && exit 0\n'
                        'for a in "$@"; do [ "$a" = --print-config ] && echo "{}" && exit 0; done\n'
                        'prev=""; for a in "$@"; do [ "$prev" = --save ] && save="$a"; prev="$a"; done\n'
                        'mkdir -p "$save" && echo \'{"rollout/step": 0}\' >> "$save/metrics.jsonl"\n')
    stand_in.chmod(0o755)
    script = Path(__file__).resolve().parents[1] / "examples" / "demo" / "run_demo.sh"
    return subprocess.run(["bash", str(script), *flags], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(out), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})


def test_the_demo_script_moves_a_critic_aside_and_reports_a_run_without_evaluation(tmp_path):
    """run_demo.sh moves $OUT and its critic ($OUT_critic) aside together, and a run that evaluated nothing
    (--debug-train-only) ends with a line saying so."""
    out = tmp_path / "demo"
    for folder in (out, tmp_path / "demo_critic"):
        folder.mkdir()
        (folder / "old").write_text("an earlier run")
    done = _run_demo(tmp_path, out)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("no test-split evaluation in this run (it evaluates with a rollout engine and "
                                   "--eval-interval)")
    assert (tmp_path / "demo.previous" / "old").exists() and (tmp_path / "demo_critic.previous" / "old").exists()
    assert not (tmp_path / "demo_critic").exists()


def test_the_demo_script_moves_a_critic_left_without_its_run_aside_unless_save_is_given(tmp_path):
    """A critic folder whose $OUT was deleted would make the next ppo run refuse to start: it is moved aside too.
    Under an explicit --save nothing is moved, the critic beside it included (it may be resumed)."""
    out = tmp_path / "demo"
    (tmp_path / "demo_critic").mkdir()
    (tmp_path / "demo_critic" / "old").write_text("an earlier ppo run")
    done = _run_demo(tmp_path, out)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "demo_critic.previous" / "old").read_text() == "an earlier ppo run"
    assert not (tmp_path / "demo_critic").exists() and not (tmp_path / "demo.previous").exists()
    mine = tmp_path / "mine"
    (tmp_path / "mine_critic").mkdir()
    (tmp_path / "mine_critic" / "old").write_text("kept")
    done = _run_demo(tmp_path, out, "--save", str(mine))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "mine_critic" / "old").read_text() == "kept" and not (tmp_path / "mine_critic.previous").exists()
    assert (mine / "metrics.jsonl").exists() and (out / "metrics.jsonl").exists()  # out: the first run's, untouched


def test_the_demo_script_with_print_config_prints_it_and_moves_nothing(tmp_path):
    """--print-config (or --help) trains nothing: the script prints furlong's output only, with no summary of a run
    that did not happen, and leaves the previous run where it is."""
    out = tmp_path / "demo"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"rollout/step": 0}\n')
    done = _run_demo(tmp_path, out, "--print-config")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{}"
    assert (out / "metrics.jsonl").exists() and not (tmp_path / "demo.previous").exists()


def test_the_demo_script_resumes_in_the_folder_load_names(tmp_path):
    """``--load DIR`` alone: the run goes on in DIR (its checkpoints and metrics stay), nothing is moved aside."""
    out = tmp_path / "trap"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"rollout/step": 0}\n')
    done = _run_demo(tmp_path, out, "--load", str(out))
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "trap.previous").exists()
    assert (out / "metrics.jsonl").read_text().count("rollout/step") == 2  # the earlier row kept, the new one added
