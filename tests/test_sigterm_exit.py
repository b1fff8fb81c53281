"""``furlong`` turns SIGTERM into SystemExit(143) and SIGINT into KeyboardInterrupt so that clean-up runs, even
when the signal lands inside a finalizer, where Python ignores exceptions."""

from __future__ import annotations

import signal
import subprocess
import sys

IN_A_FINALIZER = r"""
import os, signal, time
from furlong.core import cli

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


def test_sigterm_inside_a_finalizer_still_exits_143():
    done = subprocess.run([sys.executable, "-c", IN_A_FINALIZER], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    assert done.stdout.split() == ["exit", "143"]
    assert "Exception ignored" not in done.stderr


CTRL_C_IN_A_FINALIZER = IN_A_FINALIZER.replace("signal.SIGTERM", "signal.SIGINT").replace(
    "except SystemExit as exc:\n    print(\"exit\", exc.code)", "except KeyboardInterrupt:\n    print(\"interrupted\")")


def test_ctrl_c_inside_a_finalizer_still_interrupts():
    done = subprocess.run([sys.executable, "-c", CTRL_C_IN_A_FINALIZER], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["interrupted"], done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr
