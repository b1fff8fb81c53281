"""The calculator and the Python sandbox on their own."""

from __future__ import annotations

import asyncio
import os

import pytest

from furlong_tool_use.calculator import calculate
from furlong_tool_use.sandbox import run_python


@pytest.mark.parametrize("expression, expected", [
    ("6*7", "42"), ("2^10", "1024"), ("(1+2)/4", "0.75"), ("-3 + sqrt(16)", "1"), ("7 // 2 + 7 % 2", "4"),
    ("max(2, 5)", "5"), ("10/0", "error: division by zero"), ("2**100000", "error: exponent 100000 is above 1000"),
    ("__import__('os')", "error: unsupported: __import__('os')"), ("1 +", "error: invalid syntax (<unknown>, line 1)"),
])
def test_calculator(expression, expected):
    assert calculate(expression) == expected


def python(code, timeout=3.0, memory_mb=256):
    return asyncio.run(run_python(code, timeout, memory_mb, max_chars=2000))


def test_python_prints_and_may_write_its_own_folder():
    assert python("print(sum(range(10)))") == "45\n"
    assert python("open('notes.txt', 'w').write('kept'); print(open('notes.txt').read())") == "kept\n"


@pytest.mark.parametrize("code, refusal", [
    ("import socket; socket.create_connection(('127.0.0.1', 9))", "PermissionError: sandbox: socket."),
    ("import subprocess; subprocess.run(['true'])", "PermissionError: sandbox: subprocess.Popen is not allowed"),
    ("import os; os.system('true')", "PermissionError: sandbox: os.system is not allowed"),
    ("import os; os.fork()", "PermissionError: sandbox: os.fork is not allowed"),
    ("import ctypes; ctypes.CDLL(None).getpid()", "PermissionError: sandbox: ctypes.dlsym is not allowed"),
    ("import resource; resource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
     "PermissionError: sandbox: resource.setrlimit is not allowed"),
    ("import os; os.kill(os.getppid(), 9)", "PermissionError: sandbox: os.kill is not allowed"),
])
def test_python_refuses_network_processes_and_escapes(code, refusal):
    out = python(code)
    assert refusal in out and out.startswith(("Traceback", "[cut]"))


def test_python_cannot_write_outside_its_folder(tmp_path):
    target = tmp_path / "outside.txt"
    out = python(f"open({str(target)!r}, 'w').write('x')")
    assert f"PermissionError: sandbox: writing {target} is not allowed" in out and not target.exists()
    target.write_text("keep")
    assert "os.remove outside the working folder" in python(f"import os; os.remove({str(target)!r})")
    assert target.read_text() == "keep"


def test_python_limits_memory_time_and_output():
    assert python("x = bytearray(1 << 30)", memory_mb=256).endswith("MemoryError\n")
    assert python("while True: pass", timeout=1.0) == "error: timed out after 1 s"
    assert python("raise SystemExit(3)") == "error: exit code 3"
    long = asyncio.run(run_python("print('a' * 50 + 'END')", 3.0, 256, max_chars=10))
    assert long == "[cut]...aaaaaaEND\n"


def test_a_timed_out_child_leaves_no_process():
    async def run():
        started = []
        out = await run_python("import time; time.sleep(60)", 0.5, 256, 100, on_start=started.append)
        return out, started[0]

    out, process = asyncio.run(run())
    assert out == "error: timed out after 0.5 s" and process.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(process.pid, 0)
