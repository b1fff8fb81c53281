"""``furlong serve`` against the golden SGLang bodies of tests/fixtures/sglang (SGLang 0.5.23's schema).

Every request fixture is sent as it is; every answer must have each key of the matching
response fixture, with the same JSON type (numbers: an int fixture needs an int, a float
fixture takes either; null needs null), recursively. Extra keys are allowed.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_helpers import sse_events  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"


def load(name: str):
    return json.loads((FIXTURES / name).read_text())


def assert_same_shape(expected, actual, where: str = "$") -> None:
    """``actual`` has every key of ``expected`` with the same JSON type (lists: item by item
    when ``expected`` mixes types, as SGLang's ``[logprob, token_id, text]`` triples do)."""
    if expected is None:
        assert actual is None, f"{where}: expected null, got {actual!r}"
    elif isinstance(expected, bool):
        assert isinstance(actual, bool), f"{where}: expected a boolean, got {actual!r}"
    elif isinstance(expected, int):
        assert isinstance(actual, int) and not isinstance(actual, bool), f"{where}: expected an int, got {actual!r}"
    elif isinstance(expected, float):
        assert isinstance(actual, (int, float)) and not isinstance(actual, bool), f"{where}: expected a number"
    elif isinstance(expected, str):
        assert isinstance(actual, str), f"{where}: expected a string, got {actual!r}"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: expected an object, got {actual!r}"
        missing = sorted(set(expected) - set(actual))
        assert not missing, f"{where}: missing keys {missing}"
        for key, value in expected.items():
            assert_same_shape(value, actual[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list), f"{where}: expected a list, got {actual!r}"
        if len({type(x) for x in expected}) > 1:  # a positional tuple
            assert len(actual) == len(expected), f"{where}: expected {len(expected)} items, got {len(actual)}"
            for i, (e, a) in enumerate(zip(expected, actual)):
                assert_same_shape(e, a, f"{where}[{i}]")
        elif expected:
            for i, a in enumerate(actual):
                assert_same_shape(expected[0], a, f"{where}[{i}]")


def test_the_shape_check_catches_what_differs():
    assert_same_shape({"a": [[-1.0, 2, None]], "b": {"c": 1}}, {"a": [[-3, 5, None]], "b": {"c": 2, "d": 0}})
    for wrong in ({"a": [[-1.0, "2", None]], "b": {"c": 1}}, {"a": [[-1.0, 2, None]], "b": {}},
                  {"a": [[-1.0, 2, None]], "b": {"c": 1.5}}, {"a": [[-1.0, 2]], "b": {"c": 1}}):
        with pytest.raises(AssertionError):
            assert_same_shape({"a": [[-1.0, 2, None]], "b": {"c": 1}}, wrong)


def test_generate_with_token_ids_and_logprobs(serve_server):
    status, out = serve_server.call("/generate", load("generate_request_input_ids.json"))
    assert status == 200
    assert_same_shape(load("generate_response_logprob.json"), out)
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) == 8


def test_generate_with_text_and_sglang_defaults_spelled_out(serve_server):
    status, out = serve_server.call("/generate", load("generate_request_text.json"))
    assert status == 200
    assert_same_shape(load("generate_response.json"), out)
    assert out["meta_info"]["id"] == "fixture-text" and "output_token_logprobs" not in out["meta_info"]


def test_generate_body_as_sglang_router_forwards_it(serve_server):
    status, out = serve_server.call("/generate", load("generate_request_via_router.json"))
    assert status == 200
    assert_same_shape(load("generate_response_logprob.json"), out)


def test_generate_batch(serve_server):
    status, out = serve_server.call("/generate", load("generate_request_batch.json"))
    assert status == 200 and len(out) == 2
    assert_same_shape(load("generate_response_logprob.json"), out[0])
    assert_same_shape(load("generate_response.json"), out[1])
    assert [o["meta_info"]["id"] for o in out] == ["fixture-batch_0", "fixture-batch_1"]


def test_generate_stream_events(serve_server):
    status, raw = serve_server.call("/generate", load("generate_request_stream.json"))
    assert status == 200
    events = sse_events(raw)
    expected = load("generate_stream_events.json")["events"]
    assert events[-1] == expected[-1] == "[DONE]"
    for event in events[:-2]:
        assert_same_shape(expected[0], event)  # running: finish_reason null
    assert_same_shape(expected[-2], events[-2])  # finished


def test_unknown_sampling_key_is_refused_with_sglang_s_error_body(serve_server):
    status, out = serve_server.call("/generate", load("generate_request_unknown_sampling_key.json"))
    assert status == 400
    assert_same_shape(load("error_400.json"), out)
    assert "'temprature'" in out["error"]


def test_finish_reason_shapes(serve_server):
    shapes = load("finish_reasons.json")
    base = {"input_ids": [52, 73, 80, 80, 83], "sampling_params": {"temperature": 0, "max_new_tokens": 6,
                                                                   "ignore_eos": True}}
    free = serve_server.call("/generate", base)[1]
    assert_same_shape(shapes["length"], free["meta_info"]["finish_reason"])
    by_token = serve_server.call("/generate", {**base, "sampling_params": {
        **base["sampling_params"], "stop_token_ids": [free["output_ids"][2]]}})[1]
    assert_same_shape(shapes["stop_token"], by_token["meta_info"]["finish_reason"])
    by_string = serve_server.call("/generate", {**base, "sampling_params": {
        **base["sampling_params"], "stop": free["text"][1:3]}})[1]
    assert_same_shape(shapes["stop_string"], by_string["meta_info"]["finish_reason"])
    result = {}
    # 1000 new tokens: within the tiny model's context of 1024, long enough to be aborted while running
    long = {**base, "rid": "fixture-abort", "sampling_params": {**base["sampling_params"], "max_new_tokens": 1000}}
    thread = threading.Thread(target=lambda: result.setdefault("out", serve_server.call("/generate", long)))
    thread.start()
    deadline = time.monotonic() + 20
    while serve_server.call("/server_info")[1]["internal_states"][0]["running_requests"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    abort = load("control_requests.json")["/abort_request"]
    assert serve_server.call("/abort_request", abort) == (200, "")
    thread.join(30)
    assert_same_shape(shapes["abort"], result["out"][1]["meta_info"]["finish_reason"])


@pytest.mark.parametrize("path, fixture", [("/model_info", "model_info.json"), ("/get_model_info", "model_info.json"),
                                           ("/server_info", "server_info.json"),
                                           ("/get_server_info", "server_info.json"), ("/v1/models", "v1_models.json")])
def test_info_endpoints(serve_server, path, fixture):
    status, out = serve_server.call(path)
    assert status == 200
    assert_same_shape(load(fixture), out)


def test_control_requests(serve_server, tiny_model_dir):
    """Each control body of the fixtures is accepted and answered in SGLang's shape."""
    from safetensors.torch import load_file

    from furlong.kit.dist import broadcast_bucket, free_port, new_weight_update_group

    requests, answers = load("control_requests.json"), load("control_responses.json")
    call = serve_server.call

    def check(path, body=None, answer=None):
        status, out = answer or call(path, requests[path] if body is None else body)
        assert status == 200, out
        assert_same_shape(answers[path], out, path)

    def in_thread(path, body):
        result = {}
        thread = threading.Thread(target=lambda: result.setdefault("answer", call(path, body)), daemon=True)
        thread.start()
        return thread, result

    for path in ("/pause_generation", "/continue_generation", "/update_weight_version",
                 "/release_memory_occupation", "/resume_memory_occupation"):
        check(path)
    assert call("/model_info")[1]["weight_version"] == "3"
    port = free_port()
    init = {**requests["/init_weights_update_group"], "master_port": port}
    thread, result = in_thread("/init_weights_update_group", init)
    group = new_weight_update_group("127.0.0.1", port, 0, init["world_size"], init["group_name"], "gloo", timeout_s=60)
    thread.join(60)
    check("/init_weights_update_group", answer=result["answer"])
    bucket = requests["/update_weights_from_distributed"]
    weights = load_file(str(Path(tiny_model_dir) / "model.safetensors"))  # the same weights: outputs stay put
    check("/begin_weight_update", {"selector": "all"})
    thread, result = in_thread("/update_weights_from_distributed", bucket)
    broadcast_bucket([weights[name] for name in bucket["names"]], group)
    thread.join(60)
    check("/update_weights_from_distributed", answer=result["answer"])
    check("/end_weight_update", {})
    check("/destroy_weights_update_group")
    import torch.distributed as dist

    dist.destroy_process_group(group)
    assert call("/model_info")[1]["weight_version"] == "4"
    check("/update_weights_from_disk", {**requests["/update_weights_from_disk"], "model_path": str(tiny_model_dir),
                                        "weight_version": "default"})
    assert call("/model_info")[1]["weight_version"] == "default"
