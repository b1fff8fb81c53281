"""The embedded rollout engine on a tiny random Llama (CPU): batching, sampling, stops, abort, weights."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import EOS_ID, record_module_calls, train_config  # noqa: E402

from furlong.builtin_plugins.backends.fsdp import train_backend  # noqa: E402
from furlong.builtin_plugins.engines import embedded  # noqa: E402
from furlong.builtin_plugins.engines.embedded import decode  # noqa: E402
from furlong.builtin_plugins.engines.embedded.decode import width_bucket  # noqa: E402
from furlong.builtin_plugins.engines.embedded.fusion import compile_model, decoder_layers  # noqa: E402
from furlong.builtin_plugins.engines.embedded.sampling import SamplingParams, filter_logits, sample_batch  # noqa: E402
from furlong.core.config.launch_args import launch_config  # noqa: E402
from furlong.hooks import PluginError, RolloutEngine, TrainBatch  # noqa: E402

PROMPTS = ["Hello there", "Q: 1+1=", "x"]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def engine(tiny_dir):
    """A shared engine; tests that change its weights make their own."""
    return embedded.load_engine(str(tiny_dir))


def _ids(engine, text):
    return engine.tokenizer.encode(text)


def _run(coro):
    return asyncio.run(coro)


async def _all(engine, prompts, params):
    return await asyncio.gather(*[engine.generate(_ids(engine, p), dict(params)) for p in prompts])


# --- basics -------------------------------------------------------------------------------


def test_engine_meets_the_protocol_and_round_trips_text(engine):
    assert isinstance(engine, RolloutEngine)
    text = "Q: what is 12 + 7?\n  A:"
    assert engine.tokenizer.decode(engine.tokenizer.encode(text)) == text


def test_rollout_engine_hook_reads_the_flags(tiny_dir):
    config = launch_config(hf_checkpoint=str(tiny_dir), embedded_max_batch_size=3, bf16=True, fp16=False)
    built = embedded.rollout_engine(config=config, engine_index=0)
    assert built.max_batch_size == 3
    assert next(built.model.parameters()).dtype == torch.float32  # CPU always float32


@pytest.mark.parametrize("size", [0, -3])
def test_a_batch_size_below_one_is_a_plugin_error(tiny_dir, size):
    config = launch_config(hf_checkpoint=str(tiny_dir), embedded_max_batch_size=size, bf16=True, fp16=False)
    with pytest.raises(PluginError, match=f"--embedded-max-batch-size {size}: must be at least 1"):
        embedded.rollout_engine(config=config, engine_index=0)


def test_add_arguments_defines_the_batch_size_and_compile_flags():
    parser = argparse.ArgumentParser()
    embedded.add_arguments(parser=parser)
    assert parser.parse_args([]).embedded_max_batch_size == 64
    assert parser.parse_args(["--embedded-max-batch-size", "8"]).embedded_max_batch_size == 8
    assert parser.parse_args([]).embedded_torch_compile is False
    assert parser.parse_args(["--embedded-torch-compile"]).embedded_torch_compile is True
    assert parser.parse_args([]).embedded_decode_kernels is True
    assert parser.parse_args(["--no-embedded-decode-kernels"]).embedded_decode_kernels is False


def test_decode_kernels_flag_reaches_the_decoder_and_runs_nothing_without_cuda(tiny_dir):
    for flag in (True, False):
        config = launch_config(hf_checkpoint=str(tiny_dir), embedded_decode_kernels=flag)
        decoder = embedded.rollout_engine(config=config, engine_index=0)._decoder
        assert decoder.decode_kernels is flag
        assert (decoder.attention_kernel, decoder.sampling_kernel, decoder.fuses_projections) == (False,) * 3


def test_torch_compile_flag_reaches_the_decoder(tiny_dir):
    config = launch_config(hf_checkpoint=str(tiny_dir), embedded_max_batch_size=3, embedded_torch_compile=True)
    built = embedded.rollout_engine(config=config, engine_index=0)
    layers = decoder_layers(built.model)
    assert built._decoder.compile_backend == "inductor" and len(layers) == 2
    assert all(layer._compiled_call_impl is not None for layer in layers)
    plain = embedded.rollout_engine(config=launch_config(hf_checkpoint=str(tiny_dir)), engine_index=0)
    assert plain._decoder.compile_backend is None
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(plain.model))


def test_torch_compile_of_a_model_without_known_decoder_layers_is_refused():
    with pytest.raises(PluginError, match="--embedded-torch-compile: Linear names no decoder layer class"):
        compile_model(torch.nn.Linear(2, 2), "aot_eager")


def test_missing_checkpoint_is_a_plugin_error():
    with pytest.raises(PluginError) as err:
        embedded.load_engine(None)
    assert str(err.value) == "--rollout-backend embedded needs --hf-checkpoint (a Hugging Face model directory)."


# --- batching and determinism -----------------------------------------------------------------


def test_batched_greedy_equals_one_at_a_time(engine):
    batched = _run(_all(engine, PROMPTS, GREEDY))
    for prompt, out in zip(PROMPTS, batched):
        alone = _run(engine.generate(_ids(engine, prompt), dict(GREEDY)))
        assert out.output_ids == alone.output_ids
        assert out.output_log_probs == pytest.approx(alone.output_log_probs, abs=1e-5)
        assert out.finish_reason == "length" and len(out.output_ids) == 16
        assert out.text == engine.tokenizer.decode(out.output_ids, skip_special_tokens=True)


def test_batch_with_mixed_budgets_equals_one_at_a_time(engine):
    # budgets 2, 3 and 20: the finished rows leave the batch (and its KV cache) midway
    budgets = [2, 3, 20]

    async def batched():
        return await asyncio.gather(*[engine.generate(_ids(engine, p), {**GREEDY, "max_new_tokens": n})
                                      for p, n in zip(PROMPTS, budgets)])

    for prompt, n, out in zip(PROMPTS, budgets, _run(batched())):
        alone = _run(engine.generate(_ids(engine, prompt), {**GREEDY, "max_new_tokens": n}))
        assert len(out.output_ids) == n
        assert out.output_ids == alone.output_ids
        assert out.output_log_probs == pytest.approx(alone.output_log_probs, abs=1e-5)


def test_requests_without_a_seed_sample_from_the_engine_s_own_seeded_generator(tiny_dir):
    """Engines built with one seed sample alike, whatever the process's global RNG did meanwhile."""
    params = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "max_new_tokens": 12}
    torch.manual_seed(7)
    first = _run(_all(embedded.load_engine(str(tiny_dir), seed=5), PROMPTS, params))
    torch.manual_seed(8)
    second = _run(_all(embedded.load_engine(str(tiny_dir), seed=5), PROMPTS, params))
    other = _run(_all(embedded.load_engine(str(tiny_dir), seed=6), PROMPTS, params))
    assert [o.output_ids for o in first] == [o.output_ids for o in second]
    assert [o.output_log_probs for o in first] == [o.output_log_probs for o in second]
    assert [o.output_ids for o in first] != [o.output_ids for o in other]


def test_sampling_seed_does_not_depend_on_the_batch(engine):
    params = {"temperature": 1.0, "max_new_tokens": 10, "sampling_seed": 123, "ignore_eos": True}
    alone = _run(engine.generate(_ids(engine, "x"), dict(params)))
    together = _run(_all(engine, ["Hello there", "x"], params))[1]
    assert together.output_ids == alone.output_ids


def test_requests_beyond_the_batch_size_run_in_later_batches(tiny_dir):
    small = embedded.load_engine(str(tiny_dir), max_batch_size=1)
    outs = _run(_all(small, PROMPTS, GREEDY))
    big = embedded.load_engine(str(tiny_dir))
    assert [o.output_ids for o in outs] == [o.output_ids for o in _run(_all(big, PROMPTS, GREEDY))]


def test_continuous_batching_equals_one_request_at_a_time(tiny_dir):
    # 2 slots, 5 sampled requests of different budgets: finished requests' slots are refilled
    # from the queue mid-decode; each request samples with its own seed wherever it runs
    eng = embedded.load_engine(str(tiny_dir), max_batch_size=2)
    prompts = ["Hello there", "Q: 1+1=", "x", "abc", "Q: 1+1="]
    params = [{"temperature": 1.0, "max_new_tokens": n, "sampling_seed": 100 + i, "ignore_eos": True}
              for i, n in enumerate([3, 9, 5, 12, 7])]

    async def together():
        return await asyncio.gather(*[eng.generate(_ids(eng, p), dict(q)) for p, q in zip(prompts, params)])

    outs = _run(together())
    for prompt, q, out in zip(prompts, params, outs):
        alone = _run(eng.generate(_ids(eng, prompt), dict(q)))
        assert len(out.output_ids) == q["max_new_tokens"] and out.finish_reason == "length"
        assert out.output_ids == alone.output_ids
        assert out.output_log_probs == pytest.approx(alone.output_log_probs, abs=1e-5)


def test_width_bucket_is_a_power_of_two_from_the_minimum_capped_by_the_capacity():
    assert [width_bucket(n, 2176) for n in (1, 129, 256, 257, 384, 512, 513, 2048, 2049, 2176)] == \
        [256, 256, 256, 512, 512, 512, 1024, 2048, 2176, 2176]
    assert width_bucket(5, 40) == 40
    assert len({width_bucket(n, 2176) for n in range(1, 2177)}) == 5  # bounded: log2(2176 / 256) + 2
    with pytest.raises(ValueError, match="outside"):
        width_bucket(2177, 2176)


def test_bucketed_attention_width_gives_the_same_tokens_and_log_probs(tiny_dir, monkeypatch):
    # CUDA graphs attend over power-of-two widths (most columns masked); forced here on CPU
    # with a minimum width of 2, so the width changes every few steps and the captured shape
    # is always wider than the columns in use: the results are those of the exact width (the
    # log-probs up to float32 rounding, as the attention's sums run over more zeros)
    monkeypatch.setattr(decode, "MIN_WIDTH", 2)
    prompts = ["Hello there", "Q: 1+1=", "x", "abc", "Q: 1+1=", "a longer prompt of text"]
    params = [{"temperature": 1.0, "max_new_tokens": n, "sampling_seed": 7 + i, "ignore_eos": True}
              for i, n in enumerate([3, 19, 5, 40, 7, 11])]
    outs = []
    for bucketed in (False, True):
        eng = embedded.load_engine(str(tiny_dir), max_batch_size=3)
        eng._decoder.bucket_widths = bucketed

        async def together(eng=eng):
            return await asyncio.gather(*[eng.generate(_ids(eng, p), dict(q)) for p, q in zip(prompts, params)])

        outs.append(_run(together()))
    exact, bucketed = outs
    assert [o.output_ids for o in bucketed] == [o.output_ids for o in exact]
    for b, e in zip(bucketed, exact):
        assert b.output_log_probs == pytest.approx(e.output_log_probs, abs=1e-6)


def test_steps_launched_before_the_flags_are_read_give_the_same_results(tiny_dir):
    # on CUDA each step is launched before the previous step's finish flags are read (forced here on CPU): rows
    # finish on the device, slots are refilled while a step is in flight (3 slots, 9 requests of different
    # budgets, stop tokens), a top-k request and a stop-string request and a streamed one overlap too (their
    # tokens come with the flags), a request banning its stop tokens for 3 tokens makes steps read first
    prompts = ["Hello there", "Q: 1+1=", "x", "abc", "Q: 1+1=", "a longer prompt of text", "x", "abc", "Hello"]
    params = [{"temperature": 1.0, "max_new_tokens": n, "sampling_seed": 11 + i, "stop_token_ids": [5, 9]}
              for i, n in enumerate([3, 19, 5, 30, 7, 11, 14, 9, 12])]
    params[6]["top_k"] = 4
    params[7]["min_new_tokens"] = 3
    streamed, stops = {False: [], True: []}, []

    async def run(eng, overlap):
        stop = None
        outs = []
        for p, q in zip(prompts, params):
            q = dict(q)
            if p == "abc" and stop is None:  # a stop string: two characters of this request's own output
                first = await eng.generate(_ids(eng, p), dict(q, stop_token_ids=[]))
                stop = first.text[3:5]
                stops.append(stop)
                q = dict(q, stop_token_ids=[], stop=[stop])
            outs.append(q)
        return await asyncio.gather(*[
            eng.generate(_ids(eng, p), q, on_token=(lambda t, lp, o=overlap: streamed[o].append((t, lp)))
                         if k == 8 else None)
            for k, (p, q) in enumerate(zip(prompts, outs))])

    outs, lagged = [], []
    for overlap in (False, True):
        eng = embedded.load_engine(str(tiny_dir), max_batch_size=3)
        dec = eng._decoder
        dec.overlap = overlap
        step, collect, order = dec._step, dec._collect, []

        def launch(n, step=step, order=order):
            launched = step(n)
            order.append(("launch", launched[0]))
            return launched

        def read(launched, on_finish, collect=collect, order=order):
            order.append(("collect", launched[0]))
            collect(launched, on_finish)

        dec._step, dec._collect = launch, read
        outs.append(_run(run(eng, overlap)))
        lagged.append(sum(what == "launch" and order[k + 1] == ("collect", i - 1)
                          for k, (what, i) in enumerate(order[:-1])))
    plain, overlapped = outs
    assert lagged[0] == 0 and lagged[1] > 10  # the flags of most steps were read after the next launch
    assert stops[0] == stops[1] and plain[3].finish_reason == "stop" and plain[3].text.endswith(stops[0])
    assert len(plain[3].output_ids) < 30 and [o.finish_reason for o in plain].count("stop") >= 2
    for a, b in zip(overlapped, plain):
        assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason)
        # a slot refilled one step later shares its steps with other rows: float summation order only
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-5)
    assert streamed[True] == list(zip(overlapped[8].output_ids, overlapped[8].output_log_probs))
    assert [t for t, _ in streamed[False]] == [t for t, _ in streamed[True]]


def test_a_request_finished_by_the_step_in_flight_returns_during_a_weight_update_pause(tiny_dir):
    # request A's last token comes from step 3; a pause (as a weight update takes it) arrives after step 3 is
    # launched and before its flags are read: A returns during the pause, labelled with the weights that made it
    import threading

    eng = embedded.load_engine(str(tiny_dir), max_batch_size=4)
    dec = eng._decoder
    dec.overlap = True
    collect, launched, paused = dec._collect, threading.Event(), threading.Event()

    def read(step, on_finish):
        if step[0] == 2:  # read right after step 3 was launched
            launched.set()
            paused.wait(10)
        collect(step, on_finish)

    dec._collect = read

    async def main():
        a = asyncio.ensure_future(eng.generate([5, 6, 7], {"temperature": 1.0, "max_new_tokens": 5,
                                                           "sampling_seed": 1}))
        b = asyncio.ensure_future(eng.generate([8, 9, 10], {"temperature": 1.0, "max_new_tokens": 40,
                                                            "sampling_seed": 2}))
        assert await asyncio.to_thread(launched.wait, 10)
        await eng.pause_generation("in_place")
        # a request queued during the pause: admitting it waits for the lock, after the step in flight is read
        c = asyncio.ensure_future(eng.generate([11, 12], {"temperature": 1.0, "max_new_tokens": 3,
                                                          "sampling_seed": 3}))
        await asyncio.sleep(0.05)
        paused.set()
        for _ in range(100):
            if a.done():
                break
            await asyncio.sleep(0.05)
        done_while_paused = a.done() and not c.done()
        await eng.set_weight_version(1)
        await eng.continue_generation()
        return done_while_paused, await a, await b, await c

    done_while_paused, out_a, out_b, out_c = _run(main())
    assert done_while_paused
    assert (out_a.weight_version, len(out_a.output_ids), out_a.finish_reason) == ("0", 5, "length")
    assert (out_b.weight_version, len(out_b.output_ids)) == ("1", 40)
    assert (out_c.weight_version, len(out_c.output_ids)) == ("1", 3)


def test_a_wider_stop_table_drops_the_captured_decode_graphs(tiny_dir):
    # the CUDA graphs read the per-slot stop-token table; a request with more stop ids than any before grows
    # it, so graphs captured over the old table must go (a stand-in graph here: CPU captures none)
    eng = embedded.load_engine(str(tiny_dir), max_batch_size=2)
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    _run(eng.generate(_ids(eng, "Q: 1+1="), dict(params, stop_token_ids=[5])))
    eng._decoder._graphs[(1, 256)] = "captured"
    _run(eng.generate(_ids(eng, "Q: 1+1="), dict(params, stop_token_ids=[5])))
    assert eng._decoder._graphs == {(1, 256): "captured"}  # same table, same graphs
    _run(eng.generate(_ids(eng, "Q: 1+1="), dict(params, stop_token_ids=[5, 6, 7])))
    assert eng._decoder._graphs == {}


def test_compiled_decode_step_gives_the_same_tokens_and_log_probs(tiny_dir):
    # --embedded-torch-compile compiles the decoder layers (around the slot attention) and the
    # sampler; "aot_eager" runs the traced graphs without inductor's code generation, so the
    # test is quick and checks the tracing (prefill and decode shapes, rows changing between
    # steps); a top-k request makes some steps take the uncompiled sampler
    prompts = ["Hello there", "Q: 1+1=", "x", "abc"]
    params = [{"temperature": 1.0, "max_new_tokens": n, "sampling_seed": 3 + i, "ignore_eos": True}
              for i, n in enumerate([4, 17, 9, 12])]
    params[2]["top_k"] = 5
    from torch._dynamo.utils import counters

    traced = counters["frames"]["ok"]
    outs = []
    for backend in (None, "aot_eager"):
        eng = embedded.load_engine(str(tiny_dir), max_batch_size=3, compile=backend)

        async def together(eng=eng):
            return await asyncio.gather(*[eng.generate(_ids(eng, p), dict(q)) for p, q in zip(prompts, params)])

        outs.append(_run(together()))
    plain, compiled = outs
    assert counters["frames"]["ok"] > traced  # the compiled step ran
    assert [o.output_ids for o in compiled] == [o.output_ids for o in plain]
    for c, p in zip(compiled, plain):
        assert c.output_log_probs == pytest.approx(p.output_log_probs, abs=1e-6)


def test_a_group_sharing_one_prompt_equals_its_samples_one_at_a_time(engine):
    # the group's prompt is prefilled once and its keys and values copied to every sample's slot
    params = [{"temperature": 1.0, "top_k": 20, "top_p": 0.9, "max_new_tokens": 8, "sampling_seed": s,
               "stop_token_ids": [5], "min_new_tokens": 2} for s in range(6)]

    async def group():
        return await asyncio.gather(*[engine.generate(_ids(engine, "Q: 1+1="), dict(q)) for q in params])

    outs = _run(group())
    assert len({tuple(o.output_ids) for o in outs}) > 1  # the seeds differ, so do the samples
    for q, out in zip(params, outs):
        alone = _run(engine.generate(_ids(engine, "Q: 1+1="), dict(q)))
        assert (out.output_ids, out.finish_reason) == (alone.output_ids, alone.finish_reason)
        assert out.output_log_probs == pytest.approx(alone.output_log_probs, abs=1e-5)


def test_sampler_draws_tokens_with_the_softmax_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20_000
    logits = probs.log().expand(n, 4)
    tokens, logp = sample_batch(logits, torch.ones(n), torch.zeros(n, dtype=torch.bool),
                                torch.full((n,), 7, dtype=torch.long), torch.arange(n))
    freq = torch.bincount(tokens, minlength=4).float() / n
    torch.testing.assert_close(freq, probs, rtol=0, atol=0.012)
    torch.testing.assert_close(logp, probs.log()[tokens])


def test_batched_filter_applies_each_row_s_own_top_k_and_top_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(3, 4)
    out = filter_logits(logits, torch.tensor([2, -1, -1]), torch.tensor([1.0, 0.7, 0.4]))
    kept = [[i for i in range(4) if row[i] > float("-inf")] for row in out]
    assert kept == [[0, 1], [0, 1], [0]]


def test_greedy_equals_transformers_generate_with_grouped_query_attention(engine):
    # 4 query heads over 2 key/value heads: the slot attention's folded decode path
    from transformers import LlamaConfig, LlamaForCausalLM

    from furlong.builtin_plugins.engines.embedded.engine import EmbeddedEngine

    tok = engine.tokenizer
    config = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256, eos_token_id=EOS_ID,
                         pad_token_id=0)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).eval()
    model = LlamaForCausalLM(config)
    model.load_state_dict(reference.state_dict())
    gqa = EmbeddedEngine(model, tok, max_batch_size=4)
    outs = _run(_all(gqa, PROMPTS, GREEDY))
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([_ids(gqa, prompt)])
        expected = reference.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert out.output_ids == expected[0, ids.shape[1]:].tolist()


# --- stopping -----------------------------------------------------------------------------


def test_max_new_tokens_gives_length(engine):
    out = _run(engine.generate(_ids(engine, "abc"), {"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True}))
    assert (out.finish_reason, len(out.output_ids), len(out.output_log_probs)) == ("length", 5, 5)
    zero = _run(engine.generate(_ids(engine, "abc"), {"max_new_tokens": 0}))
    assert (zero.finish_reason, zero.output_ids, zero.text) == ("length", [], "")


def test_stop_token_id_ends_the_output_and_is_kept(engine):
    full = _run(engine.generate(_ids(engine, "Hello there"), dict(GREEDY))).output_ids
    stop = full[5]
    k = full.index(stop)  # first occurrence
    out = _run(engine.generate(_ids(engine, "Hello there"), {**GREEDY, "stop_token_ids": [stop]}))
    assert out.output_ids == full[: k + 1]
    assert out.finish_reason == "stop"


def test_stop_string_ends_the_output_and_is_kept(engine):
    full = _run(engine.generate(_ids(engine, "Q: 1+1="), dict(GREEDY)))
    stop = full.text[6:8]
    k = next(n for n in range(1, 17) if stop in engine.tokenizer.decode(full.output_ids[:n], skip_special_tokens=True))
    out = _run(engine.generate(_ids(engine, "Q: 1+1="), {**GREEDY, "stop": [stop]}))
    assert out.output_ids == full.output_ids[:k]
    assert out.finish_reason == "stop" and out.text.endswith(stop)


def test_min_new_tokens_bans_stop_tokens_early(engine):
    full = _run(engine.generate(_ids(engine, "Hello there"), dict(GREEDY))).output_ids
    stop = full[0]
    out = _run(engine.generate(_ids(engine, "Hello there"), {**GREEDY, "stop_token_ids": [stop],
                                                            "min_new_tokens": 3}))
    assert stop not in out.output_ids[:3]
    assert len(out.output_ids) >= 3
    assert out.finish_reason == ("stop" if out.output_ids[-1] == stop else "length")


def test_eos_stops_unless_ignore_eos(tiny_dir):
    eng = embedded.load_engine(str(tiny_dir))
    first = _run(eng.generate(_ids(eng, "x"), dict(GREEDY))).output_ids[0]
    head = eng.model.state_dict()["lm_head.weight"].clone()
    head[EOS_ID] = 1.5 * head[first]  # the greedy first token's logit (> 0) times 1.5: EOS wins
    _run(eng.update_weights([("lm_head.weight", head)], 2))
    stopped = _run(eng.generate(_ids(eng, "x"), {"temperature": 0, "max_new_tokens": 8}))
    assert (stopped.output_ids, stopped.finish_reason, stopped.text) == ([EOS_ID], "stop", "")
    kept = _run(eng.generate(_ids(eng, "x"), {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}))
    assert kept.output_ids[0] == EOS_ID and kept.finish_reason == "length"


# --- log-probs agree with the trainer ---------------------------------------------------------


def test_log_probs_match_the_trainer_recomputation(tiny_dir, engine):
    params = {"temperature": 0.7, "top_p": 0.95, "max_new_tokens": 10, "ignore_eos": True}
    torch.manual_seed(0)
    outs = _run(_all(engine, PROMPTS[:2], params))
    backend = train_backend(config=train_config(tiny_dir))
    _run(backend.init(backend.config))
    tokens = [_ids(engine, p) + o.output_ids for p, o in zip(PROMPTS[:2], outs)]
    lengths = [len(o.output_ids) for o in outs]
    batch = TrainBatch(tokens=tokens, response_lengths=lengths, loss_masks=[torch.ones(n) for n in lengths],
                       temperature=0.7)
    recomputed = _run(backend.log_probs(batch))["log_probs"]
    for out, lp in zip(outs, recomputed):
        torch.testing.assert_close(torch.tensor(out.output_log_probs), lp, rtol=0, atol=1e-4)


# --- abort --------------------------------------------------------------------------------


def test_abort_returns_partial_tokens_and_clears_the_queue(tiny_dir):
    eng = embedded.load_engine(str(tiny_dir), max_batch_size=1)
    long = {"temperature": 0, "max_new_tokens": 100_000, "ignore_eos": True}

    async def scenario():
        running = asyncio.ensure_future(eng.generate(_ids(eng, "Hello there"), dict(long)))
        queued = asyncio.ensure_future(eng.generate(_ids(eng, "x"), dict(long)))
        await asyncio.sleep(0.5)
        await eng.abort()
        assert running.done() and queued.done()  # resolved by the time abort() returns
        after = await eng.generate(_ids(eng, "Hello there"), {"temperature": 0, "max_new_tokens": 30,
                                                              "ignore_eos": True})
        return running.result(), queued.result(), after

    running, queued, after = _run(scenario())
    assert running.finish_reason == "abort"
    assert 0 < len(running.output_ids) < 100_000
    assert len(running.output_log_probs) == len(running.output_ids)
    assert (queued.finish_reason, queued.output_ids) == ("abort", [])
    assert after.finish_reason == "length"  # requests after the abort run normally
    n = min(len(running.output_ids), 30)
    assert running.output_ids[:n] == after.output_ids[:n]  # the partial tokens are the real greedy prefix


def test_abort_request_by_rid_ends_only_that_request_with_partial_tokens(tiny_dir):
    eng = embedded.load_engine(str(tiny_dir), max_batch_size=1)
    long = {"temperature": 0, "max_new_tokens": 100_000, "ignore_eos": True}
    short = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}

    async def scenario():
        running = asyncio.ensure_future(eng.generate(_ids(eng, "Hello there"), dict(long), rid="a"))
        queued = asyncio.ensure_future(eng.generate(_ids(eng, "x"), dict(long), rid="b"))
        other = asyncio.ensure_future(eng.generate(_ids(eng, "Q: 1+1="), dict(short), rid="c"))
        await asyncio.sleep(0.5)
        assert await eng.abort_request("b")  # queued: ends at once, no tokens
        await asyncio.wait_for(asyncio.shield(queued), 1)
        assert not running.done()
        assert await eng.abort_request("a")
        assert not await eng.abort_request("nobody")
        with pytest.raises(PluginError, match="request id 'c' is already in use"):
            await eng.generate([1, 2], dict(short), rid="c")
        return await running, await queued, await other

    running, queued, other = _run(scenario())
    assert running.finish_reason == "abort" and 0 < len(running.output_ids) < 100_000
    assert (queued.finish_reason, queued.output_ids) == ("abort", [])
    assert (other.finish_reason, len(other.output_ids)) == ("length", 20)  # not aborted
    assert not eng._by_rid  # finished requests free their ids


def test_on_token_streams_every_token_before_the_result(engine):
    seen = []

    async def scenario():
        out = await engine.generate(_ids(engine, "Hello there"), dict(GREEDY),
                                    on_token=lambda token, log_prob: seen.append((token, log_prob)))
        return out, list(seen)

    out, at_finish = _run(scenario())
    assert at_finish == list(zip(out.output_ids, out.output_log_probs))


# --- weights ------------------------------------------------------------------------------


def test_update_weights_changes_outputs_and_version(tiny_dir):
    eng = embedded.load_engine(str(tiny_dir))
    before = _run(eng.generate(_ids(eng, "Hello there"), dict(GREEDY)))
    assert before.weight_version == "0"
    gen = torch.Generator().manual_seed(1)
    new = [(k, v + 0.5 * torch.randn(v.shape, generator=gen)) for k, v in eng.model.state_dict().items()]
    _run(eng.update_weights(new, 5))
    after = _run(eng.generate(_ids(eng, "Hello there"), dict(GREEDY)))
    assert after.weight_version == "5"
    assert after.output_ids != before.output_ids
    assert torch.equal(eng.model.state_dict()["lm_head.weight"], dict(new)["lm_head.weight"])


def test_update_weights_reach_the_compiled_layers(tiny_dir):
    # weights are copied in place; the compiled layers take the parameters as inputs, so
    # they decode with the new weights exactly as an uncompiled engine does
    engines = [embedded.load_engine(str(tiny_dir), compile=backend) for backend in ("aot_eager", None)]
    before = [_run(eng.generate(_ids(eng, "Hello there"), dict(GREEDY))) for eng in engines]
    gen = torch.Generator().manual_seed(2)
    new = [(k, v + 0.5 * torch.randn(v.shape, generator=gen)) for k, v in engines[1].model.state_dict().items()]
    for eng in engines:
        _run(eng.update_weights(list(new), 1))
    compiled, plain = [_run(eng.generate(_ids(eng, "Hello there"), dict(GREEDY))) for eng in engines]
    assert before[0].output_ids == before[1].output_ids != compiled.output_ids
    assert compiled.output_ids == plain.output_ids
    assert compiled.output_log_probs == pytest.approx(plain.output_log_probs, abs=1e-6)


def test_compiled_layers_keep_every_variant_compiled(tiny_dir):
    """Prefill and decode batches of several sizes and of one row make 10 variants of one function of the
    layers (more with a compiled trainer's layers in the same process); past torch's default of 8 they ran
    uncompiled. Torch keeps the limit per context, and a run loads the engine in a context of its own (a
    task's), so a limit set once while compiling would not reach the decode; the layers' calls set it."""
    import contextvars

    torch._dynamo.reset()  # variants of other tests' models count on the same functions
    try:
        with torch._dynamo.config.patch(cache_size_limit=8, fail_on_recompile_limit_hit=True):
            eng = contextvars.copy_context().run(embedded.load_engine, str(tiny_dir), max_batch_size=8,
                                                 compile="aot_eager")
            tokens = _ids(eng, "12+3=")
            params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
            async def generate(n: int) -> list:
                return await asyncio.gather(*(eng.generate(tokens[: 2 + i], dict(params)) for i in range(n)))

            for n in (8, 3, 1, 8, 1):
                assert [len(out.output_ids) for out in _run(generate(n))] == [6] * n
    finally:
        torch._dynamo.reset()


def test_update_weights_rejects_unknown_names_and_shapes(engine):
    with pytest.raises(PluginError) as err:
        _run(engine.update_weights([("model.nope.weight", torch.zeros(1))], 1))
    assert str(err.value) == (
        "embedded engine: update_weights got unknown tensor 'model.nope.weight'; "
        "names must match the model's Hugging Face state_dict."
    )
    with pytest.raises(PluginError) as err:
        _run(engine.update_weights([("lm_head.weight", torch.zeros(2, 2))], 1))
    assert str(err.value) == "embedded engine: update_weights tensor 'lm_head.weight' has shape (2, 2), the model expects (100, 32)."


# --- sampling math ------------------------------------------------------------------------


def test_filter_logits_top_k_keeps_exactly_k():
    out = filter_logits(torch.tensor([1.0, 3.0, 2.0, 0.0]), top_k=2, top_p=1.0)
    assert out.tolist() == [float("-inf"), 3.0, 2.0, float("-inf")]


@pytest.mark.parametrize(
    "top_p, kept",
    [
        # probabilities 0.5, 0.3, 0.15, 0.05; a token stays while the mass before it is < top_p
        (0.4, [0]),  # mass before token 1 = 0.5 >= 0.4
        (0.7, [0, 1]),  # before token 2 = 0.8 >= 0.7
        (0.85, [0, 1, 2]),  # before token 3 = 0.95 >= 0.85
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_filter_logits_top_p_nucleus(top_p, kept):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    out = filter_logits(logits, top_k=-1, top_p=top_p)
    assert [i for i in range(4) if out[i] > float("-inf")] == kept


def test_greedy_sampler_skips_banned_tokens_but_reports_their_mass():
    # logits [2, 0, 1], token 0 banned: greedy picks 2; log-prob from the full distribution
    logits = torch.tensor([[2.0, 0.0, 1.0]])
    token, logp = sample_batch(logits, torch.ones(1), torch.tensor([True]), torch.zeros(1, dtype=torch.long),
                               torch.zeros(1, dtype=torch.long), banned=torch.tensor([[True, False, False]]))
    expected = 1.0 - torch.logsumexp(torch.tensor([2.0, 0.0, 1.0]), 0).item()  # log_softmax([2, 0, 1])[2]
    assert token.tolist() == [2] and float(logp) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"temperature": -0.5}, "embedded engine: sampling_params['temperature'] = -0.5 must be >= 0 (0 = greedy)."),
        ({"top_p": 0}, "embedded engine: sampling_params['top_p'] = 0.0 must be in (0, 1]."),
        ({"top_k": 0}, "embedded engine: sampling_params['top_k'] = 0 must be -1 (off) or >= 1."),
        ({"max_new_tokens": -1}, "embedded engine: sampling_params['max_new_tokens'] = -1 must be >= 0."),
    ],
)
def test_bad_sampling_params_are_plugin_errors(params, message):
    with pytest.raises(PluginError) as err:
        SamplingParams.from_dict(params)
    assert str(err.value) == message


def test_sampling_params_defaults_and_unknown_keys():
    p = SamplingParams.from_dict({"stop": "</a>", "no_stop_trim": True, "spaces_between_special_tokens": False,
                                  "top_k": None})
    assert (p.stop, p.top_k, p.temperature, p.max_new_tokens, p.skip_special_tokens) == (["</a>"], -1, 1.0, 128, True)


def test_a_prompt_longer_than_the_context_is_a_clear_error(engine):
    with pytest.raises(PluginError) as err:
        asyncio.run(engine.generate([5] * engine.context_len, {"max_new_tokens": 2}))
    assert str(err.value) == (
        f"embedded engine: a prompt of {engine.context_len} tokens does not fit the model's context of "
        f"{engine.context_len} tokens (max_position_embeddings); drop long prompts with --rollout-max-prompt-len "
        "(--eval-max-prompt-len for eval sets).")


def test_generation_stops_with_length_when_the_context_is_full(engine):
    prompt = [5] * (engine.context_len - 4)
    out = asyncio.run(engine.generate(prompt, {"max_new_tokens": 500, "ignore_eos": True, "temperature": 0}))
    assert (len(out.output_ids), out.finish_reason) == (4, "length")


def test_a_continue_that_overtakes_a_waiting_pause_leaves_the_engine_running(engine):
    async def main():
        engine._lock.acquire()  # a decode step in progress: the pause waits for it
        pausing = asyncio.ensure_future(engine.pause_generation("retract"))
        await asyncio.sleep(0.05)
        await engine.continue_generation()
        engine._lock.release()
        await pausing
        assert not engine._paused and not engine._lock.locked()
        out = await asyncio.wait_for(engine.generate([1, 2, 3], {"max_new_tokens": 3, "temperature": 0}), 30)
        assert len(out.output_ids) == 3

    _run(main())


def test_abort_while_paused_returns_and_the_request_ends_aborted_on_continue(engine):
    async def main():
        await engine.pause_generation("retract")
        request = asyncio.ensure_future(engine.generate([1, 2, 3], {"max_new_tokens": 3, "temperature": 0}))
        await asyncio.sleep(0.1)
        await asyncio.wait_for(engine.abort(), 5)  # does not wait for a batch that cannot step while paused
        await engine.continue_generation()
        assert (await asyncio.wait_for(request, 30)).finish_reason == "abort"

    _run(main())


def test_two_level_inverse_cdf_equals_one_scan_over_the_vocabulary():
    from furlong.builtin_plugins.engines.embedded.sampling import inverse_cdf

    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(64, 3000, generator=gen) * (torch.rand(64, 3000, generator=gen) > 0.5)  # zeros too
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    expected = torch.searchsorted(probs.double().cumsum(-1), (u * probs.double().sum(-1))[:, None], right=True)[:, 0]
    got = inverse_cdf(probs, u.float(), block=128)
    assert (got == expected).float().mean() > 0.98  # equal but for float32 rounding at block edges
    assert bool((probs.gather(1, got[:, None]) > 0).all())  # never a token of zero probability


def test_inverse_cdf_of_a_vocabulary_smaller_than_a_block_is_one_scan():
    from furlong.builtin_plugins.engines.embedded.sampling import inverse_cdf

    gen = torch.Generator().manual_seed(1)
    probs = torch.rand(256, 26, generator=gen) * (torch.rand(256, 26, generator=gen) > 0.3)
    probs[:, 0] += 1e-3  # every row has some mass
    u = torch.rand(256, generator=gen)
    target = u * probs.sum(-1)
    expected = torch.searchsorted(probs.cumsum(-1), target[:, None], right=True)[:, 0].clamp(max=25)
    got = inverse_cdf(probs, u)  # default block of 1024 > 26 tokens
    assert torch.equal(got, expected)
    assert bool((probs.gather(1, got[:, None]) > 0).all())


async def _each(engine, prompts, params):
    return await asyncio.gather(*[engine.generate(_ids(engine, p), dict(q)) for p, q in zip(prompts, params)])


def _with_and_without_sharing(tiny_dir, prompts, params, max_batch_size):
    """Outputs of the requests and the rows of every prefill pass, with prompt sharing (True) and without."""
    outs, rows = {}, {}
    for share in (True, False):
        eng = embedded.load_engine(str(tiny_dir), max_batch_size=max_batch_size, seed=0)
        eng._decoder.share_prompts = share
        forward, rows[share] = eng.model.forward, []

        def counted(*args, forward=forward, seen=rows[share], **kwargs):
            if kwargs["slot_pass"].causal is not None:  # a prefill pass
                seen.append(kwargs["input_ids"].shape[0])
            return forward(*args, **kwargs)

        eng.model.forward = counted
        outs[share] = _run(_each(eng, prompts, params))
        assert eng._decoder._prompts == {}  # nothing kept once every request finished
    for a, b in zip(outs[True], outs[False]):
        assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason)
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-6)
    return outs, rows


def test_groups_sharing_their_prompt_prefill_give_what_one_row_per_request_gives(tiny_dir):
    # groups of samples with the same prompt, admitted together: with sharing each group's prompt is one prefill
    # row (keys and values copied to every sample's slot); without it every request has its own row
    prompts = [p for p in ("Q: 1+1=", "Hello there", "abc", "Q: 1+1=x") for _ in range(4)]
    params = [{"temperature": 1.0, "max_new_tokens": 10, "sampling_seed": k, "stop_token_ids": [7]}
              for k in range(len(prompts))]
    outs, rows = _with_and_without_sharing(tiny_dir, prompts, params, max_batch_size=16)
    assert rows == {True: [4], False: [16]}  # one admission: 4 prefill rows against 16
    assert len({tuple(o.output_ids) for o in outs[True]}) > 4  # the samples of a group differ


def test_a_group_split_over_admissions_takes_its_prompt_from_a_busy_slot(tiny_dir):
    # three slots for six samples of one prompt and two of another, finishing one by one: the later samples of
    # a group are admitted while others still hold the prompt, so only the first admission runs a prefill
    prompts = ["Q: 1+1="] * 6 + ["abc"] * 2
    params = [{"temperature": 1.0, "max_new_tokens": n, "sampling_seed": k, "ignore_eos": True}
              for k, n in enumerate([2, 9, 12, 3, 4, 6, 5, 7])]
    _, rows = _with_and_without_sharing(tiny_dir, prompts, params, max_batch_size=3)
    assert rows[True] == [1, 1] and sum(rows[False]) == 8  # "Q: 1+1=" at the start, "abc" when it comes in


def test_a_weight_update_forgets_the_prompts_busy_slots_hold(engine):
    import torch

    engine._decoder._prompts = {(5, 6): (torch.zeros(3), {0})}
    engine._decoder._prompt_of = {0: (5, 6)}
    name, tensor = next(iter(engine.model.state_dict().items()))
    _run(engine.update_weights([(name, tensor.clone())], version=1))
    assert engine._decoder._prompts == {} and engine._decoder._prompt_of == {}


# --- compaction of the busy slots ---------------------------------------------------------------


def _recording_steps(eng):
    """Wrap the decoder's ``_step`` so that every step's row count ``n`` is recorded; returns the list."""
    dec, sizes = eng._decoder, []
    step = dec._step

    def recorded(n, step=step):
        sizes.append(n)
        return step(n)

    dec._step = recorded
    return sizes


def test_compaction_moves_requests_into_freed_slots_and_changes_no_result(tiny_dir):
    # six requests admitted together; the three in slots 0, 2 and 4 finish after 2-3 tokens, so the three long
    # ones move down to slots 0-2 and the later steps compute 3 rows instead of 6
    prompts = ["Hello there", "Q: 1+1=", "x", "abc", "Q: 1+1=", "a longer prompt of text"]
    params = [{"temperature": 1.0, "max_new_tokens": n, "sampling_seed": 40 + i, "ignore_eos": True}
              for i, n in enumerate([2, 14, 3, 10, 2, 12])]
    outs, sizes = {}, {}
    for compact in (True, False):
        eng = embedded.load_engine(str(tiny_dir), max_batch_size=6)
        if not compact:
            eng._decoder._compact = lambda: None
        sizes[compact] = _recording_steps(eng)
        outs[compact] = _run(_each(eng, prompts, params))
        assert eng._decoder._prompts == {} and not eng._decoder.busy.any()
    # rows per step (the budgets count the prefill's token): without compaction slot 5 keeps 6 rows running until
    # its 12th token; with it, slot 5 moves to 0 after step 1, slot 3 to 2 after step 2, slot 1 to 0 at the end
    assert sizes[False] == [6] * 11 + [2, 2]
    assert sizes[True] == [6, 4] + [3] * 7 + [2, 2, 1, 1]
    alone = [_run(eng.generate(_ids(eng, p), dict(q))) for p, q in zip(prompts, params)]
    for a, b, c in zip(outs[True], outs[False], alone):
        assert len(a.output_ids) == len(c.output_ids) and a.finish_reason == "length"
        assert a.output_ids == b.output_ids == c.output_ids
        assert a.output_log_probs == pytest.approx(c.output_log_probs, abs=1e-5)
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-5)


def test_a_prompt_held_by_a_moved_slot_is_shared_from_its_new_slot(tiny_dir):
    import threading

    # the long request of prompt X moves from slot 3 to slot 0 once the three short ones finish; a request of the
    # same prompt that arrives afterwards takes X's keys and values from slot 0 (no prefill) and gets what it gets alone
    eng = embedded.load_engine(str(tiny_dir), max_batch_size=4)
    copies = []
    copy_prefix = eng._decoder.cache.copy_prefix

    def recorded(sources, targets, length):
        copies.append((sources.tolist(), targets.tolist()))
        return copy_prefix(sources, targets, length)

    eng._decoder.cache.copy_prefix = recorded
    prefills = []
    forward = eng.model.forward

    def counted(*args, **kwargs):
        if kwargs["slot_pass"].causal is not None:
            prefills.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    eng.model.forward = counted
    moved, submitted, step = threading.Event(), threading.Event(), eng._decoder._step

    def gated(n):  # the first one-row step (after the move) waits until the late request is queued
        if n == 1 and not moved.is_set():
            moved.set()
            assert submitted.wait(10)
        return step(n)

    eng._decoder._step = gated
    short = {"temperature": 1.0, "max_new_tokens": 2, "ignore_eos": True}
    late_params = {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 9, "ignore_eos": True}

    async def main():
        firsts = [asyncio.ensure_future(eng.generate(_ids(eng, p), {**short, "sampling_seed": k}))
                  for k, p in enumerate(["abc", "x", "Hello there"])]
        held = asyncio.ensure_future(eng.generate(_ids(eng, "Q: 1+1="), {"temperature": 1.0, "max_new_tokens": 40,
                                                                          "sampling_seed": 8, "ignore_eos": True}))
        await asyncio.gather(*firsts)
        assert await asyncio.to_thread(moved.wait, 10)  # queued now, the late request would take the move's place
        late = asyncio.ensure_future(eng.generate(_ids(eng, "Q: 1+1="), dict(late_params)))
        await asyncio.sleep(0)  # generate() queues the request before it first waits
        submitted.set()
        return await late, await held

    late, held = _run(main())
    assert ([3], [0]) in copies  # the move
    assert prefills == [4]  # one prefill: the late request's prompt came from the moved slot
    assert copies[-1] == ([0], [1])  # ... and its keys and values from slot 0 into the first free slot
    eng.model.forward, eng._decoder._step = forward, step
    alone = _run(eng.generate(_ids(eng, "Q: 1+1="), dict(late_params)))
    assert late.output_ids == alone.output_ids
    assert late.output_log_probs == pytest.approx(alone.output_log_probs, abs=1e-5)
    assert len(held.output_ids) == 40


def test_a_model_with_sliding_window_layers_is_warned_about(tiny_dir, tmp_path, caplog):
    """The engine attends to every earlier position; the trainer honours the window."""
    import shutil

    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    for sliding in (False, True):
        folder = tmp_path / f"sliding-{sliding}"
        config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256,
                             use_sliding_window=sliding, sliding_window=8 if sliding else None, max_window_layers=0)
        Qwen2ForCausalLM(config).save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tiny_dir / name).exists():
                shutil.copy(tiny_dir / name, folder / name)
        caplog.clear()
        with caplog.at_level("WARNING", logger="furlong.engines.embedded"):
            embedded.load_engine(str(folder))
        warned = [r.getMessage() for r in caplog.records if "sliding-window" in r.getMessage()]
        assert len(warned) == int(sliding) and (not sliding or str(folder) in warned[0])


def test_prompt_log_probs_call_the_model_holding_the_process_turn(engine, monkeypatch):
    """``furlong serve``'s prompt log-probs run in a worker thread beside any decode: their module calls hold the
    process's turn (furlong.kit.compute_thread.compute_turn), as the decode steps' do."""
    held, outside = record_module_calls(monkeypatch)
    ids = _ids(engine, "1+2=3")
    log_probs = _run(engine.prompt_log_probs(ids, 0))
    assert len(log_probs) == len(ids) and log_probs[0] is None
    assert held and outside == []
