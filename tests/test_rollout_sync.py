"""The sync rollout, the rollout manager and single_turn generation, with a scripted engine.

The engine is deterministic (tests/scripted_engine.py) so the rollout logic is checked
exactly: waves, filters, abort, partial rollout, the token budget of resumed samples
(never the whole budget again) and group accounting.
"""

import asyncio
import json

import pytest

from furlong.core.config.launch_args import launch_config
from furlong.hooks import FilterResult, PluginError, Sample, Status, hookimpl

from .scripted_engine import ScriptedEngine, boxed_first_operand, rollout_manager


def _data(tmp_path, n=40):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+0=", "label": str(i)}) + "\n" for i in range(n)))
    return path


def _config(tmp_path, *extra):
    return launch_config("--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                         "--prompt-data", str(_data(tmp_path)), "--input-key", "prompt", "--label-key", "label",
                         "--rm-type", "math", "--rollout-max-response-len", "16", *extra, configure=False)


def _alternating(prompt, call):
    """Right on odd calls, wrong on even ones: groups of 2 get different rewards."""
    answer = prompt.split("+")[0] if call % 2 else "x"
    return "\\boxed{" + answer + "}", "stop"


def test_hook_rollout_sync_returns_scored_groups_in_order(tmp_path, plugin_manager):
    config = _config(tmp_path)
    manager = rollout_manager(config, plugin_manager, ScriptedEngine(boxed_first_operand))
    groups = asyncio.run(manager.generate(0))
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]]
    assert all(s.reward == 1 and s.status == Status.COMPLETED for g in groups for s in g)
    assert groups[0][0].response == "\\boxed{0}" and groups[0][0].rollout_log_probs == [-0.5] * 9


def test_hook_generate_single_turn_resumed_sample_gets_remaining_budget(tmp_path, plugin_manager):
    """Only the budget left: max 100 tokens, 60 generated -> the continuation asks for 40."""
    config = _config(tmp_path, "--rollout-max-response-len", "100")
    engine = ScriptedEngine(lambda p, c: ("y" * 70, "stop"))
    prompt_ids = engine.tokenizer("7+0=")["input_ids"]
    sample = Sample(prompt="7+0=", tokens=prompt_ids + [ord("a")] * 60, response="a" * 60, response_length=60,
                    rollout_log_probs=[-1.0] * 60, status=Status.ABORTED, index=0)
    out = asyncio.run(plugin_manager.call_chosen("generate", "single_turn", "--generate", config=config, sample=sample,
                                                 sampling_params={"max_new_tokens": 100}, engine=engine,
                                                 evaluation=False))
    assert engine.requests[0]["max_new_tokens"] == 40
    assert out.response_length == 100 and out.status == Status.TRUNCATED
    assert len(out.rollout_log_probs) == 100 and len(out.tokens) == len(prompt_ids) + 100
    out.validate()


def test_single_turn_full_sample_is_truncated_without_a_request(tmp_path, plugin_manager):
    config = _config(tmp_path, "--rollout-max-response-len", "100")
    engine = ScriptedEngine(lambda p, c: ("y", "stop"))
    sample = Sample(prompt="7+0=", tokens=[1] * 104, response="a" * 100, response_length=100, status=Status.ABORTED)
    out = asyncio.run(plugin_manager.call_chosen("generate", "single_turn", "--generate", config=config, sample=sample,
                                                 sampling_params={"max_new_tokens": 100}, engine=engine,
                                                 evaluation=False))
    assert engine.requests == [] and out.status == Status.TRUNCATED and out.response_length == 100


@pytest.mark.parametrize("extra, expected", [([], None), (["--rollout-max-context-len", "20"], 16)])
def test_single_turn_without_response_len_leaves_the_budget_to_the_engine_or_the_context(tmp_path, plugin_manager,
                                                                                          extra, expected):
    """No --rollout-max-response-len: max_new_tokens stays None (the engine's default) unless a context cap
    leaves room for 20 - 4 prompt tokens."""
    config = _config(tmp_path, *extra)
    engine = ScriptedEngine(lambda p, c: ("y", "stop"))
    sample = Sample(prompt="7+0=", index=0)
    asyncio.run(plugin_manager.call_chosen("generate", "single_turn", "--generate", config=config, sample=sample,
                                           sampling_params={"max_new_tokens": None}, engine=engine, evaluation=False))
    assert engine.requests[0]["max_new_tokens"] == expected


def test_single_turn_rejects_message_lists_without_chat_template(tmp_path, plugin_manager):
    config = _config(tmp_path)
    sample = Sample(prompt=[{"role": "user", "content": "hi"}], index=3)
    with pytest.raises(PluginError) as excinfo:
        asyncio.run(plugin_manager.call_chosen("generate", "single_turn", "--generate", config=config, sample=sample,
                                               sampling_params={"max_new_tokens": 4}, engine=ScriptedEngine(boxed_first_operand),
                                               evaluation=False))
    assert str(excinfo.value) == (
        "sample 3: the prompt is a list of chat messages; single_turn generation needs a string. Pass "
        "--apply-chat-template to render message lists with the tokenizer's chat template.")


def test_reject_all_filter_errors_after_max_waves_instead_of_hanging(tmp_path, plugin_manager, register_plugin):
    class RejectAll:
        @hookimpl
        def filter(self, samples):
            return FilterResult(keep=False, reason="never")

    register_plugin(RejectAll(), "reject_all")
    config = _config(tmp_path, "--dynamic-sampling-filter", "reject_all", "--max-sampling-waves", "3",
                 "--over-sampling-batch-size", "2", "--log-dir", str(tmp_path / "logs"))
    manager = rollout_manager(config, plugin_manager, ScriptedEngine(boxed_first_operand))
    with pytest.raises(PluginError) as excinfo:
        asyncio.run(asyncio.wait_for(manager.generate(0), timeout=30))
    message = str(excinfo.value)
    assert "dynamic sampling gave up after 3 waves (--max-sampling-waves 3): 0 of 2 groups kept." in message
    assert "Filters: reject_all. Groups dropped per reason: never: 6." in message
    assert f"The rollout's samples are in {tmp_path / 'logs' / 'failed_rollout_0.jsonl'}." in message


def test_dapo_filter_keeps_exactly_the_batch_and_counts_drops(tmp_path, plugin_manager):
    # Groups whose two answers differ survive; all-correct groups are dropped as zero_std_1.0.
    config = _config(tmp_path, "--dynamic-sampling-filter", "check_reward_nonzero_std", "--over-sampling-batch-size", "4")
    calls = {"n": 0}

    def answer(prompt, call):
        i = int(prompt.split("+")[0])
        return "\\boxed{" + (str(i) if i % 2 == 0 or call % 2 else "x") + "}", "stop"

    manager = rollout_manager(config, plugin_manager, ScriptedEngine(answer))
    groups = asyncio.run(manager.generate(0))
    assert len(groups) == 2
    for g in groups:
        assert len({s.reward for s in g}) == 2
    metrics = manager.rollout_metrics[0]
    assert metrics["rollout/dynamic_filter/drop_zero_std_1.0"] >= 1
    counters = manager.cursor.counters
    assert counters["drawn"] == counters["trained"] + counters["filtered"] + counters["surplus"] \
        + counters["aborted_dropped"] + manager.cursor.buffer_len()


def test_abort_with_partial_rollout_buffers_leftovers_and_resumes_them(tmp_path, plugin_manager):
    config = _config(tmp_path, "--over-sampling-batch-size", "4", "--partial-rollout", "--rollout-max-response-len", "12")

    def answer(prompt, call):
        i = int(prompt.split("+")[0])
        return ("\\boxed{" + str(i) + "}" if i < 2 else "\\boxed{" + str(i) + "}..."), "stop"

    engine = ScriptedEngine(answer, delay=0.002)
    manager = rollout_manager(config, plugin_manager, engine)
    # Prompts 2 and 3 take longer: rollout 0 keeps prompts 0 and 1 and aborts the rest.
    groups = asyncio.run(manager.generate(0))
    assert [g[0].prompt for g in groups] == ["0+0=", "1+0="]
    assert engine.abort_calls == 1
    buffered = manager.cursor.buffer
    assert [g[0].prompt for g in buffered] == ["2+0=", "3+0="]
    trained_ids = {s.index for g in groups for s in g}
    assert all(s.index not in trained_ids for g in buffered for s in g)
    partial = [s for g in buffered for s in g if s.status == Status.ABORTED and s.response_length > 0]
    assert partial and all(s.metadata["start_rollout_id"] == 0 for s in partial)
    engine.reset_abort()
    before = {s.index: s.response_length for g in buffered for s in g}
    groups = asyncio.run(manager.generate(1))
    assert [g[0].prompt for g in groups] == ["2+0=", "3+0="]
    for g in groups:
        for s in g:
            assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.response_length <= 12
            assert s.response_length >= before[s.index]
            s.validate()
    counters = manager.cursor.counters
    assert counters["drawn"] == counters["trained"] + counters["filtered"] + counters["surplus"] \
        + counters["aborted_dropped"] + manager.cursor.buffer_len()


def test_failing_reward_dumps_the_rollout_and_names_plugin_and_sample(tmp_path, plugin_manager, register_plugin):
    class Broken:
        @hookimpl
        def reward(self, samples):
            raise ValueError("grader exploded")

    register_plugin(Broken(), "broken_rm")
    config = _config(tmp_path, "--rm-type", "broken_rm", "--log-dir", str(tmp_path / "logs"))
    manager = rollout_manager(config, plugin_manager, ScriptedEngine(boxed_first_operand))
    with pytest.raises(PluginError) as excinfo:
        asyncio.run(manager.generate(0))
    dump = tmp_path / "logs" / "failed_rollout_0.jsonl"
    assert "reward plugin 'broken_rm' (registered in-process) failed on sample" in str(excinfo.value)
    assert "ValueError: grader exploded" in str(excinfo.value)
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(rows) == 4 and rows[0]["prompt"] == "0+0="
