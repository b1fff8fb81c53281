"""megatron-core's distributed optimizer behind the megatron backend (``--optimizer-cpu-offload``,
``--use-precision-aware-optimizer``): what can be checked without a GPU. megatron-core allocates its
buffers on CUDA, so the training steps themselves are checked by ``benchmarks/megatron_distopt_gpu.py``
on a GPU (docs/megatron.md)."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")

from transformers import AutoTokenizer  # noqa: E402

from furlong.builtin_plugins.backends.megatron import configure  # noqa: E402
from furlong.builtin_plugins.backends.megatron import train_backend as megatron_backend  # noqa: E402
from furlong.builtin_plugins.backends.megatron.mcore_optimizer import (PRECISION_AWARE_WITHOUT_TE, ddp_config,  # noqa: E402
                                                                       optimizer_config)
from furlong.builtin_plugins.backends.megatron.model import init_parallel  # noqa: E402
from furlong.hooks import ConfigReport, PluginError  # noqa: E402
from furlong.hooks.config_report import Machine  # noqa: E402

from .tiny_model import make_batch, train_args, train_config  # noqa: E402

MILES_TRIO = dict(use_distributed_optimizer=True, optimizer_cpu_offload=True, overlap_cpu_optimizer_d2h_h2d=True,
                  use_precision_aware_optimizer=True)
H200 = Machine(cuda=True, gpu_name="NVIDIA H200", gpu_count=1, gpu_total_bytes=140 * 2**30,
               gpu_free_bytes=139 * 2**30)


@pytest.fixture(scope="module", autouse=True)
def one_rank_groups():
    init_parallel(1, torch.device("cpu"))


def test_the_launch_flags_become_megatron_core_s_optimizer_config(tiny_model_dir):
    config = train_config(tiny_model_dir, lr=3e-4, min_lr=1e-5, weight_decay=0.05, adam_beta1=0.8, adam_beta2=0.95,
                          adam_eps=1e-6, clip_grad=0.5, optimizer_offload_fraction=0.25, pin_cpu_grads=False,
                          **MILES_TRIO)
    built = optimizer_config(config, bf16=True)
    assert (built.optimizer, built.lr, built.min_lr, built.weight_decay) == ("adam", 3e-4, 1e-5, 0.05)
    assert (built.adam_beta1, built.adam_beta2, built.adam_eps, built.clip_grad) == (0.8, 0.95, 1e-6, 0.5)
    assert built.bf16 and built.params_dtype == torch.bfloat16 and built.use_distributed_optimizer
    assert built.optimizer_cpu_offload and built.overlap_cpu_optimizer_d2h_h2d
    assert built.optimizer_offload_fraction == 0.25 and built.pin_cpu_grads is False and built.pin_cpu_params is True
    # megatron-core 0.16 reads Transformer Engine's version whenever the option is on (it is not installed here)
    assert not built.use_precision_aware_optimizer
    plain = optimizer_config(train_config(tiny_model_dir, use_distributed_optimizer=True, optimizer_cpu_offload=True),
                             bf16=False)
    assert plain.optimizer_offload_fraction == 1.0 and plain.params_dtype == torch.float32 and not plain.bf16
    wrapper = ddp_config()
    assert wrapper.grad_reduce_in_fp32 and wrapper.use_distributed_optimizer
    assert not wrapper.overlap_grad_reduce and not wrapper.overlap_param_gather


def _configured(tiny_model_dir, machine=H200, **flags) -> ConfigReport:
    report = ConfigReport(plugin="megatron", machine=machine)
    configure(args=train_args(tiny_model_dir, **flags), report=report)
    return report


def test_miles_offload_flags_are_accepted_where_a_gpu_trains(tiny_model_dir):
    report = _configured(tiny_model_dir, optimizer_offload_fraction=0.5, **MILES_TRIO)
    assert report.errors == [] and report.warnings == [PRECISION_AWARE_WITHOUT_TE]
    assert "transformer_engine is not installed here" in PRECISION_AWARE_WITHOUT_TE
    import furlong.builtin_plugins.backends.megatron as plugin
    from furlong.core.config.megatron_support import report_megatron_flags

    given = ["--use-distributed-optimizer", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
             "--use-precision-aware-optimizer", "--optimizer-offload-fraction", "--no-pin-cpu-params"]
    args = train_args(tiny_model_dir, megatron_flags_given=given,
                      megatron_args={"optimizer_offload_fraction": 0.5, "pin_cpu_params": False}, **MILES_TRIO)
    core = ConfigReport(plugin="megatron")
    report_megatron_flags(args, "megatron", plugin, core)
    assert core.warnings == [] and core.errors == []  # the backend reads every one of them


@pytest.mark.parametrize("flags, message", [
    (dict(MILES_TRIO, machine=Machine()),
     "--optimizer-cpu-offload / --use-precision-aware-optimizer need a CUDA GPU: megatron-core's distributed "
     "optimizer keeps its buffers on the GPU, and this machine has none. Use --use-distributed-optimizer alone here "
     "(the backend's own sharded AdamW)."),
    (dict(optimizer_cpu_offload=True, optimizer="sgd"),
     "--optimizer sgd: --optimizer-cpu-offload supports adam (AdamW) only here."),
    (dict(MILES_TRIO, megatron_args={"optimizer_offload_fraction": 1.5}),
     "--optimizer-offload-fraction must be in [0, 1] (the share of the AdamW state kept on the host), got 1.5."),
    (dict(MILES_TRIO, lora_rank=4, lora_alpha=8, target_modules="all-linear"),
     "--optimizer-cpu-offload / --use-precision-aware-optimizer with --lora-rank is not supported yet by "
     "--train-backend megatron."),
    (dict(MILES_TRIO, reset_optimizer_states=True),
     "--optimizer-cpu-offload / --use-precision-aware-optimizer with --reset-optimizer-states is not supported yet "
     "by --train-backend megatron."),
])
def test_what_stops_megatron_core_s_optimizer_is_one_error_naming_the_flags(tiny_model_dir, flags, message):
    pytest.importorskip("peft") if "lora_rank" in flags else None
    machine = flags.pop("machine", H200)
    report = _configured(tiny_model_dir, machine=machine, **flags)
    assert message in report.errors
    if "optimizer sgd" in message:  # the one problem: the rest follows from Adam
        assert [e for e in report.errors if "--optimizer-cpu-offload" in e] == [message]
    assert PRECISION_AWARE_WITHOUT_TE not in report.warnings  # beside a refusal it would only distract


@pytest.mark.parametrize("given", [["--optimizer-cpu-offload"], ["--use-precision-aware-optimizer"],
                                   ["--optimizer-cpu-offload", "--use-precision-aware-optimizer",
                                    "--overlap-cpu-optimizer-d2h-h2d"]])
def test_miles_offload_flags_alone_turn_on_the_distributed_optimizer_as_in_miles(given, capsys):
    """Miles' megatron backend runs the distributed optimizer for Adam whatever the flags
    (``set_default_megatron_args``), so its scripts (run_kimi_k2.py, run_glm5_744b_a40b.py...) give the offload
    options without ``--use-distributed-optimizer``: the backend turns it on, listed under ``plugin_defaults``."""
    from furlong.core.cli.commands import main

    argv = ["train", "--hf-checkpoint", "examples/demo/model", "--prompt-data", "p.jsonl", "--num-rollout", "1",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
            "--train-backend", "megatron", "--executor", "ray", *given, "--print-config"]
    assert main(argv) == 0, capsys.readouterr().err
    data = json.loads(capsys.readouterr().out)
    assert data["args"]["use_distributed_optimizer"] is True
    assert data["plugin_defaults"]["use_distributed_optimizer"] == {"plugin": "megatron", "value": True}
    assert main([*argv[:-1], "--optimizer", "sgd", "--print-config"]) == 2  # Miles: only Adam gets it
    assert "--optimizer sgd: " in capsys.readouterr().err


def test_an_error_about_the_distributed_optimizer_names_the_flags_that_turned_it_on(tmp_path):
    """Miles' Qwen3-30B-A3B scripts: --optimizer-cpu-offload --use-precision-aware-optimizer with EP 8."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                   vocab_size=64).save_pretrained(tmp_path)
    flags = dict(optimizer_cpu_offload=True, use_precision_aware_optimizer=True, executor="ray",
                 expert_model_parallel_size=8, actor_num_gpus_per_node=8)
    report = _configured(tmp_path, **flags)
    assert ("--optimizer-cpu-offload / --use-precision-aware-optimizer (megatron-core's distributed optimizer, which "
            "Miles turns on with Adam) with --expert-model-parallel-size 8 is not supported yet by --train-backend "
            "megatron (its AdamW shards assume every data-parallel rank holds the same parameters); leave one of them "
            "out.") in report.errors


def test_a_ray_run_leaves_the_gpu_check_to_its_training_ranks(tiny_model_dir):
    assert _configured(tiny_model_dir, machine=Machine(), executor="ray", **MILES_TRIO).errors == []


def test_offload_refinements_without_the_offload_are_a_warning(tiny_model_dir):
    report = _configured(tiny_model_dir, use_distributed_optimizer=True, overlap_cpu_optimizer_d2h_h2d=True,
                         megatron_args={"optimizer_offload_fraction": 0.5})
    assert report.warnings == ["--overlap-cpu-optimizer-d2h-h2d, --optimizer-offload-fraction change nothing without "
                               "--optimizer-cpu-offload."] and report.errors == []
    out_of_range = _configured(tiny_model_dir, use_distributed_optimizer=True,
                               megatron_args={"optimizer_offload_fraction": -1.0})
    assert (out_of_range.warnings, out_of_range.errors) == ([], [  # one message, the error
        "--optimizer-offload-fraction must be in [0, 1] (the share of the AdamW state kept on the host), got -1."])


def test_the_backend_without_cuda_refuses_before_building_anything(tiny_model_dir):
    backend = megatron_backend(config=train_config(tiny_model_dir, **MILES_TRIO))
    with pytest.raises(PluginError, match="need a CUDA GPU: megatron-core.s distributed optimizer"):
        asyncio.run(backend.init(backend.config))


def test_a_checkpoint_of_the_other_optimizer_loads_its_weights_only_with_no_load_optim(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    first = megatron_backend(config=train_config(tiny_model_dir))
    asyncio.run(first.init(first.config))
    asyncio.run(first.train(0, make_batch(tokenizer, [[[0, 1]], [[2, 3]]])))
    saved = tmp_path / "iter_0000000"
    asyncio.run(first.save(str(saved)))
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["optimizer_format"] == "adamw"
    meta["optimizer_format"] = "megatron-core"  # as a run with --optimizer-cpu-offload writes it
    (saved / "meta.json").write_text(json.dumps(meta))
    second = megatron_backend(config=train_config(tiny_model_dir))
    asyncio.run(second.init(second.config))
    with pytest.raises(PluginError, match=r"holds the optimizer state of megatron-core's distributed optimizer "
                                          r"\(--optimizer-cpu-offload / --use-precision-aware-optimizer\), this run "
                                          r"uses the backend's AdamW .* pass --no-load-optim to load its weights only"):
        asyncio.run(second.load(str(saved)))
    weights_only = megatron_backend(config=train_config(tiny_model_dir, no_load_optim=True))
    asyncio.run(weights_only.init(weights_only.config))
    asyncio.run(weights_only.load(str(saved)))
    for (name, a), (_, b) in zip(first.model.named_parameters(), weights_only.model.named_parameters()):
        assert torch.equal(a, b), name
    del meta["optimizer_format"]  # a checkpoint written before the key existed is the backend's AdamW
    (saved / "meta.json").write_text(json.dumps(meta))
    third = megatron_backend(config=train_config(tiny_model_dir))
    asyncio.run(third.init(third.config))
    asyncio.run(third.load(str(saved)))
    assert third.global_step == 2


def test_finetune_loads_the_weights_only_and_starts_the_step_at_zero(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    first = megatron_backend(config=train_config(tiny_model_dir))
    asyncio.run(first.init(first.config))
    for rollout in range(2):
        asyncio.run(first.train(rollout, make_batch(tokenizer, [[[0, 1]], [[2, 3]]])))
    saved = tmp_path / "iter_0000001"
    asyncio.run(first.save(str(saved)))
    second = megatron_backend(config=train_config(tiny_model_dir, finetune=True))
    asyncio.run(second.init(second.config))
    fresh_schedule = second.scheduler.state_dict()
    rng_before = torch.get_rng_state()
    asyncio.run(second.load(str(saved)))
    assert first.global_step == 4 and second.global_step == 0
    assert not any(second.optimizer.state.values()) and second.scheduler.state_dict() == fresh_schedule
    assert torch.equal(torch.get_rng_state(), rng_before)
    for (name, a), (_, b) in zip(first.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(a, b), name


def test_offload_moves_only_what_is_not_on_the_host_yet():
    """--optimizer-cpu-offload keeps part of the AdamW state on the host for its CPU optimizer: offloading moves the
    rest (here to the ``meta`` device, standing for the host) and records where each tensor came from, and leaves
    that part where it is, so that onloading cannot carry the CPU optimizer's state to the GPU (megatron-core's own
    restore does). (Parameters move by ``.data``, which torch allows between CUDA and CPU only: GPU runs check it.)"""
    from furlong.builtin_plugins.backends.megatron.mcore_optimizer import (offload_optimizer_state,
                                                                           onload_optimizer_state)

    first, second = (torch.nn.Parameter(torch.ones(n, device="meta")) for n in (3, 2))
    optimizer = torch.optim.AdamW([first, second])
    device_state = {"exp_avg": torch.full((3,), 0.5), "step": torch.tensor(4.0)}
    host_state = {"exp_avg": torch.zeros(2, device="meta"), "step": torch.tensor(4.0, device="meta")}
    optimizer.state[first], optimizer.state[second] = device_state, host_state
    before = dict(host_state)

    moved = offload_optimizer_state(optimizer, host="meta")

    assert sorted((key, str(device)) for holder, key, device in moved if holder is device_state) == [
        ("exp_avg", "cpu"), ("step", "cpu")]
    assert len(moved) == 2  # nothing of the host-resident part, no parameter (both already there)
    assert all(v.device.type == "meta" for v in device_state.values())
    assert all(host_state[k] is before[k] for k in before)
    assert offload_optimizer_state(None) == [] and onload_optimizer_state([]) is None


def test_a_fresh_torch_adamw_gets_the_state_a_checkpoint_load_overwrites():
    """Without Transformer Engine, megatron-core's DistributedOptimizer builds its loading template from the torch
    AdamW's per-parameter ``step``, which a fresh optimizer lacks: :func:`state_for_loading` gives it megatron-core's
    moments and step 0, the template loads the saved state, and the next step is the one the saved run takes."""
    from furlong.builtin_plugins.backends.megatron.mcore_optimizer import state_for_loading

    torch.manual_seed(0)
    start = torch.randn(4, 3)
    saved_param = torch.nn.Parameter(start.clone())
    saved = torch.optim.AdamW([saved_param], lr=0.1)
    for _ in range(3):
        saved_param.grad = torch.randn(4, 3)
        saved.step()
    fresh_param = torch.nn.Parameter(saved_param.detach().clone())
    fresh = torch.optim.AdamW([fresh_param], lr=0.1)
    moments = []

    def init_state_fn(optimizer, config):  # megatron-core's for torch Adam: zero moments, no step
        moments.append(config)
        for p in optimizer.param_groups[0]["params"]:
            optimizer.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

    state_for_loading(fresh, init_state_fn, "config")

    assert moments == ["config"]
    assert {s["step"].item() for s in fresh.state_dict()["state"].values()} == {0.0}
    fresh.load_state_dict(copy.deepcopy(saved.state_dict()))  # a checkpoint: no tensor shared with `saved`
    grad = torch.randn(4, 3)
    for param, optimizer in ((saved_param, saved), (fresh_param, fresh)):
        param.grad = grad.clone()
        optimizer.step()
    assert torch.equal(saved_param, fresh_param)
    state_for_loading(fresh, init_state_fn, "config")  # has state: left alone
    assert moments == ["config"] and fresh.state[fresh_param]["step"].item() == 4.0
    assert state_for_loading(None, init_state_fn, "config") is None


def test_an_offloading_optimizer_s_host_copies_take_the_loaded_masters():
    """megatron-core's hybrid (CPU offload) optimizer refreshes its inner parameters from the loaded ``master_param``
    through a map of non-float32 parameters only; with float32 masters that raised KeyError. The replacement
    refreshes the host copy of an offloaded parameter and the float32 copy of a bfloat16 one, and leaves a parameter
    that is its own master alone."""
    from types import SimpleNamespace

    from furlong.builtin_plugins.backends.megatron.mcore_optimizer import masters_follow_loaded_state

    offloaded, low, own = torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16), torch.zeros(4)
    host_copy, fp32_copy = torch.zeros(3), torch.zeros(2)
    hybrid = SimpleNamespace(param_update_in_fp32=True, param_to_fp32_param={low: fp32_copy},
                             gpu_params_map_cpu_copy={offloaded: host_copy},
                             state={offloaded: {"master_param": torch.full((3,), 1.5)},
                                    low: {"master_param": torch.full((2,), -2.0)},
                                    own: {"master_param": own, "exp_avg": torch.ones(4)}})

    masters_follow_loaded_state(hybrid)
    hybrid._update_fp32_params_by_new_state()

    assert torch.equal(host_copy, torch.full((3,), 1.5)) and torch.equal(fp32_copy, torch.full((2,), -2.0))
    assert torch.equal(own, torch.zeros(4)) and torch.equal(offloaded, torch.zeros(3))
    hybrid.param_update_in_fp32, host_copy[:] = False, 0.0
    hybrid._update_fp32_params_by_new_state()
    assert torch.equal(host_copy, torch.zeros(3))


@pytest.mark.parametrize("given, cuda, moe, mcore, reason", [
    ({"use_distributed_optimizer": True}, True, False, True, None),
    ({"use_distributed_optimizer": True}, False, False, False, "needs a CUDA GPU"),
    ({"use_distributed_optimizer": True, "lora_rank": 4}, True, False, False, "with LoRA"),
    ({"use_distributed_optimizer": True, "reset_optimizer_states": True}, True, False, False,
     "--reset-optimizer-states"),
    ({"use_distributed_optimizer": True}, True, True, False, "with experts"),
    ({}, True, False, False, None),
    ({"use_distributed_optimizer": True, "optimizer_cpu_offload": True}, True, False, True, None),
])
def test_use_distributed_optimizer_is_megatron_core_s_where_it_can_run(tiny_model_dir, given, cuda, moe, mcore, reason):
    """As in Megatron-LM, --use-distributed-optimizer is megatron-core's DistributedOptimizer on a CUDA rank; without a
    GPU, with LoRA, --reset-optimizer-states or experts it stays the backend's own sharded AdamW, and says why."""
    from furlong.builtin_plugins.backends.megatron.mcore_optimizer import chooses_mcore_optimizer, own_adamw_reason

    config = train_config(tiny_model_dir, train_backend="megatron", **given)
    assert chooses_mcore_optimizer(config, own_adamw_reason(config, cuda, moe)) is mcore
    if reason is None:
        assert own_adamw_reason(config, cuda, moe) is None
    else:
        assert reason in own_adamw_reason(config, cuda, moe)


def test_the_ppo_critic_keeps_the_backend_s_own_adamw_with_use_distributed_optimizer(tiny_model_dir):
    """The megatron critic (a value head on the policy's GPTModel) is not run through megatron-core's optimizer for
    --use-distributed-optimizer even on a CUDA rank; the actor is."""
    from types import SimpleNamespace

    from furlong.builtin_plugins.backends.megatron.backend import MegatronBackend
    from furlong.builtin_plugins.backends.megatron.critic import MegatronCritic
    from furlong.builtin_plugins.backends.megatron.mcore_optimizer import chooses_mcore_optimizer

    config = train_config(tiny_model_dir, train_backend="megatron", use_distributed_optimizer=True)
    on_a_gpu = {"device": torch.device("cuda"), "shape": SimpleNamespace(is_moe=False)}
    actor, critic = MegatronBackend.__new__(MegatronBackend), MegatronCritic.__new__(MegatronCritic)
    for backend in (actor, critic):
        vars(backend).update(on_a_gpu)
    assert chooses_mcore_optimizer(config, actor._own_adamw_reason(config))
    assert critic._own_adamw_reason(config) == (
        "megatron-core's distributed optimizer for the PPO critic is not supported yet")
    assert not chooses_mcore_optimizer(config, critic._own_adamw_reason(config))
