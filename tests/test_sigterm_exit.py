"""``furlong`` turns SIGTERM into SystemExit(143) and SIGINT into KeyboardInterrupt so that clean-up runs, even
when the signal lands inside a finalizer, where Python ignores exceptions, and whatever signal state its parent
left it: SIGINT ignored (a script's background job), SIGINT or SIGTERM blocked (docs/checkpoints.md, "Stopping a
run")."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from furlong.hooks.testing.processes import signal_state

pytestmark = pytest.mark.signals

IN_A_FINALIZER = r"""
import os, signal, time
from furlong.core.cli import commands as cli

cli._exit_on_signals()


class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10000):  # the handler runs at a bytecode boundary inside this finalizer
            pass


try:
    Finalized()
    time.sleep(10)
except SystemExit as exc:
    print("exit", exc.code)
    raise
print("the signal was lost")
"""


def _run_script(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          preexec_fn=signal_state())


def test_sigterm_inside_a_finalizer_still_exits_143():
    done = _run_script(IN_A_FINALIZER)
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    assert done.stdout.split() == ["exit", "143"]
    assert "Exception ignored" not in done.stderr


CTRL_C_IN_A_FINALIZER = IN_A_FINALIZER.replace("signal.SIGTERM", "signal.SIGINT").replace(
    "except SystemExit as exc:\n    print(\"exit\", exc.code)", "except KeyboardInterrupt:\n    print(\"interrupted\")")


def test_ctrl_c_inside_a_finalizer_still_interrupts():
    done = _run_script(CTRL_C_IN_A_FINALIZER)
    assert done.stdout.split() == ["interrupted"], done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr


IN_A_BACKGROUND_TASK = r"""
import asyncio, gc, os, signal
from furlong.core.cli import commands as cli

cli._exit_on_signals()


async def background():
    await asyncio.sleep(0)
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(10000):  # the handler runs at a bytecode boundary inside this task
        pass


async def main():
    task = asyncio.ensure_future(background())
    await asyncio.sleep(10)


try:
    asyncio.run(cli.until_stopped(main()))
except SystemExit as exc:
    print("exit", exc.code)
    gc.collect()  # the task that caught the signal is collected
    raise
"""


def test_sigterm_inside_a_background_task_exits_143_with_no_lost_task_report():
    done = _run_script(IN_A_BACKGROUND_TASK)
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    assert done.stdout.split() == ["exit", "143"]
    assert done.stderr == ""


def test_other_task_errors_still_reach_asyncios_report():
    script = IN_A_BACKGROUND_TASK.replace("os.kill(os.getpid(), signal.SIGTERM)", "raise ValueError('lost')")
    done = _run_script(script.replace("asyncio.sleep(10)", "asyncio.sleep(0.1)"))
    assert "Task exception was never retrieved" in done.stderr and "ValueError: lost" in done.stderr


HANDLER_AT_PARSE = r"""
import signal
from furlong.core import config
from furlong.core.cli import commands as cli


def parse_args(*args, **kwargs):
    print(signal.getsignal(signal.SIGTERM) is cli._raise_where_it_propagates)
    raise SystemExit(0)


config.parse_args = parse_args
cli.main(["train", "--num-rollout", "1"])
"""


def test_the_stop_handlers_are_installed_before_the_flags_are_parsed():
    """Parsing imports torch and the plugins, seconds in all: a stop signal sent then is not lost."""
    done = _run_script(HANDLER_AT_PARSE)
    assert done.stdout.split() == ["True"], done.stdout + done.stderr


STATE = ("import signal; handler = signal.getsignal(signal.SIGINT); "
         "print('ignored' if handler == signal.SIG_IGN else 'default' if handler is signal.default_int_handler "
         "else handler, *sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))")
CLEAN_CHILD = f"""
import subprocess, sys
from furlong.hooks.testing.processes import signal_state
{STATE}
sys.stdout.flush()
subprocess.run([sys.executable, "-c", {STATE!r}], preexec_fn=signal_state())
"""


def test_signal_state_starts_a_child_in_the_state_asked_for_whatever_its_parent_is_in():
    # a parent that ignores SIGINT and blocks SIGINT and SIGTERM starts a child with neither
    done = subprocess.run([sys.executable, "-c", CLEAN_CHILD], capture_output=True, text=True, timeout=60,
                          preexec_fn=signal_state(ignored={signal.SIGINT}, blocked={signal.SIGINT, signal.SIGTERM}))
    assert done.stdout.splitlines() == ["ignored SIGINT SIGTERM", "default"], done.stderr


NUM_ROLLOUT = 1000  # far more than run before the signal: a lost signal fails on the fixture's time-out


def _train(model, data, save) -> list[str]:
    return ["-m", "furlong.core", "train", "--hf-checkpoint", str(model), "--prompt-data", str(data),
            "--input-key", "prompt", "--label-key", "label", "--rm-type", "deterministic_random",
            "--num-rollout", str(NUM_ROLLOUT), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--rollout-max-response-len", "4", "--save-interval", "1", "--save", str(save)]


INT, TERM = signal.SIGINT, signal.SIGTERM


@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum, ignored, blocked, code, note", [
    # a non-interactive shell's `furlong train ... &`: SIGINT ignored; `kill -INT` still stops the run
    (INT, {INT, signal.SIGQUIT}, (), 130, None),
    (INT, (), {INT, TERM}, 130, "note: SIGINT and SIGTERM were blocked by the parent process; furlong unblocks "
                                "them so Ctrl-C and SIGTERM stop the run"),
    (TERM, {INT, TERM}, {TERM}, 143, "note: SIGTERM was blocked by the parent process; furlong unblocks it so "
                                     "SIGTERM stops the run"),
], ids=["sigint-ignored", "sigint-blocked", "sigterm-ignored-and-blocked"])
def test_a_run_stops_on_the_signal_whatever_state_its_parent_left(signal_after_rollout_1, tmp_path, tiny_model_dir,
                                                                  arithmetic_jsonl, signum, ignored, blocked, code,
                                                                  note):
    save = tmp_path / "run"
    exit_code, output = signal_after_rollout_1(signum, *_train(tiny_model_dir, arithmetic_jsonl, save),
                                               ignored=ignored, blocked=blocked)
    assert exit_code == code, output[-3000:]
    assert ("interrupted" in output.splitlines()) == (signum == INT), output[-3000:]
    notes = [line for line in output.splitlines() if line.startswith("note: ")]
    assert notes == ([note] if note else []), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    last = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= last < NUM_ROLLOUT - 1  # stopped early, with rollout 1's checkpoint or a later one complete
    assert load_file(save / f"iter_{last:07d}" / "model" / "model.safetensors")
