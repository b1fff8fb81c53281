"""``furlong serve`` as a real server process on loopback, serving the tiny model (tests/tiny_model.py).

One server for the session (``serve_server`` in conftest.py; a test that changes its
weights restores them); one more for the SIGTERM test. Outputs are compared with the
embedded engine run in this process.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_helpers import running_server, sse_events, stop  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402

from furlong.builtin_plugins.engines import embedded  # noqa: E402
from furlong.core.cli.commands import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 1000, "ignore_eos": True}  # near the tiny model's context of 1024


@pytest.fixture
def server(serve_server):
    return serve_server


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return embedded.load_engine(str(tiny_model_dir))


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """The tiny model with other random weights (seed 1): a weight update to apply."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_seed1") / "model", seed=1)


def _engine_output(engine, ids, params):
    return asyncio.run(engine.generate(list(ids), dict(params)))


def _generate(server, **body):
    status, out = server.call("/generate", body)
    assert status == 200, out
    return out


def _in_thread(fn, *args):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn(*args)), daemon=True)
    thread.start()
    return thread, result


def _wait_running(server, n, timeout=20):
    deadline = time.monotonic() + timeout
    while server.call("/server_info")[1]["internal_states"][0]["running_requests"] != n:
        assert time.monotonic() < deadline, f"never {n} running requests"
        time.sleep(0.02)


def _stream_lines(server, body, sink, label=None):
    """POST a streaming /generate; append each event (or ``(label, event)``) to ``sink`` as it arrives."""
    import json

    request = urllib.request.Request(server.url + "/generate", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.headers.get_content_type() == "text/event-stream"
        for line in answer:
            line = line.decode().rstrip("\n")
            if line.startswith("data: "):
                payload = line[len("data: "):]
                event = payload if payload == "[DONE]" else json.loads(payload)
                sink.append(event if label is None else (label, event))
    return sink


# --- generate -------------------------------------------------------------------------------------


def test_greedy_generate_is_deterministic_and_equals_the_engine(server, engine):
    ids = engine.tokenizer.encode("Hello there")
    first = _generate(server, input_ids=ids, sampling_params=GREEDY)
    second = _generate(server, input_ids=ids, sampling_params=GREEDY)
    local = _engine_output(engine, ids, GREEDY)
    assert first["output_ids"] == second["output_ids"] == local.output_ids
    assert first["text"] == engine.tokenizer.decode(local.output_ids, skip_special_tokens=True)
    meta = first["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 12)
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["weight_version"] == "default" and "output_token_logprobs" not in meta
    assert len(meta["id"]) == 32 and meta["id"] != second["meta_info"]["id"]  # a fresh id per request


def test_text_prompts_are_tokenised_and_logprobs_are_triples(server, engine):
    params = {"temperature": 0.7, "max_new_tokens": 6, "sampling_seed": 5, "ignore_eos": True}
    out = _generate(server, text="Q: 2+3=", sampling_params=params, return_logprob=True, rid="r1")
    local = _engine_output(engine, engine.tokenizer.encode("Q: 2+3="), params)
    assert out["meta_info"]["id"] == "r1" and out["output_ids"] == local.output_ids
    triples = out["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == local.output_ids and [t[2] for t in triples] == [None] * 6
    assert [t[0] for t in triples] == pytest.approx(local.output_log_probs, abs=1e-5)
    with_text = _generate(server, text="Q: 2+3=", sampling_params=params, return_logprob=True,
                          return_text_in_logprobs=True)
    assert [t[2] for t in with_text["meta_info"]["output_token_logprobs"]] == [
        engine.tokenizer.decode([i]) for i in local.output_ids]


def test_a_batch_answers_a_list_with_expanded_rids(server, engine):
    out = _generate(server, text=["abc", "The sky is"], rid="b",
                    sampling_params=[dict(GREEDY, max_new_tokens=3), dict(GREEDY, max_new_tokens=5)],
                    return_logprob=[True, False])
    assert [o["meta_info"]["id"] for o in out] == ["b_0", "b_1"]
    assert [o["meta_info"]["completion_tokens"] for o in out] == [3, 5]
    assert "output_token_logprobs" in out[0]["meta_info"] and "output_token_logprobs" not in out[1]["meta_info"]
    single = _generate(server, text="The sky is", sampling_params=dict(GREEDY, max_new_tokens=5))
    assert out[1]["output_ids"] == single["output_ids"]


def test_finish_reasons_and_stop_trimming(server, engine):
    ids = engine.tokenizer.encode("Hello there")
    free = _generate(server, input_ids=ids, sampling_params=GREEDY)["output_ids"]
    decode = engine.tokenizer.decode
    stop_id = free[3]
    k = free.index(stop_id) + 1  # where the greedy output first emits it
    by_token = _generate(server, input_ids=ids, sampling_params=dict(GREEDY, stop_token_ids=[stop_id]))
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert by_token["output_ids"] == free[:k]  # the matched token stays in output_ids
    assert by_token["text"] == decode(free[: k - 1], skip_special_tokens=True)  # and leaves the text
    stop_text = decode(free[4:6], skip_special_tokens=True)
    k = next(n for n in range(1, len(free) + 1) if stop_text in decode(free[:n], skip_special_tokens=True))
    by_string = _generate(server, input_ids=ids, sampling_params=dict(GREEDY, stop=[stop_text]))
    assert by_string["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
    assert by_string["output_ids"] == free[:k]
    full = decode(free[:k], skip_special_tokens=True)
    assert by_string["text"] == full[: full.find(stop_text)]
    untrimmed = _generate(server, input_ids=ids, sampling_params=dict(GREEDY, stop=stop_text, no_stop_trim=True))
    assert untrimmed["text"] == full


@pytest.mark.parametrize("body, message", [
    ({"input_ids": [5, 6], "sampling_params": {"temprature": 0.5}},
     "/generate 'sampling_params': unknown field 'temprature'; fields: beam_width, choice, custom_params, ebnf, "
     "frequency_penalty, ignore_eos, json_schema, logit_bias, max_new_tokens, min_new_tokens, min_p, n, no_stop_trim, "
     "presence_penalty, regex, repetition_penalty, sampling_seed, skip_special_tokens, spaces_between_special_tokens, "
     "stop, stop_regex, stop_token_ids, stream_interval, structural_tag, temperature, top_k, top_p, watermark"),
    ({"input_ids": [5, 6], "sampling_params": {"n": 2}},
     "/generate 'sampling_params': field 'n' = 2 is not supported by furlong serve (only its off value: null, "
     "false, empty or 1)"),
    ({"input_ids": [5, 6], "sampling_params": {"temperature": "hot"}},
     "/generate 'sampling_params' 'temperature': expected a number, got str 'hot'"),
    ({"input_ids": [5, 6], "sampling_params": {"temperature": -1}},
     "embedded engine: sampling_params['temperature'] = -1.0 must be >= 0 (0 = greedy)."),
    ({"input_ids": [5, 6], "lora_path": "adapter"},
     "/generate: field 'lora_path' = 'adapter' is not supported by furlong serve (only its off value: null, "
     "false, empty)"),
    ({"input_ids": [5, 6], "colour": "red"}, "/generate: unknown field 'colour'; fields: "),
    ({"input_ids": [5, 6], "colour": None, "shade": "dark"}, "/generate: unknown field 'shade'; fields: "),
    ({"input_ids": [5, 6], "text": "x"}, "/generate: give exactly one of 'text' and 'input_ids'"),
    ({"input_ids": []}, "/generate: empty prompt; give at least one character or token id per prompt"),
    ({"input_ids": [5, 100]}, "/generate: token id 100 of request 'x' is outside the vocabulary [0, 100)"),
    ({"text": ["a", "b"], "rid": ["x"]}, "/generate 'rid': 1 ids for 2 prompt(s); give one string per prompt"),
    ({"input_ids": [5] * 1024}, "/generate: the prompt of request 'x' has 1024 tokens; the model's context length "
     "is 1024 tokens (prompt plus generated tokens); send a shorter prompt."),
    ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1023, "ignore_eos": True}},
     "/generate: request 'x' asks for 2 prompt tokens + 1023 max_new_tokens = 1025 tokens; the model's context "
     "length is 1024 tokens: lower max_new_tokens to at most 1022 or shorten the prompt."),
    ({"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 3},
     "/generate: logprob_start_len=3 is higher than the number of input tokens 2 of request 'x'"),
])
def test_bad_generate_requests_are_400_with_a_clear_message(server, body, message):
    """SGLang 0.5.23's two bodies: a broken JSON contract answers ``{"error": "<message>"}``; a request the
    server refuses after reading it (sampling values, vocabulary, context) ``{"error": {"message"}}``."""
    status, out = server.call("/generate", {"rid": "x", **body} if "input_ids" in body else body)
    assert status == 400
    assert set(out) == {"error"}
    refused = message.startswith(("embedded engine", "/generate: token id", "/generate: the prompt",
                                  "/generate: request", "/generate: logprob_start_len"))
    text = out["error"]["message"] if refused else out["error"]
    assert isinstance(text, str) and text.startswith(message), out


def test_a_prompt_plus_max_new_tokens_equal_to_the_context_is_served(server):
    """SGLang refuses only a total above the context length (``tokenizer_manager.py``)."""
    out = _generate(server, input_ids=[5, 6], sampling_params=dict(GREEDY, max_new_tokens=1022), return_logprob=True)
    assert out["meta_info"]["completion_tokens"] <= 1022


def test_prompt_log_probs_from_logprob_start_len(server, engine):
    """``input_token_logprobs`` holds the prompt's tokens from ``logprob_start_len`` on, each scored given the
    ones before it (the first prompt token has none: null); the default (-1) holds none."""
    import torch

    ids = engine.tokenizer.encode("The sky is blue")
    whole = _generate(server, input_ids=ids, sampling_params=dict(GREEDY, max_new_tokens=3), return_logprob=True,
                      logprob_start_len=0)
    entries = whole["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids and entries[0][0] is None
    with torch.no_grad():
        expected = torch.log_softmax(engine.model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    assert [e[0] for e in entries[1:]] == pytest.approx(
        expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), abs=1e-4)
    assert whole["meta_info"]["output_token_logprobs_length"] == 3
    tail = _generate(server, input_ids=ids, sampling_params=dict(GREEDY, max_new_tokens=3), return_logprob=True,
                     logprob_start_len=len(ids) - 2)
    assert tail["meta_info"]["input_token_logprobs"] == entries[-2:]
    default = _generate(server, input_ids=ids, sampling_params=dict(GREEDY, max_new_tokens=3), return_logprob=True)
    assert default["meta_info"]["input_token_logprobs"] == []


def test_bad_json_and_bad_control_bodies_are_400(server):
    """SGLang answers a body its request type cannot read with its validation error body."""
    assert server.call("/generate", raw=b"{not json") == (400, {
        "object": "error", "type": "Bad Request", "param": None, "code": 400, "message": (
            "/generate: the body is not valid JSON (Expecting property name enclosed in double quotes: line 1 "
            "column 2 (char 1))")})
    status, out = server.call("/pause_generation", {"mode": "sideways"})
    assert (status, out["message"]) == (400, "/pause_generation 'mode': 'sideways' is not one of 'abort', "
                                             "'retract', 'in_place'")
    status, out = server.call("/abort_request", {"rid": "x", "everything": True})
    assert (status, out["message"]) == (400, "/abort_request: unknown field 'everything'; fields: abort_all, rid")
    assert server.call("/loads")[0] == 404  # routers accept a 404 here


# --- streaming, concurrency, abort, pause -----------------------------------------------------------


def test_streaming_sends_one_event_per_token_then_done(server, engine):
    ids = engine.tokenizer.encode("Hello there")
    events = _stream_lines(server, {"input_ids": ids, "sampling_params": dict(GREEDY, max_new_tokens=5),
                                    "return_logprob": True}, [])
    whole = _generate(server, input_ids=ids, sampling_params=dict(GREEDY, max_new_tokens=5), return_logprob=True)
    assert events[-1] == "[DONE]"
    chunks, final = events[:-2], events[-2]
    assert chunks, "no chunk before the final one"
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(set(lengths)) and lengths[-1] <= 5  # cumulative, growing (one per token when idle)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks)
    assert all(whole["output_ids"][: len(c["output_ids"])] == c["output_ids"] for c in chunks)
    assert all(whole["text"].startswith(c["text"]) for c in chunks)
    assert final["output_ids"] == whole["output_ids"] and final["text"] == whole["text"]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert [t[1] for t in final["meta_info"]["output_token_logprobs"]] == whole["output_ids"]


def test_a_streamed_batch_names_each_chunk_s_prompt(server):
    prompts = ["abc", "The sky is"]
    body = {"text": prompts, "sampling_params": [dict(GREEDY, max_new_tokens=4), dict(GREEDY, max_new_tokens=7)]}
    events = _stream_lines(server, body, [])
    whole = _generate(server, **body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    for i in (0, 1):
        mine = [e for e in events[:-1] if e["index"] == i]
        assert mine[-1]["output_ids"] == whole[i]["output_ids"] and mine[-1]["meta_info"]["finish_reason"]
        assert all(e["meta_info"]["finish_reason"] is None for e in mine[:-1])


def test_incremental_streaming_sends_only_what_is_new(engine, tiny_model_dir):
    """``--incremental-streaming-output``: the app served in this process on loopback (aiohttp's test server)."""
    from aiohttp.test_utils import TestClient, TestServer

    from furlong.core.serve.app import make_app
    from furlong.core.serve.command import build_serve_parser
    from furlong.core.serve.state import ServeState

    args = build_serve_parser().parse_args(["--hf-checkpoint", str(tiny_model_dir), "--incremental-streaming-output"])
    ids = engine.tokenizer.encode("Hello there")
    params = dict(GREEDY, max_new_tokens=6)

    async def scenario():
        async with TestClient(TestServer(make_app(ServeState(engine, args)))) as client:
            answer = await client.post("/generate", json={"input_ids": ids, "sampling_params": params, "stream": True,
                                                          "return_logprob": True})
            return sse_events(await answer.text())

    events = asyncio.run(scenario())
    whole = _engine_output(engine, ids, params)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert sum((c["output_ids"] for c in chunks), []) == whole.output_ids  # the pieces add up, nothing repeats
    assert "".join(c["text"] for c in chunks) == engine.tokenizer.decode(whole.output_ids, skip_special_tokens=True)
    assert [t[1] for c in chunks for t in c["meta_info"]["output_token_logprobs"]] == whole.output_ids
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert all(c["meta_info"]["completion_tokens"] == sum(len(x["output_ids"]) for x in chunks[: i + 1])
               for i, c in enumerate(chunks))


def test_concurrent_requests_are_decoded_together(server, engine):
    """Requests queued while the engine is busy decode in one batch: their streams interleave."""
    holder, _ = _in_thread(server.call, "/generate", {"input_ids": [5, 6, 7], "sampling_params": LONG, "rid": "hold"})
    _wait_running(server, 1)
    assert server.call("/pause_generation", {"mode": "in_place"})[0] == 200
    sink, threads = [], []
    for label, prompt in (("a", "abc"), ("b", "The sky is")):
        body = {"text": prompt, "sampling_params": dict(GREEDY, max_new_tokens=60)}
        threads.append(_in_thread(_stream_lines, server, body, sink, label)[0])
    _wait_running(server, 3)
    assert server.call("/abort_request", {"rid": "hold"})[0] == 200
    assert server.call("/continue_generation", {})[0] == 200
    for t in threads + [holder]:
        t.join(60)
    order = [label for label, event in sink if event != "[DONE]"]
    last_a, last_b = len(order) - 1 - order[::-1].index("a"), len(order) - 1 - order[::-1].index("b")
    assert order.index("b") < last_a and order.index("a") < last_b  # interleaved, not one after the other
    for label, prompt in (("a", "abc"), ("b", "The sky is")):
        final = [e for lab, e in sink if lab == label and e != "[DONE]"][-1]
        assert final["output_ids"] == _engine_output(engine, engine.tokenizer.encode(prompt),
                                                     dict(GREEDY, max_new_tokens=60)).output_ids


def test_abort_request_returns_the_partial_greedy_tokens(server):
    thread, result = _in_thread(server.call, "/generate", {"input_ids": [5, 6, 7], "sampling_params": LONG,
                                                           "rid": "long"})
    _wait_running(server, 1)
    time.sleep(0.3)
    assert server.call("/abort_request", {"rid": "long"}) == (200, "")
    thread.join(30)
    status, out = result["value"]
    assert status == 200
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted by /abort_request",
                                                 "status_code": None, "err_type": None}
    n = out["meta_info"]["completion_tokens"]
    assert 0 < n < 1000 and len(out["output_ids"]) == n
    again = _generate(server, input_ids=[5, 6, 7], sampling_params=dict(GREEDY, max_new_tokens=min(n, 20)))
    assert out["output_ids"][: len(again["output_ids"])] == again["output_ids"]
    assert server.call("/abort_request", {"rid": "nobody"}) == (200, "")  # unknown ids are ignored, as in SGLang


def test_abort_all_ends_every_running_request(server):
    threads = [_in_thread(server.call, "/generate", {"input_ids": [5, 6], "sampling_params": LONG}) for _ in range(2)]
    _wait_running(server, 2)
    assert server.call("/abort_request", {"abort_all": True}) == (200, "")
    for thread, result in threads:
        thread.join(30)
        assert result["value"][1]["meta_info"]["finish_reason"]["message"] == "Aborted by /abort_request (abort_all)"


def test_a_client_that_goes_away_ends_its_request(server):
    import json
    import socket

    body = json.dumps({"input_ids": [5, 6], "sampling_params": LONG}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        _wait_running(server, 1)
    _wait_running(server, 0)  # the engine dropped it


def test_pause_holds_decoding_until_continue_and_flush_cache_follows_sglang(server):
    sink = []
    thread, _ = _in_thread(_stream_lines, server, {"input_ids": [5, 6], "sampling_params": LONG, "rid": "p"}, sink)
    _wait_running(server, 1)
    assert server.call("/flush_cache")[0] == 400  # a request is running
    assert server.call("/pause_generation", {"mode": "in_place"}) == (
        200, {"message": "Generation paused successfully.", "status": "ok"})
    time.sleep(0.2)
    held = len(sink)
    time.sleep(0.3)
    assert len(sink) == held  # nothing decodes while paused
    assert server.call("/flush_cache")[0] == 400  # in place: the running request keeps its cache
    assert server.call("/pause_generation", {"mode": "retract"})[0] == 200
    assert server.call("/flush_cache") == (200, "Cache flushed.\n")
    assert server.call("/continue_generation", {"torch_empty_cache": True}) == (
        200, {"message": "Generation continued successfully.", "status": "ok"})
    deadline = time.monotonic() + 10
    while len(sink) <= held + 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert server.call("/pause_generation", {})[0] == 200  # default mode abort ends it
    thread.join(30)
    assert sink[-1] == "[DONE]"
    assert sink[-2]["meta_info"]["finish_reason"]["message"] == "Aborted by /pause_generation"
    assert server.call("/continue_generation", {})[0] == 200
    assert server.call("/flush_cache")[0] == 200


def test_a_request_that_straddles_a_version_update_reports_its_spans(server):
    sink = []
    thread, _ = _in_thread(_stream_lines, server, {"input_ids": [5, 6], "sampling_params": LONG, "rid": "v"}, sink)
    _wait_running(server, 1)
    while len(sink) < 3:
        time.sleep(0.01)
    assert server.call("/update_weight_version", {"new_version": "9", "abort_all_requests": False})[0] == 200
    seen = len(sink)
    while len(sink) < seen + 3:
        time.sleep(0.01)
    assert server.call("/abort_request", {"rid": "v"})[0] == 200
    thread.join(30)
    meta = sink[-2]["meta_info"]
    n = meta["completion_tokens"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "9"] and meta["weight_version"] == "9"
    assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == n
    assert "weight_versions" not in sink[0]["meta_info"]  # one version so far
    assert server.call("/update_weight_version", {"new_version": "default"})[0] == 200


# --- health and info --------------------------------------------------------------------------------


def test_health_info_and_model_list(server, tiny_model_dir):
    assert server.call("/health") == (200, "")
    assert server.call("/health_generate") == (200, "")
    status, model = server.call("/model_info")
    assert status == 200 and server.call("/get_model_info") == (200, model)
    assert (model["model_path"], model["is_generation"], model["architectures"]) == (
        str(tiny_model_dir), True, ["LlamaForCausalLM"])
    status, info = server.call("/server_info")
    assert status == 200 and (info["tp_size"], info["dp_size"], info["context_length"]) == (1, 1, 1024)
    assert server.call("/get_server_info")[1]["model_path"] == str(tiny_model_dir)
    models = server.call("/v1/models")[1]
    assert [(m["id"], m["owned_by"], m["max_model_len"]) for m in models["data"]] == [
        (str(tiny_model_dir), "sglang", 1024)]


def test_memory_release_and_resume_answer_null_and_generation_still_works(server):
    assert server.call("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}) == (200, None)
    assert server.call("/resume_memory_occupation", {"tags": None}) == (200, None)
    assert server.call("/release_memory_occupation", {"tags": ["gpu"]})[0] == 400
    assert len(_generate(server, input_ids=[5, 6], sampling_params=GREEDY)["output_ids"]) == 12


# --- weights ----------------------------------------------------------------------------------------


def test_weight_version_and_disk_update(server, engine, tiny_model_dir, other_model_dir):
    ids = engine.tokenizer.encode("Hello there")
    before = _generate(server, input_ids=ids, sampling_params=GREEDY)
    assert server.call("/update_weight_version", {"new_version": "3"}) == (
        200, {"success": True, "message": "Weight version updated to 3", "new_version": "3"})
    assert server.call("/model_info")[1]["weight_version"] == "3"
    status, out = server.call("/update_weights_from_disk", {"model_path": str(other_model_dir),
                                                             "weight_version": "4"})
    assert (status, out["success"], out["num_paused_requests"]) == (200, True, 0)
    after = _generate(server, input_ids=ids, sampling_params=GREEDY)
    expected = _engine_output(embedded.load_engine(str(other_model_dir)), ids, GREEDY).output_ids
    assert after["output_ids"] == expected != before["output_ids"]
    assert after["meta_info"]["weight_version"] == "4"
    assert server.call("/pause_generation", {"mode": "retract"})[0] == 200  # the client's own pause...
    assert server.call("/update_weights_from_disk", {"model_path": str(other_model_dir)})[0] == 200
    assert server.call("/server_info")[1]["internal_states"][0]["paused"] == "retract"  # ...outlives the update
    assert server.call("/continue_generation", {})[0] == 200
    status, out = server.call("/update_weights_from_disk", {"model_path": str(other_model_dir / "nope")})
    assert status == 400 and out["success"] is False and "no *.safetensors files" in out["message"]
    assert server.call("/update_weights_from_disk", {"model_path": str(tiny_model_dir),
                                                      "weight_version": "default"})[0] == 200
    assert _generate(server, input_ids=ids, sampling_params=GREEDY)["output_ids"] == before["output_ids"]


def test_a_client_broadcasts_new_weights_over_the_update_group(server, engine, other_model_dir):
    """The trainer side of SGLang's distributed update: join the gloo group, announce a bucket, broadcast it."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from furlong.kit.dist import broadcast_bucket, free_port, new_weight_update_group

    ids = engine.tokenizer.encode("Hello there")
    before = _generate(server, input_ids=ids, sampling_params=GREEDY)
    port = free_port()
    joining, joined = _in_thread(server.call, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "test_group", "backend": "gloo"})
    group = new_weight_update_group("127.0.0.1", port, 0, 2, "test_group", "gloo", timeout_s=60)
    joining.join(60)
    assert joined["value"] == (200, {"success": True, "message": "Succeeded to initialize custom process group."})
    state = load_file(str(other_model_dir / "model.safetensors"))
    names = sorted(state)
    assert server.call("/begin_weight_update", {"selector": "all"}) == (200, {"success": True, "message": "Success"})
    sending, sent = _in_thread(server.call, "/update_weights_from_distributed", {
        "names": names, "dtypes": [str(state[n].dtype).removeprefix("torch.") for n in names],
        "shapes": [list(state[n].shape) for n in names], "group_name": "test_group", "weight_version": "7"})
    broadcast_bucket([state[n] for n in names], group)
    sending.join(60)
    assert sent["value"] == (200, {"success": True, "message": "Succeeded to update parameter online."})
    assert server.call("/end_weight_update", {}) == (200, {"success": True, "message": "Success"})
    after = _generate(server, input_ids=ids, sampling_params=GREEDY)
    expected = _engine_output(embedded.load_engine(str(other_model_dir)), ids, GREEDY).output_ids
    assert after["output_ids"] == expected != before["output_ids"]
    assert after["meta_info"]["weight_version"] == "7" == server.call("/model_info")[1]["weight_version"]
    assert server.call("/destroy_weights_update_group", {"group_name": "test_group"})[0] == 200
    dist.destroy_process_group(group)
    server.call("/begin_weight_update", {})
    status, out = server.call("/update_weights_from_distributed", {
        "names": names[:1], "dtypes": ["float32"], "shapes": [list(state[names[0]].shape)], "group_name": "test_group"})
    assert status == 400 and "no weight-update group 'test_group'" in out["message"]
    server.call("/end_weight_update", {})
    restore = server.call("/model_info")[1]["model_path"]
    assert server.call("/update_weights_from_disk", {"model_path": restore, "weight_version": "default"})[0] == 200


def test_broadcast_and_tensor_updates_need_a_weight_update_session(server):
    """SGLang 0.5.21+'s rule (``scheduler_components/weight_updater.py``), answer for answer."""
    outside = {"success": False, "message": "update_weights_from_distributed must run between "
                                            "begin_weight_update() and end_weight_update()"}
    bucket = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1, 1]], "group_name": "none"}
    assert server.call("/update_weights_from_distributed", bucket) == (400, outside)
    status, out = server.call("/update_weights_from_tensor", {"serialized_named_tensors": ["e30="]})
    assert (status, out["success"]) == (400, False) and out["message"].startswith("update_weights_from_tensor must")
    assert server.call("/end_weight_update", {}) == (400, {
        "success": False, "message": "no weight-update session is open; call begin_weight_update() first"})
    assert server.call("/begin_weight_update", {})[0] == 200
    assert server.call("/begin_weight_update", {}) == (400, {
        "success": False, "message": "a weight-update session is already open; call end_weight_update() first"})
    assert server.call("/end_weight_update", {})[0] == 200
    assert server.call("/begin_weight_update", {"selector": "everything"})[0] == 400


def test_a_tensor_update_loads_the_pickled_tensors_and_refuses_other_pickles(server, engine, other_model_dir):
    """``/update_weights_from_tensor`` as SGLang's own client sends it: ForkingPickler + base64, one payload per
    TP rank (CPU tensors travel as shared-memory file names under the ``file_system`` sharing strategy)."""
    import base64
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    ids = engine.tokenizer.encode("Hello there")
    state = load_file(str(other_model_dir / "model.safetensors"))
    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(sorted(state.items()))
        payload = base64.b64encode(buffer.getvalue()).decode()
        assert server.call("/begin_weight_update", {})[0] == 200
        status, out = server.call("/update_weights_from_tensor", {"serialized_named_tensors": [payload],
                                                                   "weight_version": "t1"})
        assert (status, out) == (200, {"success": True, "message": "Success"})
        evil = base64.b64encode(pickle.dumps(print)).decode()
        status, out = server.call("/update_weights_from_tensor", {"serialized_named_tensors": [evil]})
        assert status == 400 and "builtins.print, which a tensor payload never holds" in out["message"]
        assert server.call("/end_weight_update", {})[0] == 200
    finally:
        mp.set_sharing_strategy(previous)
    expected = _engine_output(embedded.load_engine(str(other_model_dir)), ids, GREEDY).output_ids
    after = _generate(server, input_ids=ids, sampling_params=GREEDY)
    assert after["output_ids"] == expected and after["meta_info"]["weight_version"] == "t1"
    restore = server.call("/model_info")[1]["model_path"]
    assert server.call("/update_weights_from_disk", {"model_path": restore, "weight_version": "default"})[0] == 200


# --- process ----------------------------------------------------------------------------------------


@pytest.mark.signals
def test_sigterm_ends_running_streams_even_paused_ones_and_exits_cleanly(tiny_model_dir, tmp_path):
    with running_server(tiny_model_dir, log_dir=tmp_path) as srv:
        sink = []
        thread, _ = _in_thread(_stream_lines, srv, {"input_ids": [5, 6], "sampling_params": LONG}, sink)
        deadline = time.monotonic() + 20
        while not sink:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert srv.call("/pause_generation", {"mode": "in_place"})[0] == 200  # even a paused request ends
        assert stop(srv.proc) == 0
        thread.join(10)
        assert sink[-1] == "[DONE]"
        assert sink[-2]["meta_info"]["finish_reason"]["message"] == "The server is shutting down"
        assert "Traceback" not in srv.log() and "shutting down" in srv.log()


@pytest.mark.signals
def test_ctrl_c_stops_a_server_whose_parent_ignored_and_blocked_sigint(tiny_model_dir, tmp_path):
    """docs/checkpoints.md, "Stopping a run": the server unblocks SIGINT, says so, and stops on it."""
    with running_server(tiny_model_dir, log_dir=tmp_path, ignored={signal.SIGINT}, blocked={signal.SIGINT}) as srv:
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(30) == 0, srv.log()[-3000:]
    notes = [line for line in srv.log().splitlines() if line.startswith("note: ")]
    assert notes == ["note: SIGINT was blocked by the parent process; furlong unblocks it so Ctrl-C stops the "
                     "server"]
    assert "shutting down" in srv.log() and "Traceback" not in srv.log()


@pytest.mark.parametrize("dtype, bf16, fp16", [("auto", True, False), ("bfloat16", True, False),
                                               ("float16", False, True), ("float32", False, False)])
def test_serve_flags_become_what_the_engine_plugin_reads(dtype, bf16, fp16):
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.serve.command import parse_serve_args

    args = parse_serve_args(["--hf-checkpoint", "m", "--dtype", dtype, "--embedded-max-batch-size", "3"],
                            get_plugin_manager())
    assert (args.bf16, args.fp16, args.served_model_name, args.embedded_max_batch_size) == (bf16, fp16, "m", 3)
    assert (args.host, args.port, args.rollout_backend, args.weight_version) == ("127.0.0.1", 30000, "embedded",
                                                                                 "default")


@pytest.mark.parametrize("port, why", [("99999", "a TCP port is 1 to 65535, got 99999"),
                                       ("-1", "a TCP port is 1 to 65535, got -1"),
                                       ("0", "a TCP port is 1 to 65535, got 0"),
                                       ("http", "expected a TCP port (1 to 65535), got 'http'")])
def test_serve_port_out_of_range_is_one_error_line_at_parsing(port, why, capsys, tiny_model_dir):
    """An out-of-range --port was a traceback (OverflowError from bind, exit 1); now argparse refuses it,
    before any plugin or model loads."""
    assert main(["serve", "--hf-checkpoint", str(tiny_model_dir), "--port", port]) == 2
    assert capsys.readouterr().err == f"error: argument --port: {why}.\n"


def test_serve_errors_are_one_line_and_exit_2(tmp_path, capsys, server, tiny_model_dir):
    assert main(["serve", "--hf-checkpoint", str(tmp_path), "--rollout-backend", "embeded"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --rollout-backend 'embeded': no installed plugin of that name implements "
                          "`rollout_engine`.")
    assert "Did you mean 'embedded'?" in err
    assert main(["serve", "--hf-checkpoint", str(tmp_path / "missing"), "--port", "1"]) == 2
    assert capsys.readouterr().err == f"error: --hf-checkpoint '{tmp_path / 'missing'}': no such directory.\n"
    for impl in ("sglang", "furlong"):  # an HTTP client of servers is refused before any router or model starts
        flags = ["--rollout-backend", "sglang", "--sglang-server-impl", impl]
        assert main(["serve", "--hf-checkpoint", str(tiny_model_dir), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: furlong serve --rollout-backend sglang: that engine is an HTTP client")
        assert err.endswith("Engines furlong serve can run: embedded.\n")
    port = server.url.rsplit(":", 1)[1]  # taken by the running server
    started = time.monotonic()
    assert main(["serve", "--hf-checkpoint", str(tiny_model_dir), "--port", port]) == 2
    assert time.monotonic() - started < 1.0  # checked before the model loads
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: furlong serve: cannot listen on 127.0.0.1:{port} (")
    assert errors[0].endswith("Address already in use); choose another --port or --host.")
