"""furlong's SGLang client and ``furlong serve`` held to SGLang's own contract, not to furlong's reading of it.

SGLang's files come from its released wheels (``tests/sglang_reference.py``): the JSON
contract ``api_types.py``, each version's routes and request types, its HTTP client.

- SGLang 0.5.23's own HTTP client (``HttpServerEngineAdapter``) drives ``furlong serve``:
  generation with prompt log-probs, a weight-update session with a tensor update, memory.
- The calls Miles' ``sglang_engine.py`` makes fit SGLang's request types and ``furlong serve``
  answers them.
- A GRPO run under the Ray executor (weights by broadcast) through the real router to two
  strict stand-ins (``tests/sglang_standin.py``), one held to SGLang 0.5.23's rules (weight
  updates in sessions), one to 0.5.16's (no session routes): no violation, both on the
  same new weight version; and a server that refuses an update ends the run with one error.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the helpers below are modules of this folder
import sglang_reference as ref  # noqa: E402
from serve_helpers import running_server  # noqa: E402

pytest.importorskip("sglang_router", reason='the router extra: pip install "furlong[router]"')

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo"
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as response:
        return json.loads(response.read())


def test_the_client_speaks_the_version_the_server_reports():
    from furlong.builtin_plugins.engines.sglang.protocol import protocol_for
    from furlong.hooks import PluginError

    assert protocol_for("0.5.23", "s").weight_session and protocol_for("0.5.21.post1", "s").weight_session
    assert not protocol_for("0.5.20", "s").weight_session and not protocol_for("0.5.6", "s").weight_session
    for old, message in (("0.5.5", "runs SGLang 0.5.5; furlong supports SGLang 0.5.6 and later"),
                         ("0.1.0.dev0", "runs SGLang 0.1.0.dev0"), (None, "reports version None")):
        with pytest.raises(PluginError, match=message):
            protocol_for(old, "sglang engine 0 (http://h:1)")
    # what the session rule and the minimum rest on, in SGLang's own routes
    assert ("POST", "/begin_weight_update") in ref.routes("0.5.23")
    assert ("POST", "/begin_weight_update") not in ref.routes("0.5.16")
    assert ("GET", "/model_info") in ref.routes("0.5.16") and ("GET", "/server_info") in ref.routes("0.5.16")


def test_sglang_s_own_http_client_drives_furlong_serve(tiny_model_dir, tmp_path):
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from furlong.builtin_plugins.engines import embedded

    types = ref.api_types()
    with running_server(tiny_model_dir, log_dir=tmp_path) as server:
        client = ref.http_client(server.url)
        ids = [5, 6, 7, 8]
        answer = client.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
        decoded = types.GenerateResponse.from_json_value(answer)
        assert [e.token_id for e in decoded.meta_info.input_token_logprobs] == ids
        assert decoded.meta_info.output_token_logprobs_length == 6 == len(decoded.output_ids)
        # (not client.flush_cache(): SGLang answers /flush_cache with text, which that method decodes as JSON)
        assert server.call("/flush_cache", {})[0] == 200
        assert client.begin_weight_update() == {"success": True, "message": "Success"}
        state = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
        scaled = sorted((name, tensor * 0.5 if name == "lm_head.weight" else tensor) for name, tensor in state.items())
        previous = mp.get_sharing_strategy()
        mp.set_sharing_strategy("file_system")  # CPU tensors cross processes as shared-memory file names
        try:
            assert client.update_weights_from_tensor(scaled)["success"] is True
        finally:
            mp.set_sharing_strategy(previous)
        assert client.end_weight_update() == {"success": True, "message": "Success"}
        after = types.GenerateResponse.from_json_value(client.generate(input_ids=ids, sampling_params=GREEDY,
                                                                       return_logprob=True))
        engine = embedded.load_engine(str(tiny_model_dir))
        import asyncio

        asyncio.run(engine.load_weights(scaled))
        expected = asyncio.run(engine.generate(ids, dict(GREEDY)))
        assert list(after.output_ids) == expected.output_ids
        assert [e.logprob for e in after.meta_info.output_token_logprobs] == pytest.approx(expected.output_log_probs,
                                                                                           abs=1e-5)
        client.release_memory_occupation()
        client.resume_memory_occupation()
        types.GetServerInfoResponse.from_json_value(server.call("/server_info")[1])
        types.GetModelInfoResponse.from_json_value(server.call("/model_info")[1])


# The calls Miles' rollout engine (miles/backends/sglang_utils/sglang_engine.py) makes around one weight sync
MILES_SYNC = [
    ("POST", "/pause_generation", {"mode": "retract"}),
    ("GET", "/flush_cache", None),
    ("POST", "/begin_weight_update", {"selector": "all"}),
    ("POST", "/update_weights_from_disk", {"model_path": None, "weight_version": "1"}),
    ("POST", "/end_weight_update", {}),
    ("POST", "/update_weight_version", {"new_version": "1"}),
    ("POST", "/continue_generation", {}),
    ("GET", "/model_info", None),
    ("GET", "/server_info", None),
    ("POST", "/release_memory_occupation", {"tags": None}),
    ("POST", "/resume_memory_occupation", {"tags": None}),
    ("POST", "/abort_request", {"abort_all": True}),
]


def test_the_calls_miles_makes_fit_sglang_s_request_types_and_furlong_serve_answers_them(tiny_model_dir, tmp_path):
    with running_server(tiny_model_dir, log_dir=tmp_path) as server:
        for method, path, body in MILES_SYNC:
            if body is not None and "model_path" in body:
                body = {**body, "model_path": str(tiny_model_dir)}
            assert ref.check_control_body("0.5.23", method, path, body) == [], path
            status, answer = server.call(path, body, method=method)
            assert status == 200, (path, answer)
        assert server.call("/model_info")[1]["weight_version"] == "1"


# --- a GRPO run through the real router to servers held to 0.5.23's and 0.5.16's rules ---------------------------


@pytest.fixture()
def standins(tmp_path):
    """Two furlong serve processes, each behind a stand-in: SGLang 0.5.23's rules and 0.5.16's."""
    from contextlib import ExitStack

    from furlong.kit.dist import free_port
    from sglang_standin import StandIn

    with ExitStack() as stack:
        backends = [stack.enter_context(running_server(DEMO / "model", log_dir=tmp_path)) for _ in range(2)]
        fronts = [StandIn(version, backend.url, free_port()) for version, backend in zip(("0.5.23", "0.5.16"),
                                                                                         backends)]
        try:
            yield fronts
        finally:
            for front in fronts:
                front.stop()


def _grpo(run_furlong, tmp_path, fronts, *extra):
    return run_furlong(
        "train", "--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
        "--input-key", "prompt", "--label-key", "label", "--rm-type", "math", "--num-rollout", "2",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
        "--micro-batch-size", "16", "--rollout-max-response-len", "8", "--lr", "1e-4", "--save", str(tmp_path / "run"),
        "--executor", "ray", "--rollout-backend", "sglang", "--rollout-external", "--rollout-external-engine-addrs",
        *[f.url.removeprefix("http://") for f in fronts], "--sglang-router-policy", "round_robin", *extra,
        env={"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}, timeout=300)


def test_a_grpo_run_keeps_each_version_s_rules_and_leaves_both_servers_on_the_new_weights(
        standins, tmp_path, run_furlong):
    new, old = standins
    proc = _grpo(run_furlong, tmp_path, standins)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert new.violations == [] and old.violations == []
    assert "SGLang 0.5.23 (weight updates in sessions)" in proc.stderr and "SGLang 0.5.16" in proc.stderr
    syncs = new.calls.count(("POST", "/update_weight_version"))
    assert syncs == old.calls.count(("POST", "/update_weight_version")) >= 2  # one per rollout, the first before it
    assert new.calls.count(("POST", "/begin_weight_update")) == new.calls.count(("POST", "/end_weight_update")) == syncs
    assert ("POST", "/begin_weight_update") not in old.calls  # 0.5.16 has no session: the client never asks
    assert new.calls.count(("POST", "/update_weights_from_distributed")) >= syncs
    versions = {get(front.url, "/model_info")["weight_version"] for front in standins}
    assert versions == {str(syncs)}


def test_a_server_that_refuses_an_update_ends_the_run_with_its_message(standins, tmp_path, run_furlong):
    """The 0.5.23 stand-in is told it runs 0.5.20: the client sends no session, the server refuses the first bucket."""
    new, _ = standins
    new.sessions = True
    new.version_reported = "0.5.20"
    started = time.monotonic()
    proc = _grpo(run_furlong, tmp_path, standins)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()" \
        in proc.stderr
    assert "sglang engine 0" in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - started < 240  # never a trainer waiting out the broadcast time-out
