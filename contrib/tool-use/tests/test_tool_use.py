"""The tool_use generate plugin against the embedded engine serving a scripted real model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from furlong.core.config.launch_args import launch_args, launch_config
from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import ConfigReport, PluginError, Sample, Status



def script(*words: str) -> dict[str, str]:
    """Transitions that make the script model write ``words`` in order (each word once)."""
    return dict(zip(words, words[1:]))


CALCULATOR_THEN_ANSWER = {**script("?", "<calculator>", "6*7", "</calculator>"),
                          **script("</result>", "The", "answer", "is", "42")}


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def flags(**overrides):
    """The launch flags of a ``--generate tool_use`` run (what ``configure`` gets); ``overrides`` by attribute name."""
    return launch_args("--generate", "tool_use", **overrides)


def run_config(**overrides):
    """The frozen configuration of that run (what every other hook gets)."""
    return launch_config("--generate", "tool_use", configure=False, **overrides)


async def generate(pm, engine, max_new_tokens=40, prompt="Q: six times seven ?", **overrides):
    sample = Sample(prompt=prompt, index=0, metadata={"source": "test"})
    return await pm.call_chosen("generate", "tool_use", "--generate", config=run_config(**overrides), sample=sample,
                                sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens, "stop": None},
                                engine=engine, evaluation=False)


def test_calculator_turn_is_masked_and_the_answer_is_graded(pm, script_engine):
    engine = script_engine(CALCULATOR_THEN_ANSWER)
    sample = asyncio.run(generate(pm, engine))
    sample.validate()  # every per-token list has response_length entries
    assert sample.status == Status.COMPLETED
    assert sample.response == "<calculator> 6*7 </calculator><result> 42 </result>The answer is 42"
    model, tool = [1, 1, 1], [0, 0, 0]
    assert sample.loss_mask == model + tool + [1] * 5  # the last turn ends with the end-of-sequence token
    assert sample.tokens[-sample.response_length:][-1] == engine.tokenizer.eos_token_id
    assert [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if not m] == [0.0] * 3
    assert all(-0.05 < lp < 0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m)
    assert sample.weight_versions == ["0", "0"]  # one per engine request
    assert sample.metadata == {"source": "test", "tool_use": {"calls": 1, "errors": 0}}
    scores = asyncio.run(pm.call_chosen("reward", "math", "--rm-type", config=run_config(),
                                        samples=[Sample(response=sample.response, label="42")]))
    assert scores == [1]


def test_the_same_episode_through_furlong_serve(pm, script_engine, served_engine):
    local = asyncio.run(generate(pm, script_engine(CALCULATOR_THEN_ANSWER)))
    served = asyncio.run(generate(pm, served_engine(CALCULATOR_THEN_ANSWER)))
    served.validate()
    assert (served.response, served.status, served.loss_mask) == (local.response, local.status, local.loss_mask)
    assert served.tokens == local.tokens
    assert served.rollout_log_probs == pytest.approx(local.rollout_log_probs, abs=1e-5)
    assert len(served.weight_versions) == 2  # one per request, the server's version string


def test_python_tool_runs_in_the_sandbox(pm, script_engine):
    engine = script_engine({**script("?", "<python>", "print(6*7+1)", "</python>"), **script("</result>", "done")},
                           extra_words=["43"])
    sample = asyncio.run(generate(pm, engine))
    assert sample.response == "<python> print(6*7+1) </python><result> 43 </result>done"
    assert sample.loss_mask == [1, 1, 1, 0, 0, 0, 1, 1]


def test_a_tool_error_is_shown_to_the_model_and_counted(pm, script_engine):
    engine = script_engine({**script("?", "<calculator>", "6/0", "</calculator>"), **script("</result>", "done")},
                           extra_words=["error:", "division", "by", "zero"])
    sample = asyncio.run(generate(pm, engine))
    assert "<result> error: division by zero </result>" in sample.response
    assert sample.metadata["tool_use"] == {"calls": 1, "errors": 1}


def test_turn_limit_and_token_budget_truncate(pm, script_engine):
    loop = {**script("?", "<calculator>", "6*7", "</calculator>"), "</result>": "<calculator>"}  # calls forever
    engine = script_engine(loop)
    limited = asyncio.run(generate(pm, engine, tool_use_max_turns=2))
    assert (limited.status, limited.metadata["tool_use"]["calls"]) == (Status.TRUNCATED, 2)
    assert limited.loss_mask == [1, 1, 1, 0, 0, 0] * 2 + [1, 1, 1]  # the third call is not run
    # 8 response tokens in all: a 3-token call, then the tool output cut after 5 tokens
    short = asyncio.run(generate(pm, engine, max_new_tokens=5))
    assert (short.status, short.response_length, short.loss_mask) == (Status.TRUNCATED, 5, [1, 1, 1, 0, 0])
    short.validate()
    capped = asyncio.run(generate(pm, engine, rollout_max_context_len=5 + 4))  # 5 prompt tokens
    assert (capped.status, capped.response_length) == (Status.TRUNCATED, 4)


def test_abort_hook_stops_an_episode_waiting_for_its_tool(pm, script_engine):
    # the model writes "<python> import time;time.sleep(30) </python>" (two words of code)
    engine = script_engine({**script("?", "<python>", "import", "time;time.sleep(30)", "</python>"),
                            **script("</result>", "done")})

    config = run_config()

    async def run():
        task = asyncio.create_task(generate(pm, engine, tool_use_timeout=60.0))
        import furlong_tool_use
        while not any(e.process is not None for e in furlong_tool_use._live):  # the tool is running
            assert not task.done(), task.result().response
            await asyncio.sleep(0.05)
        process = next(iter(furlong_tool_use._live)).process
        start = time.monotonic()
        await pm.broadcast("abort", config=config, rollout_id=3)  # the broadcast the core makes
        sample = await asyncio.wait_for(task, 5)
        return sample, time.monotonic() - start, process, furlong_tool_use._live

    sample, seconds, process, live = asyncio.run(run())
    assert sample.status == Status.ABORTED and seconds < 2
    assert process.returncode is not None and not live
    assert sample.response == "<python> import time;time.sleep(30) </python>"
    assert sample.loss_mask == [1, 1, 1, 1]  # the call; no tool output
    sample.validate()


def test_configure_refuses_partial_rollout_and_bad_limits(pm):
    report = ConfigReport(plugin="tool_use", flags=("--generate",))
    pm.get_plugin("tool_use").configure(args=flags(partial_rollout=True, tool_use_max_turns=-1, tool_use_timeout=0.0),
                                        report=report)
    assert report.errors == [
        "--tool-use-max-turns must be at least 0, got -1.",
        "--tool-use-timeout must be positive, got 0.",
        "--generate tool_use with --partial-rollout is not supported yet: an aborted episode cannot resume in the "
        "middle of its turns.",
    ]


def test_a_chat_message_prompt_needs_the_chat_template(pm, script_engine):
    engine = script_engine(CALCULATOR_THEN_ANSWER)
    with pytest.raises(PluginError, match="pass --apply-chat-template"):
        asyncio.run(generate(pm, engine, prompt=[{"role": "user", "content": "6*7?"}]))


def test_furlong_train_runs_tool_use_episodes_and_trains_on_the_model_tokens_only(tmp_path, script_model):
    model = script_model(CALCULATOR_THEN_ANSWER, strength=10.0)  # sampled at temperature 1, it keeps to the script
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Q: six times seven ?", "label": "42"}) + "\n" for _ in range(4)))
    done = subprocess.run(
        [sys.executable, "-m", "furlong.core", "train", "--hf-checkpoint", model, "--prompt-data", str(data),
         "--input-key", "prompt", "--label-key", "label", "--rm-type", "math", "--generate", "tool_use",
         "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
         "--rollout-max-response-len", "20", "--rollout-temperature", "1", "--lr", "1e-4",
         "--save", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rollout = next(r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open()) if "rollout/step" in r)
    assert rollout["rollout/raw_reward"] == 1.0  # "The answer is 42" after the calculator's <result>
    assert (rollout["rollout/response_lengths"], rollout["rollout/response_len/mean"]) == (11.0, 8.0)  # 3 tool tokens


def test_tool_use_passes_the_contract_kit():
    import furlong_tool_use
    from furlong.hooks.testing import check_plugin

    report = check_plugin(furlong_tool_use, "tool_use", config=run_config())
    assert report.checked == ["add_arguments", "configure", "generate", "abort"]
