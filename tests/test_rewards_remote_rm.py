"""The ``remote_rm`` reward against a real HTTP server on 127.0.0.1."""

import argparse
import asyncio
import functools
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from furlong.core.config.launch_args import launch_config
from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import PluginError, Sample


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.hits: dict[str, int] = {}
        self.bodies: list[dict] = []
        self.lock = threading.Lock()

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):  # a client that timed out
            super().handle_error(request, client_address)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            server.hits[self.path] = hits = server.hits.get(self.path, 0) + 1
            server.bodies.append(body)
        if self.path == "/length":  # reward = len(response) / 10, as a number
            self.reply(200, json.dumps(len(body["response"]) / 10))
        elif self.path == "/dict":
            self.reply(200, json.dumps({"score": 1.0, "label_seen": body["label"]}))
        elif self.path == "/int":
            self.reply(200, "1")
        elif self.path == "/fail500":
            self.reply(500, "boom")
        elif self.path == "/bad400":
            self.reply(400, "missing field")
        elif self.path == "/flaky":  # 503 on the first hit, then a reward
            self.reply(503, "warming up") if hits == 1 else self.reply(200, "0.5")
        elif self.path == "/slow":
            time.sleep(1.0)
            self.reply(200, "1.0")
        elif self.path == "/text":
            self.reply(200, "good job")
        else:
            self.reply(404, "no such route")

    def reply(self, status, text):
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def server():
    srv = RewardServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(5)


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def url_of(server, path):
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


@functools.cache
def remote_config(url, timeout, retries):
    """The configuration of a run with ``--rm-url url`` (unless None) and remote_rm's own flags."""
    given_url = ["--rm-url", url] if url is not None else []
    return launch_config(*given_url, "--remote-rm-timeout", str(timeout), "--remote-rm-max-retries", str(retries),
                         configure=False)


def remote(pm, url, samples, timeout=5.0, retries=2):
    config = remote_config(url, timeout, retries)
    return asyncio.run(pm.call_chosen("reward", "remote_rm", "--rm-type", config=config, samples=samples))


def test_success_posts_prompt_response_label(pm, server):
    samples = [
        Sample(prompt="1+1?", response="two", label="2"),
        Sample(prompt=[{"role": "user", "content": "hi"}], response="hello!", label={"any": [1]}),
    ]
    assert remote(pm, url_of(server, "/length"), samples) == [0.3, 0.6]  # len("two")/10, len("hello!")/10
    # the two requests run concurrently, so they may arrive in either order
    assert sorted(server.bodies[-2:], key=lambda body: body["response"]) == [
        {"prompt": [{"role": "user", "content": "hi"}], "response": "hello!", "label": {"any": [1]}},
        {"prompt": "1+1?", "response": "two", "label": "2"},
    ]


def test_dict_and_int_answers(pm, server):
    assert remote(pm, url_of(server, "/dict"), [Sample(response="r", label=7)]) == [{"score": 1.0, "label_seen": 7}]
    result = remote(pm, url_of(server, "/int"), [Sample(response="r", label=7)])
    assert result == [1.0] and isinstance(result[0], float)


def test_5xx_is_retried_then_raises(pm, server):
    url = url_of(server, "/fail500")
    with pytest.raises(PluginError) as excinfo:
        remote(pm, url, [Sample(response="r", label=1)], retries=2)
    assert str(excinfo.value) == (
        f"reward 'remote_rm': POST {url} failed after 3 attempt(s): HTTP 500: 'boom'. Check that the reward "
        "server at --rm-url is running and healthy (--remote-rm-timeout and --remote-rm-max-retries set the patience)."
    )
    assert server.hits["/fail500"] == 3  # 1 attempt + 2 retries


def test_retry_recovers_from_a_transient_503(pm, server):
    assert remote(pm, url_of(server, "/flaky"), [Sample(response="r", label=1)], retries=1) == [0.5]
    assert server.hits["/flaky"] == 2


def test_4xx_fails_without_retry(pm, server):
    url = url_of(server, "/bad400")
    with pytest.raises(PluginError) as excinfo:
        remote(pm, url, [Sample(response="r", label=1)], retries=3)
    assert str(excinfo.value) == (
        f"reward 'remote_rm': POST {url} failed: HTTP 400: 'missing field'. The server rejected the request; "
        'check --rm-url and what the server expects (body {"prompt", "response", "label"}).'
    )
    assert server.hits["/bad400"] == 1


def test_timeout_is_retried_then_raises(pm, server):
    url = url_of(server, "/slow")
    remote_config(url, 0.2, 1)  # parsed before the clock starts
    start = time.monotonic()
    with pytest.raises(PluginError) as excinfo:
        remote(pm, url, [Sample(response="r", label=1)], timeout=0.2, retries=1)
    # two attempts of 0.2 s and one 0.25 s back-off, far below the server's 1 s delay per request
    assert time.monotonic() - start < 0.9
    assert str(excinfo.value) == (
        f"reward 'remote_rm': POST {url} failed after 2 attempt(s): timed out after 0.2 s. Check that the reward "
        "server at --rm-url is running and healthy (--remote-rm-timeout and --remote-rm-max-retries set the patience)."
    )


def test_connection_refused(pm):
    probe = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = probe.server_address[1]
    probe.server_close()  # nothing listens on this port any more
    url = f"http://127.0.0.1:{port}/reward"
    with pytest.raises(PluginError) as excinfo:
        remote(pm, url, [Sample(response="r", label=1)], retries=0)
    assert str(excinfo.value) == (
        f"reward 'remote_rm': POST {url} failed after 1 attempt(s): ConnectionRefusedError: [Errno 111] Connection "
        "refused. Check that the reward server at --rm-url is running and healthy (--remote-rm-timeout and "
        "--remote-rm-max-retries set the patience)."
    )


def test_non_json_answer_raises(pm, server):
    url = url_of(server, "/text")
    with pytest.raises(PluginError) as excinfo:
        remote(pm, url, [Sample(response="r", label=1)])
    assert str(excinfo.value) == (
        f"reward 'remote_rm': POST {url} answered 'good job'; expected a JSON number (the reward) or a JSON "
        "object (a dict reward, reduced with --reward-key)."
    )


def test_missing_rm_url(pm):
    with pytest.raises(PluginError) as excinfo:
        remote(pm, None, [Sample(response="r", label=1)])
    assert str(excinfo.value) == (
        "reward 'remote_rm' needs --rm-url: the URL of the reward server to POST samples to "
        "(e.g. --rm-url http://127.0.0.1:8000/reward)."
    )


def test_unserializable_label(pm, server):
    with pytest.raises(PluginError) as excinfo:
        remote(pm, url_of(server, "/length"), [Sample(response="r", label={1, 2}, index=4)])
    assert str(excinfo.value) == (
        "reward 'remote_rm': sample 4 cannot be sent as JSON (Object of type set is not JSON serializable); "
        "its prompt and label must be JSON-serializable."
    )


def test_flags_and_defaults(pm):
    parser = argparse.ArgumentParser()
    pm.get_plugin("remote_rm").add_arguments(parser=parser)
    assert vars(parser.parse_args([])) == {"remote_rm_timeout": 60.0, "remote_rm_max_retries": 3}
    parsed = parser.parse_args(["--remote-rm-timeout", "2.5", "--remote-rm-max-retries", "0"])
    assert (parsed.remote_rm_timeout, parsed.remote_rm_max_retries) == (2.5, 0)


def test_configure_tells_a_missing_url_and_bad_limits_before_any_model_loads():
    from furlong.core.config import ConfigError, parse_args
    from furlong.core.config.configure import configure_plugins
    from furlong.core.plugins.selection import resolve_selection

    def problems(*extra):
        pm = get_plugin_manager()
        args = parse_args(["--num-rollout", "1", "--rollout-batch-size", "2", "--rm-type", "remote_rm", *extra], pm)
        try:
            configure_plugins(args, pm, resolve_selection(args, pm))
        except ConfigError as exc:
            return exc.problems
        return []

    assert problems() == ["--rm-type remote_rm needs --rm-url: the URL of the reward server to POST samples to "
                          "(e.g. --rm-url http://127.0.0.1:8000/reward)."]
    assert problems("--rm-url", "http://127.0.0.1:1/r", "--remote-rm-timeout", "0", "--remote-rm-max-retries", "-1") == [
        "--remote-rm-timeout must be a positive number of seconds, got 0.",
        "--remote-rm-max-retries must be at least 0, got -1."]
    assert problems("--rm-url", "http://127.0.0.1:1/r") == []


def test_boxed_response_is_bare_content(pm, server):
    module = pm.get_plugin("remote_rm")
    assert module.boxed_response("42") == "42"
    assert remote(pm, url_of(server, "/length"), [Sample(response=module.boxed_response("42"), label=1)]) == [0.2]
