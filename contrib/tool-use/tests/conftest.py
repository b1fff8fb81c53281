"""A real Hugging Face model whose weights make it write a fixed script, served by the embedded
engine in-process or by ``furlong serve`` over HTTP.

The model is a one-layer Llama whose attention and MLP outputs are zero, so the logits at a
position depend on its token alone: ``lm_head`` maps each word to the word the script puts
after it (a multiple of the normalised one-hot), every other word to end-of-sequence. With a
word-level tokenizer (one token per whitespace-separated word) the model then writes the
script word for word under greedy decoding, with log-probs a little below 0.
"""

from __future__ import annotations

import asyncio

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]


def build_script_model(path, transitions: dict[str, str], extra_words=(), strength: float = 2.0) -> str:
    """Save a model and tokenizer to ``path`` that continue word ``a`` with ``transitions[a]``.

    ``strength`` scales the logits: at 2.0 the greedy choice is the script and its log-prob
    is a few thousandths below 0 (so tests can tell the model's log-probs from the 0.0 of
    tool tokens); sample with temperature 0. ``extra_words`` join the vocabulary (words a
    tool prints); any other word is ``<unk>``.
    """
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = SPECIAL + sorted({w for pair in transitions.items() for w in pair} - set(SPECIAL)
                             | {"<result>", "</result>", *extra_words})
    vocab = {w: i for i, w in enumerate(words)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(path)
    size = len(words)
    hidden = size + size % 2  # RoPE needs an even head dimension
    config = LlamaConfig(vocab_size=size, hidden_size=hidden, intermediate_size=4, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        for norm in (model.model.norm, model.model.layers[0].input_layernorm,
                     model.model.layers[0].post_attention_layernorm):
            norm.weight.fill_(1.0)
        model.model.embed_tokens.weight[:, :size] = torch.eye(size)
        model.lm_head.weight[vocab["</s>"], :] = strength
        for a, b in transitions.items():
            model.lm_head.weight[:, vocab[a]] = 0.0
            model.lm_head.weight[vocab[b], vocab[a]] = strength
    model.save_pretrained(path)
    return str(path)


@pytest.fixture
def script_model(tmp_path):
    """``script_model(transitions, extra_words=(), strength=2.0)``: the path of a saved script model."""
    return lambda transitions, extra_words=(), strength=2.0: build_script_model(tmp_path / "model", transitions,
                                                                               extra_words, strength)


@pytest.fixture
def script_engine(tmp_path):
    """``script_engine(transitions, extra_words=())``: the embedded engine (through its plugin) serving a script model."""
    from furlong.core.config.launch_args import launch_config
    from furlong.core.plugins.manager import get_plugin_manager

    def make(transitions: dict[str, str], extra_words=()):
        path = build_script_model(tmp_path / "model", transitions, extra_words)
        config = launch_config("--hf-checkpoint", str(path), "--seed", "0", "--embedded-max-batch-size", "8",
                               configure=False)
        return asyncio.run(get_plugin_manager().call_chosen("rollout_engine", "embedded", "--rollout-backend",
                                                            config=config, engine_index=0))

    return make



class HttpEngine:
    """The generation side of a :class:`furlong.hooks.RolloutEngine` over SGLang's native HTTP API
    (``POST /generate`` with ``input_ids`` and ``return_logprob``), as served by ``furlong serve``."""

    def __init__(self, url: str, tokenizer) -> None:
        self.url, self.tokenizer = url, tokenizer

    async def generate(self, input_ids, sampling_params):
        import aiohttp

        from furlong.hooks import GenerateOutput

        body = {"input_ids": list(input_ids), "return_logprob": True,
                "sampling_params": {k: v for k, v in sampling_params.items() if v is not None}}
        async with aiohttp.ClientSession() as session:
            async with session.post(self.url + "/generate", json=body) as answer:
                assert answer.status == 200, await answer.text()
                out = await answer.json()
        meta = out["meta_info"]
        return GenerateOutput(output_ids=out["output_ids"], text=out["text"],
                              output_log_probs=[lp for lp, _, _ in meta["output_token_logprobs"]],
                              finish_reason=meta["finish_reason"]["type"], weight_version=str(meta["weight_version"]))


@pytest.fixture
def served_engine(tmp_path):
    """``served_engine(transitions)``: a script model behind a ``furlong serve`` process on loopback
    (stopped after the test), and an :class:`HttpEngine` talking to it."""
    from furlong.kit.dist import free_port
    from furlong.kit.hf import load_tokenizer
    from furlong.hooks.testing.processes import signal_state

    servers = []

    def make(transitions: dict[str, str], extra_words=()):
        path = build_script_model(tmp_path / "served", transitions, extra_words)
        port = free_port()
        log = open(tmp_path / "serve.log", "wb")
        servers.append(subprocess.Popen([sys.executable, "-m", "furlong.core", "serve", "--hf-checkpoint", path,
                                         "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "OMP_NUM_THREADS": "1"},
                                        preexec_fn=signal_state()))  # it is stopped with SIGTERM
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert servers[-1].poll() is None, (tmp_path / "serve.log").read_text()
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "furlong serve did not answer /health within 60 s"
                time.sleep(0.2)
        info = json.loads(urllib.request.urlopen(url + "/model_info", timeout=5).read())
        assert info["model_path"] == path
        return HttpEngine(url, load_tokenizer(path))

    yield make
    for server in servers:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
