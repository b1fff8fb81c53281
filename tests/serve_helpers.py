"""Start ``furlong serve`` on loopback for tests, talk to it, and always stop it.

``running_server(model_dir, *flags)`` is a context manager: a real server process on a
free port (one torch thread), started with default signal actions and an empty signal mask
(``ignored``/``blocked`` change that on purpose: furlong.hooks.testing.processes), ready once
``GET /health`` answers 200, SIGTERMed (then killed) on exit. ``call`` sends one request with urllib and returns ``(status, body)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

from furlong.kit.dist import free_port
from furlong.hooks.testing.processes import signal_state

START_TIMEOUT_S = 60


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log_path: str) -> None:
        self.proc, self.url, self.log_path = proc, url, log_path

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def call(self, path: str, body: Any = None, method: str | None = None, raw: bytes | None = None,
             timeout: float = 60) -> tuple[int, Any]:
        """``(status, parsed JSON or text)``; a body makes it a POST unless ``method`` says otherwise."""
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method or ("POST" if data else "GET"),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return answer.status, _parse(answer.read(), answer.headers.get_content_type())
        except urllib.error.HTTPError as exc:
            return exc.code, _parse(exc.read(), exc.headers.get_content_type())


def _parse(raw: bytes, content_type: str) -> Any:
    text = raw.decode()
    return json.loads(text) if content_type == "application/json" and text else text


def sse_events(raw: str) -> list:
    """The ``data:`` payloads of an SSE body: parsed JSON, or the literal ``"[DONE]"``."""
    events = []
    for block in raw.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@contextlib.contextmanager
def running_server(model_dir, *flags: str, log_dir, ignored=(), blocked=()) -> Iterator[Server]:
    port = free_port()
    log_path = os.path.join(str(log_dir), f"serve-{port}.log")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "furlong.core", "serve", "--hf-checkpoint", str(model_dir),
                                 "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=signal_state(ignored, blocked))
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"furlong serve exited with {proc.returncode}:\n{server.log()}")
            try:
                if server.call("/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"furlong serve did not answer /health in {START_TIMEOUT_S} s:\n{server.log()}")
            time.sleep(0.2)
        yield server
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout: float = 15) -> int:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode
