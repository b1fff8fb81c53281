"""The ``sglang`` engine's requests and its reading of answers, against SGLang's schema (tests/fixtures/sglang).

The client talks to a recording HTTP server on loopback: every body it sends to a control
endpoint uses only keys SGLang 0.5.23 defines for that endpoint, with the same JSON types;
SGLang's ``/generate`` answer (logprob triples, tagged finish reasons) becomes the
GenerateOutput the core expects.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from furlong.hooks import PluginError

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "sglang"


def fixture(name: str):
    return json.loads((FIXTURES / name).read_text())


def engine_for(url: str, router_url: str | None = None, policy: str | None = None):
    from furlong.builtin_plugins.engines.sglang.engine import SGLangEngine
    from furlong.core.config.launch_args import launch_config

    from .configs import with_derived

    given_policy = ["--sglang-router-policy", policy] if policy else []
    config = launch_config("--rollout-num-gpus-per-engine", "1", "--sglang-server-restarts", "0", *given_policy,
                           "--sglang-server-concurrency", "4", "--sglang-router-request-timeout-secs", "30",
                           "--distributed-timeout-minutes", "1", configure=False)
    config = with_derived(config, "sglang", sglang_engines_per_process=1, sglang_router_given=False)
    return SGLangEngine(config, 0, url, router_url or url, None, False, tokenizer=None)


def test_sglang_generate_answer_becomes_a_generate_output():
    engine = engine_for("http://127.0.0.1:1")
    out = engine._output(fixture("generate_response_logprob.json"))
    assert out.output_ids == [73, 44, 21, 4, 91, 30, 84, 1]
    assert out.output_log_probs == [-4.61, -4.58, -4.57, -4.63, -4.59, -4.6, -4.55, -4.62]
    assert (out.finish_reason, out.weight_version, out.text) == ("length", "default", "fK1 x;q")


@pytest.mark.parametrize("name, kind", [("stop_token", "stop"), ("stop_string", "stop"), ("length", "length"),
                                        ("abort", "abort")])
def test_every_tagged_finish_reason_is_read(name, kind):
    answer = fixture("generate_response_logprob.json")
    answer["meta_info"]["finish_reason"] = fixture("finish_reasons.json")[name]
    assert engine_for("http://127.0.0.1:1")._output(answer).finish_reason == kind


def test_an_answer_that_is_not_sglangs_names_the_router():
    answer = fixture("generate_response_logprob.json")
    answer["output_ids"] = answer["output_ids"][:-1]
    with pytest.raises(PluginError, match=r"router at http://127.0.0.1:1 .*output_ids \(7\) and "
                                          r"output_token_logprobs \(8\) disagree"):
        engine_for("http://127.0.0.1:1")._output(answer)


def test_control_requests_use_sglangs_keys_and_types(tmp_path):
    import torch
    from aiohttp import web

    from furlong.kit.dist import free_port

    expected = fixture("control_requests.json")
    seen: dict[str, list] = {}
    keys: list = []

    async def record(request):
        body = await request.json() if request.can_read_body else None
        if request.path == "/generate":
            keys.append(request.headers.get("X-SMG-Routing-Key"))
            return web.json_response(fixture("generate_response_logprob.json"))
        seen.setdefault(request.path, []).append(body)
        return web.json_response({"success": True, "message": "ok"})

    async def main():
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", record)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        engine = engine_for(f"http://127.0.0.1:{port}", policy="consistent_hashing")
        from furlong.builtin_plugins.engines.sglang.http import shared_http

        engine.http = shared_http(4)
        try:
            for _ in range(2):
                assert (await engine.generate([1, 2], {"max_new_tokens": 8})).output_ids[0] == 73
            await engine.abort()
            await engine.pause_generation("retract")
            await engine.flush_cache()
            await engine.init_weights_update_group("127.0.0.1", 29555, 1, 2, "g", "gloo")
            await engine.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[26, 128]], "g")
            await engine.load_weights([("lm_head.weight", torch.zeros(2, 3))])
            await engine.set_weight_version(3)
            await engine.continue_generation()
            await engine.release_memory()
            await engine.resume_memory()
            await engine.destroy_weights_update_group("g")
        finally:
            await engine.shutdown()
            await runner.cleanup()

    asyncio.run(main())
    assert set(seen) == set(expected) - {"/update_weights_from_tensor"} | {"/flush_cache"}
    for path, bodies in seen.items():
        for body in bodies:
            if path == "/flush_cache":
                continue
            assert set(body) <= set(expected[path]), (path, body)
            for key, value in body.items():
                reference = expected[path][key]
                if reference is not None and value is not None:
                    assert type(value) is type(reference), (path, key, value, reference)
    assert seen["/update_weight_version"] == [{"new_version": "3", "abort_all_requests": False}]
    assert seen["/abort_request"] == [{"abort_all": True}]
    assert len(keys) == 2 and None not in keys and keys[0] != keys[1]  # a routing key per request


def test_a_call_that_keeps_failing_names_the_url_the_attempts_and_the_last_error():
    from furlong.builtin_plugins.engines.sglang.http import HttpError, release_http, shared_http
    from furlong.kit.dist import free_port

    url = f"http://127.0.0.1:{free_port()}/health"  # nothing listens there

    async def main():
        http = shared_http(1)
        try:
            await http.call("GET", url, timeout_s=5, retries=2)
        finally:
            await release_http()

    with pytest.raises(HttpError, match=rf"GET {url} failed after 3 attempt\(s\): ClientConnectorError: .*"):
        asyncio.run(main())
