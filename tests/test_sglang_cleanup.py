"""What a ``--executor local`` sglang run leaves behind: nothing after SIGTERM; after SIGKILL, weight
copies that the next run removes (builtin_plugins/engines/sglang/weight_files.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from furlong.hooks.testing.processes import signal_state

pytest.importorskip("sglang_router", reason='the router extra: pip install "furlong[router]"')
pytestmark = pytest.mark.signals

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "examples" / "demo"


def _start_run(tmp: Path) -> subprocess.Popen:
    """A long demo run with one furlong serve server; TMPDIR is ``tmp``, so its temporary files land there."""
    argv = ["--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--rm-type", "math", "--num-rollout", "100",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
            "--micro-batch-size", "16", "--rollout-max-response-len", "8", "--save", str(tmp / "run"),
            "--executor", "local", "--rollout-backend", "sglang", "--sglang-server-impl", "furlong"]
    # PYTHONFAULTHANDLER: a run that does not exit is sent SIGABRT and prints every thread's stack (_finish)
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen([sys.executable, "-m", "furlong.core", "train", *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=signal_state())


def _weight_copies(tmp: Path) -> list[Path]:
    return sorted(tmp.glob(f"furlong-sglang-weights-{os.getuid()}/*/model.safetensors"))


def _wait_for_weights(proc: subprocess.Popen, tmp: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not _weight_copies(tmp):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no weight copy was written"
        time.sleep(0.2)


def _finish(proc: subprocess.Popen, sig: int) -> str:
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # the fault handler prints where each thread waits
        try:
            _, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        raise AssertionError(f"the run did not exit within 60 s of signal {sig}; its stacks:\n{err[-6000:]}") from None
    return err


def test_sigterm_leaves_no_weight_copy_and_no_log(tmp_path):
    proc = _start_run(tmp_path)
    _wait_for_weights(proc, tmp_path)
    err = _finish(proc, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert _weight_copies(tmp_path) == []
    assert sorted(p.name for p in tmp_path.glob("furlong-*.log")) == []  # router and server logs
    assert "Traceback" not in err


def test_weight_copies_of_a_killed_run_go_at_the_next_run(tmp_path, monkeypatch):
    from furlong.builtin_plugins.engines.sglang import weight_files

    proc = _start_run(tmp_path)
    _wait_for_weights(proc, tmp_path)
    _finish(proc, signal.SIGKILL)
    left = _weight_copies(tmp_path)
    assert len(left) == 1  # SIGKILL runs no clean-up
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = weight_files.new_weights_dir(0)  # the next run's engine 0
    try:
        assert not left[0].exists() and os.path.isdir(mine)
        assert os.path.basename(mine).startswith(f"{os.getpid()}-0-")
        assert weight_files.new_weights_dir(1) and os.path.isdir(mine)  # a live process keeps its own
    finally:
        for path in list(weight_files._OWNED):
            weight_files.remove_weights_dir(path)
    assert not (tmp_path / f"furlong-sglang-weights-{os.getuid()}").exists()  # the root goes with its last engine
