"""Miles' multi-turn tool flags (generate ``multi_turn``): a real tool episode through the embedded
engine, through ``furlong serve`` over HTTP with the sglang engine plugin as the client, and the
flag errors.

The model and its episode: tests/tool_episode.py (a real scripted Llama that calls ``get_year``
once, reads the result and answers).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from furlong.core.config import ConfigError
from furlong.core.config.launch_args import launch_config
from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import PluginError, Sample, Status

sys.path.insert(0, str(Path(__file__).parent))
from serve_helpers import running_server  # noqa: E402
from tool_episode import PROMPT, TOOLS_MODULE, build_tool_model, expected  # noqa: E402

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    (folder / "mt_tools.py").write_text(TOOLS_MODULE)
    sys.path.insert(0, str(folder))
    path = build_tool_model(folder / "model")
    yield path
    sys.path.remove(str(folder))


def tool_flags(*extra: str) -> list[str]:
    return ["--generate", "multi_turn", "--generate-tool-specs-path", "mt_tools.TOOLS", "--generate-tool-call-parser",
            "qwen25", "--generate-execute-tool-function-path", "mt_tools.execute", *extra]


async def episode(engine, config, max_new_tokens=64):
    sample = Sample(prompt=PROMPT, index=0, metadata={"source": "test"})
    return await get_plugin_manager().call_chosen(
        "generate", "multi_turn", "--generate", config=config, sample=sample,
        sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens}, engine=engine, evaluation=False)


def embedded_engine(model_dir):
    config = launch_config("--hf-checkpoint", str(model_dir), "--seed", "0", configure=False)
    return asyncio.run(get_plugin_manager().call_chosen("rollout_engine", "embedded", "--rollout-backend",
                                                        config=config, engine_index=0))


def test_a_two_turn_tool_episode_through_the_embedded_engine(model_dir):
    import mt_tools

    engine = embedded_engine(model_dir)
    config = launch_config("--hf-checkpoint", str(model_dir), *tool_flags())
    mt_tools.CALLS.clear()
    sample = asyncio.run(episode(engine, config))
    sample.validate()
    prompt, call, tool, answer = expected(engine.tokenizer)
    assert sample.tokens == prompt + call + tool + answer
    assert sample.response_length == len(call + tool + answer)
    assert sample.loss_mask == [1] * len(call) + [0] * len(tool) + [1] * len(answer)
    model_lps = [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m]
    assert [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if not m] == [0.0] * len(tool)
    assert all(-0.05 < lp < 0 for lp in model_lps)
    assert mt_tools.CALLS == [("get_year", {})]
    assert sample.status == Status.COMPLETED
    assert sample.weight_versions == ["0", "0"]  # one per engine request
    assert sample.metadata == {"source": "test", "round_number": 2, "tool_call_count": 1, "tool_calls_dropped": 0}
    assert '<tool_response> {"year": 2026} </tool_response>' in sample.response


def test_max_turns_and_the_budget_end_the_episode(model_dir):
    engine = embedded_engine(model_dir)
    prompt, call, tool, answer = expected(engine.tokenizer)
    one = asyncio.run(episode(engine, launch_config("--hf-checkpoint", str(model_dir),
                                                    *tool_flags("--generate-max-turns", "1"))))
    # as in Miles, the last allowed turn's tools still run; the model does not get another turn
    assert one.tokens == prompt + call + tool and one.loss_mask == [1] * len(call) + [0] * len(tool)
    assert one.status == Status.COMPLETED and one.metadata["round_number"] == 1
    budget = len(call) + 3  # the tool turn is cut to fit the budget
    cut = asyncio.run(episode(engine, launch_config("--hf-checkpoint", str(model_dir), *tool_flags()),
                              max_new_tokens=budget))
    assert cut.tokens == prompt + call + tool[:3] and cut.status == Status.TRUNCATED
    assert cut.response_length == budget


def test_the_same_episode_through_furlong_serve_and_the_sglang_engine_plugin(model_dir, tmp_path):
    """The sglang engine plugin talks to ``furlong serve`` over SGLang's HTTP API, as it would to SGLang."""
    from furlong.builtin_plugins.engines import sglang

    local = asyncio.run(episode(embedded_engine(model_dir), launch_config("--hf-checkpoint", str(model_dir),
                                                                          *tool_flags())))
    with running_server(model_dir, log_dir=tmp_path) as server:
        host, port = server.url.removeprefix("http://").split(":")
        config = launch_config("--hf-checkpoint", str(model_dir), "--rollout-backend", "sglang", "--executor", "local",
                               "--rollout-external", "--rollout-external-engine-addrs", f"{host}:{port}",
                               "--sglang-router-ip", host, "--sglang-router-port", port, *tool_flags())

        async def served():
            engine = await sglang.rollout_engine(config=config, engine_index=0)
            try:
                return await episode(engine, config)
            finally:
                await engine.shutdown()

        remote = asyncio.run(served())
    remote.validate()
    assert remote.tokens == local.tokens and remote.loss_mask == local.loss_mask
    assert remote.response == local.response and remote.status == local.status == Status.COMPLETED
    assert remote.rollout_log_probs == pytest.approx(local.rollout_log_probs, abs=1e-5)
    assert len(remote.weight_versions) == 2


def test_miles_generate_path_chooses_multi_turn(model_dir):
    config = launch_config("--hf-checkpoint", str(model_dir), "--custom-generate-function-path",
                           "miles.rollout.generate_hub.multi_turn.generate", *tool_flags()[2:])
    assert config.generate_tool_call_parser == "qwen25"


def _errors(*argv):
    with pytest.raises(ConfigError) as info:
        launch_config(*argv)
    return info.value.problems


def test_flag_errors_are_one_clear_line_each(model_dir):
    base = ["--hf-checkpoint", str(model_dir)]
    assert _errors(*base, *tool_flags()[:-1], "mt_nowhere.execute") == [
        "--generate-execute-tool-function-path 'mt_nowhere.execute': cannot import module 'mt_nowhere': "
        "ModuleNotFoundError: No module named 'mt_nowhere' (not installed, not on PYTHONPATH and not in the working "
        f"directory {Path.cwd()}: run furlong from the folder holding it, or set PYTHONPATH to that folder)"]
    flags = tool_flags()
    flags[flags.index("qwen25")] = "qwen9"
    assert _errors(*base, *flags) == [
        "--generate-tool-call-parser qwen9: unknown tool-call parser; the parsers furlong has: qwen25, qwen, hermes, "
        "llama3, mistral, qwen3_coder."]
    flags = tool_flags()
    flags[flags.index("mt_tools.TOOLS")] = "mt_tools.NOT_A_LIST"
    assert _errors(*base, *flags) == [
        '--generate-tool-specs-path mt_tools.NOT_A_LIST: expected a list of tool specs, each {"type": "function", '
        '"function": {"name": ..., "parameters": {...}}}; got int.']
    assert _errors(*base, "--generate", "multi_turn") == [
        "--generate-tool-call-parser is needed: name the tool-call format of the model (qwen25, qwen, hermes, llama3, "
        "mistral, qwen3_coder).",
        "--generate-tool-specs-path is needed: a dotted path to the list of tool specs (OpenAI form), or a .json file "
        "holding it.",
        "--generate-execute-tool-function-path is needed: module.function, called as function(name, arguments) for "
        "each tool call, returning the result as a string."]


def test_tool_flags_with_another_generate_are_an_error(model_dir):
    assert _errors("--hf-checkpoint", str(model_dir), "--generate-tool-call-parser", "qwen25") == [
        "--generate-tool-call-parser is read by generate 'multi_turn' (Miles: --custom-generate-function-path "
        "miles.rollout.generate_hub.multi_turn.generate), and this run's generate is 'single_turn' (--generate): "
        "choose --generate multi_turn or leave --generate-tool-call-parser out."]


def test_a_tool_function_that_returns_no_string_is_named(model_dir, tmp_path):
    (tmp_path / "mt_bad_tools.py").write_text("def execute(name, params):\n    return 7\n")
    sys.path.insert(0, str(tmp_path))
    try:
        flags = tool_flags()
        flags[-1] = "mt_bad_tools.execute"
        config = launch_config("--hf-checkpoint", str(model_dir), *flags)
        with pytest.raises(PluginError, match="^--generate-execute-tool-function-path mt_bad_tools.execute returned "
                                              "int for tool 'get_year'; it must return the result as a string.$"):
            asyncio.run(episode(embedded_engine(model_dir), config))
    finally:
        sys.path.remove(str(tmp_path))


def test_tool_specs_from_a_json_file_equal_the_module_s(model_dir, tmp_path):
    import json

    import mt_tools
    from furlong.builtin_plugins.generate.multi_turn import load_tool_specs

    path = tmp_path / "tools.json"
    path.write_text(json.dumps(mt_tools.TOOLS))
    assert load_tool_specs(str(path)) == load_tool_specs("mt_tools.TOOLS") == tuple(mt_tools.TOOLS)
    with pytest.raises(PluginError, match=r"^--generate-tool-specs-path .*missing\.json: cannot read the tool specs: "):
        load_tool_specs(str(tmp_path / "missing.json"))


@pytest.mark.usefixtures("cpu_machine")
def test_a_miles_launch_with_the_tool_flags_trains_on_masked_episodes(tmp_path, run_furlong):
    """``furlong train`` as a user runs it: Miles' generate path and the four flags, the tools in the working folder."""
    import json

    import torch

    model_dir = build_tool_model(tmp_path / "sampled", strength=8.0)  # the script wins at temperature 1 too
    (tmp_path / "my_tools.py").write_text(TOOLS_MODULE)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": PROMPT, "label": "2026"}) + "\n" for _ in range(2)))
    done = run_furlong(
        "train", "--hf-checkpoint", str(model_dir), "--prompt-data", str(data), "--input-key", "prompt",
        "--label-key", "label", "--rm-type", "deterministic_random", "--num-rollout", "1", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--rollout-max-response-len", "32",
        "--lr", "1e-3", "--log-dir", str(tmp_path / "log"),
        "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt"),
        "--custom-generate-function-path", "miles.rollout.generate_hub.multi_turn.generate",
        "--generate-tool-specs-path", "my_tools.TOOLS", "--generate-execute-tool-function-path", "my_tools.execute",
        "--generate-tool-call-parser", "qwen25", "--generate-max-turns", "4", "--log-multi-turn",
        env={"OMP_NUM_THREADS": "1"}, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    from transformers import AutoTokenizer

    prompt, call, tool, answer = expected(AutoTokenizer.from_pretrained(model_dir))
    samples = torch.load(tmp_path / "rollout_0.pt", weights_only=True)["samples"]
    assert len(samples) == 4
    for sample in samples:
        assert sample["tokens"] == prompt + call + tool + answer
        assert sample["loss_mask"] == [1] * len(call) + [0] * len(tool) + [1] * len(answer)
        assert sample["metadata"]["round_number"] == 2 and sample["metadata"]["tool_call_count"] == 1
    rows = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    turns = [r["multi_turn/multi_turn_metric/round_number_mean"] for r in rows
             if "multi_turn/multi_turn_metric/round_number_mean" in r]
    assert turns == [2.0]
    assert any("train/loss" in r for r in rows)


def test_an_abort_during_a_tool_call_ends_the_episode_before_the_next_turn(model_dir):
    engine = embedded_engine(model_dir)
    flags = tool_flags()
    flags[-1] = "mt_tools.abort_while_running"
    sample = asyncio.run(episode(engine, launch_config("--hf-checkpoint", str(model_dir), *flags)))
    prompt, call, tool, _ = expected(engine.tokenizer)
    assert sample.tokens == prompt + call + tool and sample.status == Status.ABORTED
    assert sample.metadata["round_number"] == 1
