"""Mixture-of-experts models in the megatron backend on CPU: a tiny Qwen3-MoE made by transformers, converted
both ways, its forward against transformers', Megatron's MoE flags against config.json, the load-balancing
loss against a hand computation, expert parallelism over two gloo ranks, routing replay."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from furlong.builtin_plugins.backends.megatron import configure  # noqa: E402
from furlong.builtin_plugins.backends.megatron import train_backend as megatron_backend  # noqa: E402
from furlong.builtin_plugins.backends.megatron.config import model_shape  # noqa: E402
from furlong.builtin_plugins.backends.megatron.convert import export_hf, load_hf, safetensors_stream  # noqa: E402
from furlong.builtin_plugins.backends.megatron.model import build_gpt, cpu_shims, init_parallel  # noqa: E402
from furlong.builtin_plugins.backends.megatron.moe import moe_transformer_fields  # noqa: E402
from furlong.hooks import ConfigReport, PluginError  # noqa: E402

from .tiny_model import build_tiny_moe_model, make_batch, train_args, train_config  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_rank_groups():
    init_parallel(1, CPU)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return sharpened(build_tiny_moe_model(tmp_path_factory.mktemp("moe") / "hf"))


def sharpened(path: Path, seed: int = 1) -> Path:
    """Rewrite the router weights of the checkpoint at ``path`` with std 1 (transformers' init gives routers
    near-uniform scores, where the top-k could hinge on float rounding), keeping per-expert names."""
    from safetensors.torch import save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    generator = torch.Generator().manual_seed(seed)
    for name in tensors:
        if name.endswith("mlp.gate.weight"):
            tensors[name] = torch.randn(tensors[name].shape, generator=generator)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def megatron_of(path: Path, args=None):
    """``(shape, GPTModel)`` of the HF checkpoint at ``path``, float32, loaded by streaming conversion."""
    shape = model_shape(AutoConfig.from_pretrained(path))
    args = args or train_config(path)
    model = build_gpt(shape, 1, shape.vocab_size, torch.float32, CPU, **moe_transformer_fields(shape, args))
    load_hf(model, safetensors_stream(str(path)), shape, shape.vocab_size, 1, 0, str(path))
    return shape, model.eval()


def hf_of(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


# --- conversion and forward ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["normalised", "not-normalised-tied", "dense-layer"])
def test_round_trip_is_bit_exact_and_the_forward_is_transformers(variant, tmp_path):
    options = {"normalised": {}, "not-normalised-tied": dict(norm_topk_prob=False, tied=True),
               "dense-layer": {}}[variant]
    path = build_tiny_moe_model(tmp_path / "hf", seed=3, **options)
    if variant == "dense-layer":  # layer 0 keeps a dense MLP (transformers' mlp_only_layers)
        config = json.loads((path / "config.json").read_text())
        config["mlp_only_layers"] = [0]
        (path / "config.json").write_text(json.dumps(config))
        torch.manual_seed(4)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32).save_pretrained(path)
    sharpened(path)
    shape, model = megatron_of(path)
    assert shape.moe_layers == ((1,) if variant == "dense-layer" else (0, 1))
    disk = load_file(path / "model.safetensors")
    back = dict(export_hf(model, shape, 1, None))
    expected = {k: v for k, v in disk.items() if not (shape.tied and k == "lm_head.weight")}
    assert sorted(back) == sorted(expected)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in back and "model.layers.1.mlp.gate.weight" in back
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name
    ids = torch.randint(4, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), cpu_shims(CPU):
        logits = model(input_ids=ids, position_ids=None, attention_mask=None)
        reference = hf_of(path)(ids).logits
    torch.testing.assert_close(logits, reference, rtol=0, atol=2e-5)


def test_backend_log_probs_are_transformers(moe_dir):
    backend = megatron_backend(config=train_config(moe_dir))
    asyncio.run(backend.init(backend.config))
    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    batch = make_batch(tokenizer, [[[0, 1], [2, 3]]])
    got = asyncio.run(backend.log_probs(batch))["log_probs"]
    hf = hf_of(moe_dir)
    for tokens, n, lp in zip(batch.tokens, batch.response_lengths, got):
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, :-1].log_softmax(-1)
        want = logits.gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)[-n:]
        torch.testing.assert_close(lp, want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("experts", [True, False])
def test_only_a_dense_model_shares_prompts_in_a_packed_micro_batch(experts, moe_dir, tiny_model_dir, monkeypatch):
    """A model with experts runs every sample whole (its routers, their load-balancing loss and routing replay see
    the tokens they see unshared); a dense model runs the prompt two samples share once. Both give the same
    log-probs as without sharing."""
    from furlong.builtin_plugins.backends.megatron import logprobs

    backend = megatron_backend(config=train_config(moe_dir if experts else tiny_model_dir))
    asyncio.run(backend.init(backend.config))
    batch = make_batch(AutoTokenizer.from_pretrained(moe_dir if experts else tiny_model_dir), [[[0, 1, 2, 3]]])
    n0, n1 = batch.response_lengths[:2]
    batch.tokens[1] = batch.tokens[0][:-n0] + batch.tokens[1][-n1:]  # samples 0 and 1 share a prompt
    unshared = asyncio.run(backend.log_probs(batch))["log_probs"]
    monkeypatch.setattr(backend, "_packed", lambda tokens: True)
    calls = []
    real = logprobs.shared_prompt_inputs
    monkeypatch.setattr(logprobs, "shared_prompt_inputs", lambda *a: calls.append(a) or real(*a))
    packed = asyncio.run(backend.log_probs(batch))["log_probs"]
    assert bool(calls) is not experts
    for a, b in zip(unshared, packed):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-5)


# --- flags against config.json ---------------------------------------------------------------------------


def _report(path, **flags) -> ConfigReport:
    report = ConfigReport(plugin="megatron")
    configure(train_args(path, **flags), report)
    return report


def test_miles_moe_flags_that_match_config_json_are_accepted(moe_dir):
    report = _report(moe_dir, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_grouped_gemm=True,
                     megatron_args={"moe_router_score_function": "softmax", "moe_layer_freq": "'([1]*2)'",
                                    "moe_router_dtype": "fp32", "moe_router_load_balancing_type": "seq_aux_loss",
                                    "moe_aux_loss_coeff": [1e-3]})
    assert report.errors == []


def test_moe_flags_that_disagree_with_config_json_name_both_values(moe_dir):
    report = _report(moe_dir, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
                     megatron_args={"moe_router_pre_softmax": True, "moe_router_score_function": "sigmoid",
                                    "moe_router_load_balancing_type": "sinkhorn"})
    where = f"--hf-checkpoint {moe_dir}/config.json"
    assert report.errors == [
        f"--num-experts 8 disagrees with {where} (num_experts = 4).",
        f"--moe-ffn-hidden-size 32 disagrees with {where} (moe_intermediate_size = 16).",
        f"--moe-router-score-function sigmoid disagrees with {where} (qwen3_moe routes by softmax).",
        f"--moe-router-pre-softmax is given but {where} says norm_topk_prob = true (the top-k probabilities are "
        "renormalised, which is Megatron's softmax after top-k).",
        "--moe-router-load-balancing-type sinkhorn is not supported yet by --train-backend megatron (supported: "
        "aux_loss, seq_aux_loss, none).",
    ]


def test_moe_flags_on_a_dense_model_are_one_error(tiny_model_dir):
    report = _report(tiny_model_dir, num_experts=4, megatron_args={"moe_router_topk": 2})
    assert report.errors == [
        f"these Megatron flags describe features the model of --hf-checkpoint {tiny_model_dir}/config.json does not "
        "have: --moe-router-topk (the model has no experts) --num-experts (the model has no experts); remove them."]


def test_multi_token_prediction_is_refused_with_what_to_do(moe_dir):
    report = _report(moe_dir, megatron_args={"mtp_num_layers": 1}, enable_mtp_training=True)
    assert report.errors == [
        "multi-token prediction is not supported yet by --train-backend megatron: it needs MTP layers in the "
        "--hf-checkpoint (DeepSeek-V3's num_nextn_predict_layers, a family this backend does not build yet); "
        "Qwen3, Qwen3-MoE, Qwen2, Llama and GLM-4 checkpoints ship none. Remove --mtp-num-layers, "
        "--enable-mtp-training."]


def test_deepseek_v3_is_refused_naming_what_is_missing():
    config = AutoConfig.for_model("deepseek_v3")
    with pytest.raises(PluginError) as excinfo:
        model_shape(config, "--hf-checkpoint ds")
    assert str(excinfo.value) == (
        "--hf-checkpoint ds: model_type 'deepseek_v3' is not supported yet by --train-backend megatron: multi-latent "
        "attention, the sigmoid router with its expert bias (e_score_correction_bias), shared experts and multi-token "
        "prediction layers are not built yet (supported: qwen2, qwen3, qwen3_moe, llama, glm4).")


def test_expert_parallelism_is_checked_against_the_experts(moe_dir, tiny_model_dir):
    assert _report(moe_dir, actor_num_gpus_per_node=3, megatron_args={"expert_model_parallel_size": 3}).errors == [
        f"--expert-model-parallel-size 3 does not divide the 4 experts of --hf-checkpoint {moe_dir}."]
    assert _report(tiny_model_dir, megatron_args={"expert_model_parallel_size": 2}).errors == [
        f"--expert-model-parallel-size 2: the model of --hf-checkpoint {tiny_model_dir} has no experts."]
    report = _report(moe_dir, tensor_model_parallel_size=2)
    assert (report.errors, report.warnings) == ([
        f"--tensor-model-parallel-size 2 on a mixture-of-experts model (--hf-checkpoint {moe_dir}) needs "
        "--sequence-parallel: megatron-core routes each TP rank's share of the sequence."], [])
    assert _report(moe_dir, actor_num_gpus_per_node=2, megatron_args={"expert_model_parallel_size": 4}).errors == [
        "--expert-model-parallel-size 4 x --pipeline-model-parallel-size 1 does not divide the trainer world size 2 "
        "(--actor-num-nodes x --actor-num-gpus-per-node)."]
    report = _report(moe_dir, tensor_model_parallel_size=2, sequence_parallel=True)
    assert report.errors == []
    assert report.warnings == [
        "--expert-tensor-parallel-size is not given: Megatron-LM would split every expert over the 2 TP ranks; here "
        "each TP rank holds whole experts (expert TP 1: the same updates, more memory per rank). Give "
        "--expert-tensor-parallel-size 1 to say so."]
    report = _report(moe_dir, tensor_model_parallel_size=2, sequence_parallel=True,
                     megatron_args={"expert_tensor_parallel_size": 1})
    assert (report.errors, report.warnings) == ([], [])
    assert _report(moe_dir, tensor_model_parallel_size=2, sequence_parallel=True,
                   megatron_args={"expert_tensor_parallel_size": 2}).errors == [
        "--expert-tensor-parallel-size 2 is not supported yet by --train-backend megatron (experts are whole on "
        "their expert-parallel rank); give 1."]
    assert _report(moe_dir, pipeline_model_parallel_size=2).errors == []
    assert _report(moe_dir, context_parallel_size=2).errors == []


# --- the load-balancing loss -------------------------------------------------------------------------------


def hand_aux_loss(router_logits: list, topk: int):
    """Switch-Transformer load balancing of one micro-batch, summed over layers: per layer
    ``E / (k T^2) * sum_i (sum_x p_xi) (sum_x m_xi)``, ``p`` the softmax of the router logits ``[T, E]`` of
    the micro-batch's ``T`` tokens, ``m`` 1 on each token's top-k experts (Fedus et al. 2021, eq. 4, with
    megatron-core's top-k count)."""
    total = 0.0
    for logits in router_logits:
        tokens, experts = logits.shape
        probs = logits.softmax(-1)
        chosen = torch.zeros_like(probs).scatter(1, probs.topk(topk, dim=-1).indices, 1.0)
        total = total + experts / (topk * tokens ** 2) * (probs.sum(0) * chosen.sum(0)).sum()
    return total


def _step_grads(path, coeff: float, steps) -> tuple[dict, dict]:
    """One training step's metrics and the gradients it leaves (before the optimizer) of a backend with
    ``--moe-aux-loss-coeff coeff``."""
    backend = megatron_backend(config=train_config(path, megatron_args={"moe_aux_loss_coeff": [coeff]}))
    asyncio.run(backend.init(backend.config))
    batch = make_batch(AutoTokenizer.from_pretrained(path), steps)
    backend._before_train()
    sums, _ = asyncio.run(backend._train_step(batch, steps[0]))
    return sums, {n: p.grad.clone() for n, p in backend.model.named_parameters()}


def test_the_load_balancing_loss_is_in_the_objective_as_computed_by_hand(moe_dir):
    coeff, steps = 0.05, [[[0, 1], [2, 3]]]
    sums, grads = _step_grads(moe_dir, coeff, steps)
    plain_sums, plain = _step_grads(moe_dir, 0.0, steps)
    assert "moe_aux_loss" not in plain_sums
    hf = hf_of(moe_dir)
    tokens = make_batch(AutoTokenizer.from_pretrained(moe_dir), steps).tokens
    loss = 0.0
    for micro_batch in steps[0]:  # each micro-batch routes its real tokens together; pad positions are left out
        per_sample = [hf(torch.tensor([tokens[i]]), output_router_logits=True).router_logits for i in micro_batch]
        layers = [torch.cat([sample[layer] for sample in per_sample]) for layer in range(2)]
        loss = loss + coeff * hand_aux_loss(layers, topk=2) / len(steps[0])  # mean over the step's micro-batches
    assert sums["moe_aux_loss"] == pytest.approx(float(loss), rel=1e-5)
    loss.backward()
    for layer in range(2):  # the objective's gradient is the same in both runs: the difference is the loss's
        got = grads[f"decoder.layers.{layer}.mlp.router.weight"] - plain[f"decoder.layers.{layer}.mlp.router.weight"]
        torch.testing.assert_close(got, hf.model.layers[layer].mlp.gate.weight.grad, rtol=1e-4, atol=1e-7)


# --- expert parallelism ------------------------------------------------------------------------------------


def _two_ranks_against_one(moe_dir, tmp_path, layout: str, **single_flags) -> list[dict]:
    """Run tests/megatron_moe_ranks.py with ``layout`` on two gloo ranks and one process (``single_flags``) on the
    same micro-batches: log-probs, the load-balancing loss, the step's loss and grad norm and the updated weights
    equal; the two-rank torch_dist checkpoint loads in one process with those weights. Returns both ranks'
    results."""
    from .tiny_model import run_two_ranks

    coeff = 0.05
    out = tmp_path / "out"
    out.mkdir()
    run_two_ranks("megatron_moe_ranks.py", str(moe_dir), str(out), str(coeff), layout)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    steps = [[mb for got in ranks for mb in got["steps"][0]]] if layout == "ep" else ranks[0]["steps"]
    config = train_config(moe_dir, adam_eps=1e-3, megatron_args={"moe_aux_loss_coeff": [coeff]}, **single_flags)
    single = megatron_backend(config=config)
    asyncio.run(single.init(single.config))
    batch = make_batch(AutoTokenizer.from_pretrained(moe_dir), steps)
    old = asyncio.run(single.log_probs(batch))["log_probs"]
    single_routing = dict(single._recorded_routing)
    metrics = asyncio.run(single.train(0, batch))[0]
    weights = dict(asyncio.run(single.named_weights()))
    for got in ranks:
        for i in [i for mb in got["steps"][0] for i in mb] if got["returns_outputs"] else []:
            torch.testing.assert_close(got["log_probs"]["log_probs"][i], old[i], rtol=0, atol=1e-5)
        for key in ("loss", "grad_norm", "moe_aux_loss"):
            assert got["metrics"][key] == pytest.approx(metrics[key], rel=1e-5), key
        assert sorted(got["weights"]) == sorted(weights)
        for name, tensor in weights.items():
            torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=1e-5)
        assert sorted(got["routing"]) == sorted(single_routing)
        for tokens, routing in single_routing.items():
            assert torch.equal(got["routing"][tokens], routing), tokens
    reloaded = megatron_backend(config=config)
    asyncio.run(reloaded.init(reloaded.config))
    asyncio.run(reloaded.load(str(out / "ckpt")))
    for name, tensor in asyncio.run(reloaded.named_weights()):
        assert torch.equal(tensor, ranks[0]["weights"][name]), name
    return ranks


@pytest.mark.timeout(240)
def test_expert_parallel_two_ranks_equal_one(moe_dir, tmp_path):
    """EP=2 over two gloo ranks (two experts each, DP=2, megatron-core's all-to-all dispatcher) equals one process;
    every expert is exported from its rank; the EP=2 checkpoint loads at EP=1."""
    _two_ranks_against_one(moe_dir, tmp_path, "ep")


@pytest.mark.timeout(240)
def test_tensor_parallel_two_ranks_with_sequence_parallel_equal_one(moe_dir, tmp_path):
    """TP=2 with sequence parallelism over two gloo ranks (every expert whole on both, each rank routing its half
    of the positions; the routers' and experts' gradients summed over the two) equals one process, with
    --use-routing-replay: the routing recorded in the old-log-prob pass (each rank's half, gathered) is one
    process's, and replaying it trains alike; the TP=2 checkpoint loads at TP=1."""
    ranks = _two_ranks_against_one(moe_dir, tmp_path, "tp", use_routing_replay=True)
    assert ranks[0]["routing"], "the old-log-prob pass recorded no routing"
    assert ranks[0]["metrics"]["moe_aux_loss"] > 0


@pytest.mark.timeout(240)
def test_pipeline_two_stages_equal_one(moe_dir, tmp_path):
    """PP=2 over two gloo ranks (one MoE layer per stage, megatron-core's pipeline schedule) equals one process, with
    --use-routing-replay: the load-balancing loss of both stages' layers in the objective at the backend's scale and
    in the metric, each stage recording and replaying its layers' routing (the record gathered over the stages);
    the PP=2 checkpoint loads at PP=1."""
    ranks = _two_ranks_against_one(moe_dir, tmp_path, "pp", use_routing_replay=True)
    assert [got["returns_outputs"] for got in ranks] == [False, True]
    assert all(routing.shape[1] == 2 for routing in ranks[0]["routing"].values())  # both layers, from both stages


@pytest.mark.timeout(240)
def test_context_parallel_two_ranks_equal_one(moe_dir, tmp_path):
    """CP=2 over two gloo ranks (each routing its two chunks of every sequence; pad positions out of the
    load-balancing loss through each rank's chunks of the padding mask) equals one process, with
    --use-routing-replay: the routing recorded on both ranks' chunks, gathered, is one process's; the CP=2
    checkpoint loads at CP=1."""
    ranks = _two_ranks_against_one(moe_dir, tmp_path, "cp", use_routing_replay=True)
    assert ranks[0]["routing"] and ranks[0]["routing"].keys() == ranks[1]["routing"].keys()


# --- routing replay ----------------------------------------------------------------------------------------


def forced_routing(hf, rows_per_layer: list, captured: dict) -> None:
    """Make each transformers router of ``hf`` take the experts ``rows_per_layer[l]`` (int64 ``[n, k]``, one row
    per position of the one sequence fed) with its own softmax probabilities of them, renormalised (megatron-core's
    replay with ``norm_topk_prob``); its logits go to ``captured[l]``."""
    for layer, rows in enumerate(rows_per_layer):
        gate = hf.model.layers[layer].mlp.gate

        def forward(hidden, gate=gate, rows=rows, layer=layer):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            chosen = logits.softmax(-1, dtype=torch.float32).gather(1, rows)
            captured[layer] = logits.detach()
            return logits, (chosen / chosen.sum(-1, keepdim=True)).to(logits.dtype), rows

        gate.forward = forward


def test_replayed_routing_is_the_recorded_one_and_rollout_disagreement_is_counted(moe_dir):
    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    steps = [[[0, 1], [2, 3]]]
    backend = megatron_backend(config=train_config(moe_dir, use_routing_replay=True, lr=0.0))
    asyncio.run(backend.init(backend.config))
    batch = make_batch(tokenizer, steps)
    asyncio.run(backend.log_probs(batch))  # the old-log-prob pass: records
    recorded = [backend._recorded_routing[tuple(t)] for t in batch.tokens]
    hf = hf_of(moe_dir)
    for tokens, routing in zip(batch.tokens, recorded):  # the routers' own choice, as transformers makes it
        assert routing.shape == (len(tokens) - 1, 2, 2)
        logits = hf(torch.tensor([tokens]), output_router_logits=True).router_logits
        for layer in range(2):
            own = logits[layer][:-1].topk(2, dim=-1).indices.sort(-1).values
            assert torch.equal(routing[:, layer].sort(-1).values, own)

    generator = torch.Generator().manual_seed(5)
    maps = []
    with torch.no_grad():
        for layer in backend.model.decoder.layers:  # new routers: their own top-k differs from the recorded one
            layer.mlp.router.weight.copy_(torch.randn(layer.mlp.router.weight.shape, generator=generator))
            layer.mlp.router.register_forward_hook(lambda module, args, out: maps.append(out[1].clone()))
    replayed = asyncio.run(backend.log_probs(batch))["log_probs"]
    width = max(len(t) for t in batch.tokens[:2])
    for layer, routing_map in enumerate(maps[:2]):  # micro-batch [0, 1], right-padded: token p * 2 + b
        for b in (0, 1):
            rows = routing_map.view(width, 2, -1)[: len(batch.tokens[b]) - 1, b]
            assert torch.equal(rows.nonzero()[:, 1].view(-1, 2), recorded[b][:, layer].sort(-1).values)

    perturbed = {f"model.layers.{i}.mlp.gate.weight": layer.mlp.router.weight.detach().clone()
                 for i, layer in enumerate(backend.model.decoder.layers)}
    hf.load_state_dict(perturbed, strict=False)
    differing, compared = [0] * 4, [0] * 4
    for i, (tokens, n, routing, lp) in enumerate(zip(batch.tokens, batch.response_lengths, recorded, replayed)):
        captured: dict = {}
        rows = [torch.cat([routing[:, layer], torch.arange(2).unsqueeze(0)]) for layer in range(2)]
        forced_routing(hf, rows, captured)
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, :-1].log_softmax(-1)
        want = logits.gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)[-n:]
        torch.testing.assert_close(lp, want, rtol=0, atol=2e-5)  # transformers with the recorded routing forced
        for layer in range(2):
            own = captured[layer][:-1].topk(2, dim=-1).indices.sort(-1).values
            differing[i] += int((own != routing[:, layer].sort(-1).values).any(-1).sum())
            compared[i] += len(tokens) - 1
    assert 0 < sum(differing) < sum(compared)

    rollout = megatron_backend(config=train_config(moe_dir, use_routing_replay=True, use_rollout_routing_replay=True,
                                                   lr=0.0))
    asyncio.run(rollout.init(rollout.config))
    with torch.no_grad():
        for mine, theirs in zip(rollout.model.decoder.layers, backend.model.decoder.layers):
            mine.mlp.router.weight.copy_(theirs.mlp.router.weight)
    batch.routed_experts = recorded  # as the engine recorded them
    metrics = asyncio.run(rollout.train(0, batch))[0]
    assert metrics["moe_routing_disagreement"] == pytest.approx(sum(differing) / sum(compared), abs=1e-12)
    batch.routed_experts = [recorded[0], None, recorded[2], recorded[3]]  # sample 1: no record from the engine
    metrics = asyncio.run(rollout.train(0, batch))[0]  # micro-batch [0, 1] routes by itself, [2, 3] replays
    assert metrics["moe_routing_disagreement"] == pytest.approx(sum(differing[2:]) / sum(compared[2:]), abs=1e-12)


def test_routing_replay_needs_a_backend_that_replays_and_a_model_with_experts(moe_dir, tiny_model_dir):
    import furlong.builtin_plugins.backends.fsdp as fsdp
    import furlong.builtin_plugins.backends.megatron as megatron
    from furlong.core.config.megatron_support import report_routing_replay

    args = train_args(moe_dir, use_routing_replay=True, use_rollout_routing_replay=True)
    for name, plugin, errors in (("megatron", megatron, []), ("fsdp", fsdp, [
            "--use-rollout-routing-replay needs a train backend that replays mixture-of-experts routing in its "
            "forward passes; --train-backend fsdp does not (use --train-backend megatron with an MoE model, or "
            "remove the flag)."])):
        report = ConfigReport(plugin=name)
        report_routing_replay(args, name, plugin, report)
        assert report.errors == errors
    assert _report(tiny_model_dir, use_routing_replay=True).errors == [
        f"--use-routing-replay replays mixture-of-experts routing, but the model of --hf-checkpoint {tiny_model_dir}/"
        "config.json has no experts; remove it."]


def test_the_rollout_routing_goes_from_the_samples_into_the_train_batch(moe_dir):
    from furlong.core.train.data import to_train_batch
    from furlong.hooks import Sample

    config = train_config(moe_dir, use_routing_replay=True, use_rollout_routing_replay=True)
    routing = [[[1, 3], [0, 2]], [[2, 3], [1, 0]]]
    sample = Sample(index=7, tokens=[5, 6, 7], response_length=1, rollout_routed_experts=routing)
    batch = to_train_batch(config, [sample])
    assert batch.routed_experts[0].dtype == torch.int64 and batch.routed_experts[0].tolist() == routing
    assert to_train_batch(config.replace(use_rollout_routing_replay=False), [sample]).routed_experts is None
    sample.rollout_routed_experts = None  # tokens the engine did not route: the backend routes by itself
    assert to_train_batch(config, [sample]).routed_experts == [None]
    sample.rollout_routed_experts = routing[:1]
    with pytest.raises(PluginError) as excinfo:
        to_train_batch(config, [sample])
    assert str(excinfo.value) == ("--use-rollout-routing-replay: sample 7's rollout_routed_experts has shape (1, 2, 2); "
                                  "it must be [len(tokens) - 1 = 2, num_moe_layers, topk].")


# --------------------------------------------------------------------------- the whole loop


def test_a_grpo_run_replays_the_engines_routing_and_the_trainer_agrees_with_it(moe_dir, arithmetic_jsonl, tmp_path):
    """The embedded engine records each generated token's experts, the megatron trainer replays them, and its
    own routers (float32, like the engine) pick the same experts for every token of every rollout: one optimizer
    step per rollout, so the trainer routes with the weights the engine generated with (synced after rollout 0)."""
    from furlong.core.config.launch_args import launch_config
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection
    from furlong.core.run.loop import run

    pm = get_plugin_manager()
    config = launch_config(
        "--hf-checkpoint", str(moe_dir), "--prompt-data", str(arithmetic_jsonl), "--input-key", "prompt",
        "--label-key", "label", "--rm-type", "deterministic_random", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "5",
        "--num-rollout", "2", "--lr", "1e-2", "--seed", "3", "--train-backend", "megatron",
        "--use-rollout-routing-replay", "--log-dir", str(tmp_path), pm=pm, command="train")
    assert config.use_routing_replay  # implied
    asyncio.run(run(config, pm, resolve_selection(config, pm)))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in rows if "rollout/step" in r]
    assert [r["rollout/step"] for r in rollouts] == [0, 1]
    assert [r["train/moe_routing_disagreement"] for r in rollouts] == [0.0, 0.0]
    assert rollouts[0]["train/grad_norm"] > 0  # rollout 1 was generated with weights that moved
