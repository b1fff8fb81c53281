"""Miles' debug flags end to end on the tiny model: saved rollouts train the same step again, one side only,
an early exit, the detail dumps, the weight check and deterministic kernels."""

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file

from furlong.core.config.launch_args import launch_config
from furlong.hooks import PluginError, Sample

pytestmark = pytest.mark.usefixtures("cpu_machine", "one_torch_thread")


def _argv(model, data, out, *extra) -> list[str]:
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
            "--rm-type", "deterministic_random", "--rollout-batch-size", "3", "--n-samples-per-prompt", "4",
            "--num-steps-per-rollout", "2", "--rollout-max-response-len", "6", "--lr", "1e-2", "--seed", "7",
            "--log-dir", str(out), *extra]


def _run(argv: list[str]) -> None:
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection
    from furlong.core.run.loop import run

    pm = get_plugin_manager()
    config = launch_config(*argv, pm=pm)
    asyncio.run(run(config, pm, resolve_selection(config, pm)))


def _rows(folder, key: str) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if key in r]


def _weights(save_dir) -> dict[str, torch.Tensor]:
    files = sorted((save_dir / "iter_0000001").rglob("*.safetensors"))
    assert files, f"no weights under {save_dir}"
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(f).items()}


TRAIN_KEYS = ("train/loss", "train/pg_loss", "train/ppo_kl", "train/grad_norm")


def test_saved_rollouts_train_the_same_steps_without_an_engine(tmp_path, tiny_model_dir, arithmetic_jsonl,
                                                               monkeypatch):
    template = str(tmp_path / "rollouts" / "data_{rollout_id}.pt")
    first, second = tmp_path / "first", tmp_path / "second"
    _run(_argv(tiny_model_dir, arithmetic_jsonl, first, "--num-rollout", "2", "--save", str(first),
               "--save-debug-rollout-data", template))
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["data_0.pt", "data_1.pt"]
    saved = torch.load(tmp_path / "rollouts" / "data_1.pt", weights_only=True)
    assert saved["rollout_id"] == 1 and len(saved["samples"]) == 12
    assert Sample.from_dict(saved["samples"][0]).response_length > 0

    from furlong.core.rollout import engines

    async def no_engine(self, index):
        raise AssertionError("--debug-train-only started an engine")

    monkeypatch.setattr(engines.EngineFactory, "__call__", no_engine)
    _run(_argv(tiny_model_dir, arithmetic_jsonl, second, "--num-rollout", "2", "--save", str(second),
               "--load-debug-rollout-data", template))
    one, two = _rows(first, "train/step"), _rows(second, "train/step")
    assert len(one) == len(two) == 4 and any(abs(r["train/pg_loss"]) > 1e-4 for r in one)
    for a, b in zip(one, two):
        assert [b[k] for k in TRAIN_KEYS] == [a[k] for k in TRAIN_KEYS]
    first_weights, second_weights = _weights(first), _weights(second)
    assert first_weights.keys() == second_weights.keys()
    assert all(torch.equal(first_weights[k], second_weights[k]) for k in first_weights)


def test_a_missing_rollout_file_names_the_flag_and_the_file(tmp_path, tiny_model_dir, arithmetic_jsonl):
    template = str(tmp_path / "none_{rollout_id}.pt")
    with pytest.raises(PluginError, match=r"--load-debug-rollout-data .*none_\{rollout_id\}\.pt: rollout 0's file "
                                          r".*none_0\.pt does not exist"):
        _run(_argv(tiny_model_dir, arithmetic_jsonl, tmp_path / "out", "--num-rollout", "1",
                   "--load-debug-rollout-data", template))


def test_rollout_only_generates_and_saves_but_trains_nothing(tmp_path, tiny_model_dir, arithmetic_jsonl, monkeypatch):
    from furlong.core.train import group

    def no_trainer(*args, **kwargs):
        raise AssertionError("--debug-rollout-only started a trainer")

    monkeypatch.setattr(group.TrainGroup, "__init__", no_trainer)
    template = str(tmp_path / "d" / "{rollout_id}.pt")
    _run(_argv(tiny_model_dir, arithmetic_jsonl, tmp_path / "out", "--num-rollout", "2", "--debug-rollout-only",
               "--save-debug-rollout-data", template, "--save", str(tmp_path / "out"),
               "--eval-prompt-data", "arith", str(arithmetic_jsonl), "--eval-interval", "2",
               "--eval-max-response-len", "2", "--skip-eval-before-train"))
    rollouts = _rows(tmp_path / "out", "rollout/step")
    assert [r["rollout/step"] for r in rollouts] == [0, 1]
    assert all("rollout/raw_reward" in r for r in rollouts)
    assert _rows(tmp_path / "out", "train/step") == []
    assert not list((tmp_path / "out").glob("iter_*"))
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["0.pt", "1.pt", "eval_1.pt"]
    evaluated = torch.load(tmp_path / "d" / "eval_1.pt", weights_only=True)
    assert (evaluated["rollout_id"], len(evaluated["samples"]), evaluated["metadata"]) == (1, 60, {"sets": ["arith"]})


def test_exit_after_rollout_stops_the_loop(tmp_path, tiny_model_dir, arithmetic_jsonl):
    _run(_argv(tiny_model_dir, arithmetic_jsonl, tmp_path, "--num-rollout", "4", "--debug-exit-after-rollout", "2"))
    assert [r["rollout/step"] for r in _rows(tmp_path, "rollout/step")] == [0, 1]


def test_dump_details_writes_rollouts_and_what_each_rank_trained_on(tmp_path, tiny_model_dir, arithmetic_jsonl):
    dump = tmp_path / "dump"
    _run(_argv(tiny_model_dir, arithmetic_jsonl, tmp_path / "out", "--num-rollout", "1", "--dump-details", str(dump)))
    rollout = torch.load(dump / "rollout_data" / "0.pt", weights_only=True)
    trained = torch.load(dump / "train_data" / "0_0.pt", weights_only=True)
    assert (trained["rollout_id"], trained["rank"], sorted(trained["sample_ids"])) == (0, 0, list(range(12)))
    first = rollout["samples"][trained["sample_ids"][0]]
    assert list(trained["tokens"][0]) == first["tokens"]
    assert [len(a) for a in trained["advantages"]] == trained["response_lengths"]
    assert len(trained["steps"]) == 2


def test_weight_check_passes_after_a_real_sync(tmp_path, tiny_model_dir, arithmetic_jsonl, caplog):
    with caplog.at_level("INFO", logger="furlong"):
        _run(_argv(tiny_model_dir, arithmetic_jsonl, tmp_path, "--num-rollout", "1", "--check-weight-update-equal"))
    checked = [r.getMessage() for r in caplog.records if "--check-weight-update-equal" in r.getMessage()]
    assert len(checked) == 2  # the sync before rollout 0 and the one after it
    assert "after weight sync 2 the 1 engine(s) hold the trainer's" in checked[1]


def test_weight_check_names_a_tensor_the_sync_did_not_deliver(tmp_path, tiny_model_dir, arithmetic_jsonl,
                                                              monkeypatch):
    from furlong.builtin_plugins.engines.embedded.engine import EmbeddedEngine

    copy = EmbeddedEngine._copy_weights

    def drops_one(self, named_tensors):
        copy(self, [(n, t) for n, t in named_tensors if n != "model.layers.0.mlp.up_proj.weight"])

    monkeypatch.setattr(EmbeddedEngine, "_copy_weights", drops_one)
    with pytest.raises(PluginError) as caught:
        _run(_argv(tiny_model_dir, arithmetic_jsonl, tmp_path, "--num-rollout", "1", "--check-weight-update-equal"))
    assert str(caught.value) == (
        "--check-weight-update-equal: after weight sync 2, engine 0's tensor 'model.layers.0.mlp.up_proj.weight' "
        f"(float32, shape {tuple(_shape(tiny_model_dir, 'model.layers.0.mlp.up_proj.weight'))}) differs from the "
        "trainer's: the sync did not deliver it.")


def _shape(model_dir, name: str) -> list[int]:
    return list(load_file(next(model_dir.glob("*.safetensors")))[name].shape)


@pytest.fixture
def restores_determinism():
    yield
    torch.use_deterministic_algorithms(False)


def test_deterministic_mode_repeats_a_run_exactly(tmp_path, tiny_model_dir, arithmetic_jsonl, restores_determinism):
    for name in ("a", "b"):
        _run(_argv(tiny_model_dir, arithmetic_jsonl, tmp_path / name, "--num-rollout", "1", "--deterministic-mode"))
        assert torch.are_deterministic_algorithms_enabled()
    a, b = _rows(tmp_path / "a", "train/step"), _rows(tmp_path / "b", "train/step")
    assert [[r[k] for k in TRAIN_KEYS] for r in a] == [[r[k] for k in TRAIN_KEYS] for r in b]


def test_miles_debug_pair_runs_unchanged_from_the_command_line(tmp_path, tiny_model_dir, arithmetic_jsonl,
                                                               run_furlong):
    """Miles' recipe (docs/developer/debug.md): capture rollouts without a trainer, then train on them without
    engines, the flags as a Miles launch script passes them."""
    miles_flags = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(arithmetic_jsonl),
                   "--input-key", "prompt", "--label-key", "label", "--rm-type", "deterministic_random",
                   "--rollout-function-path", "miles.rollout.sglang_rollout.generate_rollout",
                   "--advantage-estimator", "grpo", "--num-rollout", "2", "--rollout-batch-size", "3",
                   "--n-samples-per-prompt", "4", "--global-batch-size", "6", "--rollout-max-response-len", "6",
                   "--rollout-temperature", "1.0", "--optimizer", "adam", "--lr", "1e-2", "--seed", "7"]
    recordings = str(tmp_path / "rollout_{rollout_id}.pt")
    captured = run_furlong("train", *miles_flags, "--debug-rollout-only", "--save-debug-rollout-data", recordings,
                           "--log-dir", "capture", timeout=300)
    assert captured.returncode == 0, captured.stderr[-3000:]
    trained = run_furlong("train", *miles_flags, "--load-debug-rollout-data", recordings, "--log-dir", "train",
                          timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("rollout_*.pt")) == ["rollout_0.pt", "rollout_1.pt"]
    assert _rows(tmp_path / "capture", "train/step") == []
    steps = _rows(tmp_path / "train", "train/step")
    assert [r["train/step"] for r in steps] == [0, 1, 2, 3]
    assert all(isinstance(r["train/loss"], float) for r in steps)
