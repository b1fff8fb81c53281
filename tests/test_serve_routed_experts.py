"""Routed experts over SGLang's API: ``furlong serve --enable-return-routed-experts`` answers them in
``meta_info.routed_experts`` (SGLang 0.5.23's encoding), and the ``sglang`` engine asks for them and decodes them."""

from __future__ import annotations

import asyncio
import base64
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from serve_helpers import running_server  # noqa: E402

from furlong.kit.moe import (  # noqa: E402
    RoutingLayout, checkpoint_routing_layout, decode_routed_experts, encode_routed_experts)

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(tiny_moe_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir).eval()


def _routing_of(reference, tokens: list[int]) -> np.ndarray:
    """The top-k of transformers' router logits for every fed token: ``[len - 1, layers, k]``."""
    with torch.no_grad():
        out = reference(torch.tensor([tokens]), output_router_logits=True)
    k = reference.config.num_experts_per_tok
    return torch.stack([r.topk(k, dim=-1).indices for r in out.router_logits], dim=1)[:-1].numpy()


@pytest.fixture(scope="module")
def moe_server(tiny_moe_model_dir, tmp_path_factory):
    with running_server(tiny_moe_model_dir, "--enable-return-routed-experts",
                        log_dir=tmp_path_factory.mktemp("serve_moe")) as server:
        yield server


def test_the_encoding_is_int32_bytes_of_every_decoder_layer_in_base64():
    # 3 decoder layers, the first dense (its rows zero), top 2
    layout = RoutingLayout(num_layers=3, moe_layers=(1, 2), topk=2)
    routed = np.array([[[3, 1], [0, 2]], [[2, 3], [1, 0]]], dtype=np.int32)
    text = encode_routed_experts(routed, layout)
    assert np.frombuffer(base64.b64decode(text), dtype=np.int32).tolist() == [0, 0, 3, 1, 0, 2, 0, 0, 2, 3, 1, 0]
    assert np.array_equal(decode_routed_experts(text, 2, layout), routed)
    with pytest.raises(ValueError, match=r"routed_experts holds 12 values, not rows 3 x layers 3 x topk 2"):
        decode_routed_experts(text, 3, layout)


def test_the_checkpoint_layout_is_read_without_weights(tiny_moe_model_dir, tiny_model_dir):
    assert checkpoint_routing_layout(str(tiny_moe_model_dir)) == RoutingLayout(num_layers=2, moe_layers=(0, 1), topk=2)
    assert checkpoint_routing_layout(str(tiny_model_dir)) is None


def test_furlong_serve_answers_the_routed_experts_of_every_fed_token(moe_server, reference):
    ids = [40, 41, 42, 43, 44]
    status, body = moe_server.call("/generate", {"input_ids": ids, "sampling_params": GREEDY,
                                                 "return_routed_experts": True})
    assert status == 200, body
    tokens = ids + body["output_ids"]
    routed = np.frombuffer(base64.b64decode(body["meta_info"]["routed_experts"]), dtype=np.int32)
    assert np.array_equal(routed.reshape(len(tokens) - 1, 2, 2), _routing_of(reference, tokens))
    status, later = moe_server.call("/generate", {"input_ids": ids, "sampling_params": GREEDY,
                                                  "return_routed_experts": True, "routed_experts_start_len": 3})
    assert status == 200 and later["output_ids"] == body["output_ids"]
    tail = np.frombuffer(base64.b64decode(later["meta_info"]["routed_experts"]), dtype=np.int32)
    assert np.array_equal(tail, routed[3 * 2 * 2:])
    status, plain = moe_server.call("/generate", {"input_ids": ids, "sampling_params": GREEDY})
    assert status == 200 and "routed_experts" not in plain["meta_info"]
    status, info = moe_server.call("/server_info")
    assert info["enable_return_routed_experts"] is True


def test_routed_experts_the_server_cannot_answer_are_a_400(moe_server, serve_server):
    status, body = moe_server.call("/generate", {"input_ids": [40, 41], "sampling_params": GREEDY, "rid": "r1",
                                                 "return_routed_experts": True, "routed_experts_start_len": 3})
    assert status == 400
    assert body["error"]["message"] == ("/generate: routed_experts_start_len=3 is outside [0, 2] (the prompt's "
                                        "tokens) for request 'r1'.")
    status, body = serve_server.call("/generate", {"input_ids": [40, 41], "sampling_params": GREEDY, "rid": "r2",
                                                   "return_routed_experts": True})
    assert status == 400
    assert body["error"]["message"] == ("/generate: return_routed_experts needs a mixture-of-experts model served "
                                        "with --enable-return-routed-experts (request 'r2').")


def _sglang_engine(url: str, model_dir, replay: bool):
    from furlong.builtin_plugins.engines import sglang
    from furlong.builtin_plugins.engines.sglang.engine import SGLangEngine
    from furlong.core.config.launch_args import launch_config

    from .configs import with_derived

    config = launch_config("--rollout-num-gpus-per-engine", "1", "--sglang-server-restarts", "0",
                           "--sglang-server-concurrency", "4", "--distributed-timeout-minutes", "1",
                           hf_checkpoint=str(model_dir), configure=False).replace(use_rollout_routing_replay=replay)
    config = with_derived(config, "sglang", sglang_engines_per_process=1, sglang_router_given=False)
    return SGLangEngine(config, 0, url, url, None, False, tokenizer=None, routing=sglang._routing(config))


def test_the_sglang_engine_asks_for_routed_experts_and_decodes_them(moe_server, reference, tiny_moe_model_dir):
    from furlong.builtin_plugins.engines.sglang.http import shared_http

    ids = [50, 51, 52, 53]
    params = {"temperature": 1.0, "max_new_tokens": 7, "sampling_seed": 5, "ignore_eos": True}

    async def main():
        engines = [_sglang_engine(moe_server.url, tiny_moe_model_dir, replay) for replay in (True, False)]
        for engine in engines:
            engine.http = shared_http(4)
        try:
            return [await engine.generate(ids, dict(params)) for engine in engines]
        finally:
            for engine in engines:
                await engine.shutdown()

    replayed, plain = asyncio.run(main())
    assert replayed.output_ids == plain.output_ids and plain.routed_experts is None
    assert replayed.routed_experts.dtype == np.int32
    assert np.array_equal(replayed.routed_experts, _routing_of(reference, ids + replayed.output_ids))


def test_a_server_that_answers_no_routed_experts_is_named(serve_server, tiny_moe_model_dir):
    # a finished answer without meta_info.routed_experts (SGLang started without --enable-return-routed-experts)
    from furlong.hooks import PluginError

    engine = _sglang_engine(serve_server.url, tiny_moe_model_dir, True)
    answer = {"text": "a", "output_ids": [7], "meta_info": {"output_token_logprobs": [[-0.5, 7, None]],
                                                            "finish_reason": {"type": "length", "length": 1}}}
    with pytest.raises(PluginError, match=r"no meta_info.routed_experts although the request set "
                                          r"return_routed_experts: the server must run with "
                                          r"--enable-return-routed-experts"):
        engine._output(answer, 3)
    answer["meta_info"]["finish_reason"] = {"type": "abort"}
    assert engine._output(answer, 3).routed_experts is None


def test_servers_started_under_routing_replay_record_routing(tiny_moe_model_dir):
    from furlong.builtin_plugins.engines.sglang.launch import ServerPlace, server_command
    from furlong.core.config.launch_args import launch_config

    from .configs import with_derived

    place = ServerPlace(0, "127.0.0.1", 30001, nccl_port=30002, dist_init_addr="127.0.0.1:30003")
    for impl, flag in (("furlong", "--enable-return-routed-experts"), ("sglang", "--enable-return-routed-experts")):
        config = launch_config("--sglang-server-impl", impl, hf_checkpoint=str(tiny_moe_model_dir), configure=False)
        config = with_derived(config, "sglang", sglang_engines_per_process=1, sglang_router_given=False)
        assert flag not in server_command(config, place)
        assert flag in server_command(config.replace(use_rollout_routing_replay=True), place)
