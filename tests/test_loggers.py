"""The TensorBoard and W&B logger plugins, driven through the real plugin manager and read back.

TensorBoard event files are read with tensorboard's ``EventAccumulator``; W&B offline runs are
read from the run's ``.wandb`` file (a LevelDB-style log of ``wandb.proto`` ``Record``
messages), so every test checks what a user would find on disk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import sys
import time
from pathlib import Path

import pytest

from furlong.builtin_plugins.loggers._common import is_last_event, rollout_axis_step, scalars
from furlong.builtin_plugins.loggers.wandb_logger import init_kwargs
from furlong.core.config.launch_args import launch_config
from furlong.hooks import PluginError

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import build_tiny_model  # noqa: E402

BASE = ["--hf-checkpoint", "model", "--prompt-data", "train.jsonl", "--num-rollout", "2",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "2"]  # S = 2*2/2 = 2


@pytest.fixture(autouse=True)
def no_tensorboard_dir_variable(monkeypatch):
    """TENSORBOARD_DIR would move the event folder of every test: cleared unless a test sets it."""
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)


def _config(pm, *extra):
    return launch_config(*BASE, *extra, pm=pm, configure=False)


def _notify(pm, hook, **kwargs):
    asyncio.run(pm.notify(hook, **kwargs))


def _run_events(pm, config, with_eval):
    """The observer calls of a 2-rollout run with S = 2 steps per rollout, in loop order.

    Values: rollout r has raw_reward 0.25 + 0.5 r, rollout_time 1.5 + r; step t has loss 0.1 t;
    eval at r has eval/test 0.125 + 0.25 r (evaluations at 0 before training, then after each rollout).
    """
    if with_eval:
        _notify(pm, "on_eval_end", config=config, rollout_id=0, metrics={"eval/test": 0.125, "perf/eval_time": 2.0})
    for r in range(2):
        for s in range(2):
            step = r * 2 + s
            _notify(pm, "on_train_step_end", config=config, rollout_id=r, step=step,
                    metrics={"train/loss": 0.1 * step, "train/grad_norm": 1.0})
        _notify(pm, "on_rollout_end", config=config, rollout_id=r,
                metrics={"rollout/raw_reward": 0.25 + 0.5 * r, "perf/rollout_time": 1.5 + r,
                         "train/loss": 0.1 * (2 * r + 1), "rollout/entropy": None, "rollout/nan": math.nan})
        if with_eval:
            _notify(pm, "on_eval_end", config=config, rollout_id=r,
                    metrics={"eval/test": 0.125 + 0.25 * r, "perf/eval_time": 2.0})


# --- shared helpers -------------------------------------------------------------------------


def test_scalars_keeps_finite_numbers_and_drops_skipped_prefixes():
    import numpy as np
    import torch

    metrics = {"a": 1, "b": None, "c": float("nan"), "d": float("inf"), "e": "text", "f": [1.0],
               "g": np.float32(0.5), "h": torch.tensor(2.0), "i": True, "train/x": 3.0}
    assert scalars(metrics, ("train/",)) == {"a": 1.0, "g": 0.5, "h": 2.0, "i": 1.0}


@pytest.mark.parametrize("hook, rollout_id, seen, with_eval, last", [
    ("on_rollout_end", 1, False, False, True),    # final rollout (num_rollout 2), no eval follows
    ("on_rollout_end", 1, False, True, False),    # final rollout, the final eval comes next
    ("on_rollout_end", 0, False, False, False),
    ("on_eval_end", 0, False, True, False),       # the eval before training
    ("on_eval_end", 1, True, True, True),         # the eval after the final rollout
    ("on_eval_end", 0, True, True, False),        # the eval fleet's evaluation of rollout 0, ending after rollout 1
    ("on_train_step_end", 3, True, True, False),  # never the last event
])
def test_is_last_event(plugin_manager, hook, rollout_id, seen, with_eval, last):
    extra = ["--eval-interval", "1", "--eval-prompt-data", "test", "test.jsonl"] if with_eval else []
    assert is_last_event(hook, _config(plugin_manager, *extra), rollout_id, seen) is last


def test_is_last_event_of_an_eval_only_run(plugin_manager):
    config = launch_config("--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--num-rollout", "0",
                           "--rollout-batch-size", "2", "--eval-interval", "1", "--eval-prompt-data", "test",
                           "test.jsonl", pm=plugin_manager, configure=False)
    assert is_last_event("on_eval_end", config, 0, False) is True


def test_rollout_axis_step_uses_train_steps_when_asked(plugin_manager):
    config = _config(plugin_manager)
    assert rollout_axis_step(config, 3, False) == 3
    assert rollout_axis_step(config, 3, True) == 6  # 3 * S, S = rollout_batch_size * n / gbs = 2 * 2 / 2


# --- TensorBoard ----------------------------------------------------------------------------


def _read_tb(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _event_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("events.out.tfevents.*"))


def test_hook_on_rollout_end_tensorboard_writes_every_metric_at_its_step(tmp_path, plugin_manager):
    config = _config(plugin_manager, "--use-tensorboard", "--save", str(tmp_path / "run"),
                 "--eval-interval", "1", "--eval-prompt-data", "test", "test.jsonl")
    _run_events(plugin_manager, config, with_eval=True)
    folder = tmp_path / "run" / "tensorboard"
    assert _read_tb(folder) == {
        "rollout/raw_reward": [(0, 0.25), (1, 0.75)],
        "perf/rollout_time": [(0, 1.5), (1, 2.5)],
        # train/ values come from on_train_step_end only, at train/step = r * 2 + s
        "train/loss": [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.3)],
        "train/grad_norm": [(0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0)],
        "eval/test": [(0, 0.125), (0, 0.125), (1, 0.375)],
        "perf/eval_time": [(0, 2.0), (0, 2.0), (1, 2.0)],
    }
    # one writer for the whole run: closed after the final eval, not after the final rollout
    assert len(_event_files(folder)) == 1


def test_hook_on_train_step_end_tensorboard_after_close_opens_a_new_file(tmp_path, plugin_manager):
    config = _config(plugin_manager, "--use-tensorboard", "--tensorboard-dir", str(tmp_path / "tb"),
                 "--tb-experiment-name", "exp1")
    _run_events(plugin_manager, config, with_eval=False)
    folder = tmp_path / "tb" / "exp1"
    assert len(_event_files(folder)) == 1  # closed at on_rollout_end of rollout 1 (no eval follows)
    _notify(plugin_manager, "on_train_step_end", config=config, rollout_id=1, step=4, metrics={"train/loss": 0.5})
    assert len(_event_files(folder)) == 2
    assert _read_tb(folder)["train/loss"] == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.3), (4, 0.5)]


@pytest.mark.parametrize("flags, env, expected", [
    (["--tensorboard-dir", "tb", "--tb-project-name", "proj", "--save", "run"], "envdir", "tb"),
    (["--tb-project-name", "proj", "--save", "run"], "envdir", "proj"),
    (["--save", "run"], "envdir", "envdir"),
    (["--save", "run", "--log-dir", "logs"], None, "run/tensorboard"),
    (["--log-dir", "logs", "--tb-experiment-name", "exp"], None, "logs/tensorboard/exp"),
])
def test_tensorboard_folder_precedence(plugin_manager, monkeypatch, flags, env, expected):
    from furlong.builtin_plugins.loggers.tensorboard import log_dir

    if env:
        monkeypatch.setenv("TENSORBOARD_DIR", env)
    assert log_dir(_config(plugin_manager, *flags)) == expected


def test_hook_on_eval_end_tensorboard_does_nothing_unless_enabled(tmp_path, plugin_manager):
    config = _config(plugin_manager, "--save", str(tmp_path / "run"), "--tensorboard-dir", str(tmp_path / "tb"))
    _run_events(plugin_manager, config, with_eval=True)
    assert not (tmp_path / "tb").exists() and not (tmp_path / "run").exists()


def test_tensorboard_without_a_folder_warns_with_the_flags_to_pass(plugin_manager, caplog):
    config = _config(plugin_manager, "--use-tensorboard")
    with caplog.at_level(logging.WARNING, logger="furlong"):
        _notify(plugin_manager, "on_rollout_end", config=config, rollout_id=0, metrics={"rollout/raw_reward": 1.0})
    assert [r.getMessage() for r in caplog.records] == [
        "plugin 'tensorboard' failed in `on_rollout_end`: PluginError: --use-tensorboard: no folder to write "
        "events to. Pass --tensorboard-dir DIR (or set TENSORBOARD_DIR), or --save / --log-dir DIR (events then "
        "go to DIR/tensorboard)."
    ]


def test_tensorboard_missing_package_is_a_plugin_error_naming_the_install(tmp_path, plugin_manager, monkeypatch,
                                                                           caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    config = _config(plugin_manager, "--use-tensorboard", "--log-dir", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="furlong"):
        _notify(plugin_manager, "on_eval_end", config=config, rollout_id=0, metrics={"eval/test": 1.0})
    assert [r.getMessage() for r in caplog.records] == [
        "plugin 'tensorboard' failed in `on_eval_end`: PluginError: --use-tensorboard needs the tensorboard "
        "package (ModuleNotFoundError: import of torch.utils.tensorboard halted; None in sys.modules). "
        'Install it with: pip install tensorboard (or pip install "furlong[tensorboard]").'
    ]


# --- W&B (offline) --------------------------------------------------------------------------


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """W&B's own settings, cache and data folders in tmp_path; no console banner."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)


def _read_wandb_run(wandb_dir: Path) -> dict:
    """``{"name", "group", "project", "history", "exit"}`` of the one offline run under ``wandb_dir``."""
    [path] = list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + 30
    records = _wandb_records(path.read_bytes())
    # run.finish() may return before W&B's writer process has written the file out
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.1)
        records = _wandb_records(path.read_bytes())
    out = {"history": [], "exit": None}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.update(name=record.run.display_name, group=record.run.run_group, project=record.run.project)
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            out["history"].append({k: v for k, v in row.items() if not k.startswith("_")})
        elif kind == "exit":
            out["exit"] = record.exit.exit_code
    return out


def _wandb_records(data: bytes) -> list:
    """The complete ``wandb.proto`` ``Record`` messages of a ``.wandb`` file's bytes.

    The file: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of
    chunks ``crc32c (4) | length (2, little-endian) | type (1) | data``; type 1 is a whole
    record, 2/3/4 the first/middle/last piece of one; a block tail under 7 bytes is padding.
    A chunk not yet written out completely ends the scan.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    if len(data) < 7:
        return []
    assert data[:4] == b":W&B"
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0 or pos + 7 + length > len(data):
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_hook_on_rollout_end_wandb_offline_logs_rows_with_their_step_keys(tmp_path, plugin_manager, wandb_home):
    config = _config(plugin_manager, "--use-wandb", "--wandb-mode", "offline", "--wandb-dir", str(tmp_path / "wb"),
                 "--wandb-project", "proj", "--wandb-group", "grpo-demo", "--disable-wandb-random-suffix")
    _run_events(plugin_manager, config, with_eval=False)
    run = _read_wandb_run(tmp_path / "wb")
    assert (run["project"], run["group"], run["name"], run["exit"]) == ("proj", "grpo-demo", "grpo-demo", 0)
    assert run["history"] == [
        {"train/loss": 0.0, "train/grad_norm": 1.0, "train/step": 0},
        {"train/loss": 0.1, "train/grad_norm": 1.0, "train/step": 1},
        {"rollout/raw_reward": 0.25, "perf/rollout_time": 1.5, "rollout/step": 0},
        {"train/loss": 0.2, "train/grad_norm": 1.0, "train/step": 2},
        {"train/loss": pytest.approx(0.3), "train/grad_norm": 1.0, "train/step": 3},
        {"rollout/raw_reward": 0.75, "perf/rollout_time": 2.5, "rollout/step": 1},
    ]


def test_hook_on_eval_end_wandb_always_use_train_step(tmp_path, plugin_manager, wandb_home):
    config = _config(plugin_manager, "--use-wandb", "--wandb-mode", "offline", "--save", str(tmp_path / "run"),
                 "--wandb-always-use-train-step", "--eval-interval", "1", "--eval-prompt-data", "test", "t.jsonl")
    _run_events(plugin_manager, config, with_eval=True)
    run = _read_wandb_run(tmp_path / "run")  # --wandb-dir defaults to --save
    assert run["exit"] == 0 and run["project"] == "furlong"
    # rollout and eval rows at rollout_id * S, S = 2
    assert [(r.get("rollout/step"), r.get("eval/step")) for r in run["history"] if "train/step" not in r] == [
        (0, 0), (0, None), (0, 0), (2, None), (2, 2)]


def test_hook_on_train_step_end_wandb_does_nothing_unless_enabled(tmp_path, plugin_manager, wandb_home):
    config = _config(plugin_manager, "--wandb-mode", "offline", "--wandb-dir", str(tmp_path / "wb"))
    _run_events(plugin_manager, config, with_eval=False)
    assert not (tmp_path / "wb").exists()


def test_wandb_group_gets_a_random_suffix_unless_disabled(plugin_manager):
    kwargs = init_kwargs(_config(plugin_manager, "--wandb-group", "exp"))
    assert re.fullmatch(r"exp-[0-9a-f]{6}", kwargs["name"]) and kwargs["group"] == kwargs["name"]
    logged = init_kwargs(_config(plugin_manager, "--wandb-key", "secret", "--sglang-api-key", "X2"))["config"]
    assert "wandb_key" not in logged and logged["sglang_passthrough"] == {"api_key": "***"}


def test_wandb_bad_mode_names_the_flag(plugin_manager):
    with pytest.raises(PluginError) as excinfo:
        init_kwargs(_config(plugin_manager, "--wandb-mode", "offlne"))
    assert str(excinfo.value) == "--wandb-mode 'offlne': not a W&B mode. Choose one of: online, offline, disabled."


def test_wandb_missing_package_is_a_plugin_error_at_the_first_call(tmp_path, plugin_manager, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if wandb were not installed
    config = _config(plugin_manager, "--use-wandb", "--wandb-mode", "offline", "--wandb-dir", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="furlong"):
        _notify(plugin_manager, "on_train_step_end", config=config, rollout_id=0, step=0, metrics={"train/loss": 1.0})
    assert [r.getMessage() for r in caplog.records] == [
        "plugin 'wandb' failed in `on_train_step_end`: PluginError: --use-wandb needs the wandb package "
        "(ModuleNotFoundError: import of wandb halted; None in sys.modules). Install it with: pip install wandb "
        '(or pip install "furlong[wandb]"), or drop --use-wandb.'
    ]


# --- a real run ------------------------------------------------------------------------------


def test_furlong_train_use_tensorboard_matches_metrics_jsonl(tmp_path, run_furlong):
    build_tiny_model(tmp_path / "model")
    rows = [{"prompt": f"{i} + 1 = ", "label": str(i + 1)} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    done = run_furlong(
        "train", "--hf-checkpoint", "model", "--prompt-data", "train.jsonl", "--input-key", "prompt",
        "--label-key", "label", "--rm-type", "math", "--num-rollout", "2", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--global-batch-size", "2", "--rollout-max-response-len", "4",
        "--eval-interval", "1", "--eval-prompt-data", "test", "test.jsonl", "--eval-max-response-len", "4",
        "--log-dir", "run", "--use-tensorboard", env={"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    events = _read_tb(tmp_path / "run" / "tensorboard")
    assert len(_event_files(tmp_path / "run" / "tensorboard")) == 1
    for tag, step_key in (("rollout/raw_reward", "rollout/step"), ("perf/rollout_time", "rollout/step"),
                          ("train/loss", "train/step"), ("eval/test", "eval/step")):
        expected = [(r[step_key], round(r[tag], 6)) for r in logged if step_key in r and r.get(tag) is not None]
        assert [(s, pytest.approx(v, abs=1e-6)) for s, v in events[tag]] == expected, tag
    assert [s for s, _ in events["train/loss"]] == [0, 1, 2, 3]  # S = 2 * 2 / 2 = 2 steps per rollout
