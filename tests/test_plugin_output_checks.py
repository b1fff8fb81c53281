"""The core checks what a generate or reward plugin returns where it enters, and blames that plugin.

Each case runs a real rollout (the rollout manager, a scripted engine, the chosen
plugins) and compares the whole message. The checks live in ``furlong.hooks.contract``,
so the contract test kit (tests/test_contract_kit.py) applies the very same rules.
"""

import asyncio
import json

import pytest

from furlong.core.config.launch_args import launch_config
from furlong.hooks import PluginError, Status, hookimpl

from .scripted_engine import ScriptedEngine, boxed_first_operand, rollout_manager


def _args(tmp_path, *extra):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+0=", "label": str(i)}) + "\n" for i in range(8)))
    return launch_config("--num-rollout", "1", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
                         "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
                         "--rollout-max-response-len", "16", "--log-dir", str(tmp_path / "logs"), *extra,
                         configure=False)


def _rollout_error(args, pm) -> str:
    manager = rollout_manager(args, pm, ScriptedEngine(boxed_first_operand))
    with pytest.raises(PluginError) as excinfo:
        asyncio.run(manager.generate(0))
    message = str(excinfo.value)
    assert message.startswith("rollout 0 failed: ")
    return message.removeprefix("rollout 0 failed: ").split("\n  The rollout's samples are in ")[0]


class _Generate:
    """A two-turn generate plugin whose per-token lists go wrong as ``mistake`` says."""

    def __init__(self, mistake):
        self.mistake = mistake

    @hookimpl
    async def generate(self, sample, sampling_params, engine):
        prompt = engine.tokenizer(sample.prompt)["input_ids"]
        first = await engine.generate(prompt, sampling_params)
        tool = engine.tokenizer(" [tool: 42] ")["input_ids"]
        second = await engine.generate(prompt + first.output_ids + tool, sampling_params)
        response = first.output_ids + tool + second.output_ids
        sample.tokens = prompt + response
        sample.response_length = len(response)
        sample.loss_mask = [1] * len(first.output_ids) + [0] * len(tool) + [1] * len(second.output_ids)
        # right: 0.0 for the tool's tokens, which the model did not generate
        sample.rollout_log_probs = first.output_log_probs + [0.0] * len(tool) + second.output_log_probs
        sample.status = Status.COMPLETED
        if self.mistake == "log_probs_of_generated_tokens_only":
            sample.rollout_log_probs = first.output_log_probs + second.output_log_probs
        elif self.mistake == "mask_without_the_tool_tokens":
            sample.loss_mask = [1] * (len(first.output_ids) + len(second.output_ids))
        elif self.mistake == "status_left_pending":
            sample.status = Status.PENDING
        elif self.mistake == "nan_log_prob":
            sample.rollout_log_probs[0] = float("nan")
        return sample


@pytest.mark.parametrize(("mistake", "expected"), [
    ("log_probs_of_generated_tokens_only",
     "generate plugin 'two_turn' (registered in-process) returned sample 0 whose per-token fields disagree: "
     "len(rollout_log_probs)=18 != response_length=30; loss_mask and rollout_log_probs hold one entry per response "
     "token (the last response_length ids of tokens)."),
    ("mask_without_the_tool_tokens",
     "generate plugin 'two_turn' (registered in-process) returned sample 0 whose per-token fields disagree: "
     "len(loss_mask)=18 != response_length=30; loss_mask and rollout_log_probs hold one entry per response "
     "token (the last response_length ids of tokens)."),
    ("status_left_pending",
     "generate plugin 'two_turn' (registered in-process) returned sample 0 with status pending; set sample.status "
     "to completed, truncated, aborted or failed."),
    ("nan_log_prob",
     "generate plugin 'two_turn' (registered in-process) returned sample 0 with rollout_log_probs[0] = nan; a "
     "rollout log-prob is a finite float <= 0 (use 0.0 for tokens the model did not generate)."),
])
def test_a_generate_result_whose_lists_disagree_is_blamed_on_the_plugin(tmp_path, plugin_manager, register_plugin,
                                                                        mistake, expected):
    register_plugin(_Generate(mistake), "two_turn")
    args = _args(tmp_path, "--generate", "two_turn", "--rm-type", "math")
    assert _rollout_error(args, plugin_manager) == expected


def test_a_consistent_two_turn_result_trains(tmp_path, plugin_manager, register_plugin):
    register_plugin(_Generate(None), "two_turn")
    args = _args(tmp_path, "--generate", "two_turn", "--rm-type", "math")
    groups = asyncio.run(rollout_manager(args, plugin_manager, ScriptedEngine(boxed_first_operand)).generate(0))
    assert [s.response_length for s in groups[0]] == [30, 30]


class _Reward:
    def __init__(self, returns):
        self.returns = returns

    @hookimpl
    def reward(self, samples):
        return self.returns(samples)


@pytest.mark.parametrize(("returns", "expected"), [
    (lambda samples: 1.0,
     "reward plugin 'careless' (registered in-process) returned float 1.0 for 2 sample(s) (first sample index 0); "
     "`reward` returns a list with one reward per sample, e.g. [1.0]."),
    (lambda samples: "1.0",
     "reward plugin 'careless' (registered in-process) returned str '1.0' for 2 sample(s) (first sample index 0); "
     "`reward` returns a list with one reward per sample, e.g. [1.0]."),
    (lambda samples: [1.0],
     "reward plugin 'careless' (registered in-process) returned 1 rewards for 2 samples (first sample index 0); "
     "return one per sample."),
    (lambda samples: ["good", "bad"],
     "reward plugin 'careless' (registered in-process) returned 'good' for sample 0; a reward must be a number, "
     "None, or a dict whose --reward-key entry is the training scalar."),
])
def test_a_reward_of_the_wrong_shape_is_blamed_on_the_plugin(tmp_path, plugin_manager, register_plugin, returns,
                                                             expected):
    register_plugin(_Reward(returns), "careless")
    args = _args(tmp_path, "--rm-type", "careless", "--group-rm")
    assert _rollout_error(args, plugin_manager) == expected


@pytest.mark.parametrize(("flags", "returns", "expected"), [
    ([], {"acc": 1.0},
     "reward plugin 'dicts' (registered in-process), sample 0: the reward is a dict with keys ['acc']; pass "
     "--reward-key naming the scalar to train on (the evaluation reads it too, unless --eval-reward-key names "
     "another)."),
    (["--reward-key", "score"], {"acc": 1.0},
     "reward plugin 'dicts' (registered in-process), sample 0: --reward-key 'score' is not in the reward dict "
     "(keys: ['acc'])."),
    (["--reward-key", "acc"], {"acc": "yes"},
     "reward plugin 'dicts' (registered in-process), sample 0: --reward-key 'acc': the reward dict holds 'yes' "
     "there, not a number."),
])
def test_a_dict_reward_the_flags_cannot_read_is_blamed_on_the_plugin_when_it_returns(tmp_path, plugin_manager,
                                                                                    register_plugin, flags, returns,
                                                                                    expected):
    """Told where the plugin's return enters (naming it), not later by the metrics as "sample 0: ..." alone."""
    register_plugin(_Reward(lambda samples: [dict(returns) for _ in samples]), "dicts")
    args = _args(tmp_path, "--rm-type", "dicts", *flags)
    assert _rollout_error(args, plugin_manager) == expected


def test_a_dict_reward_with_its_key_trains(tmp_path, plugin_manager, register_plugin):
    register_plugin(_Reward(lambda samples: [{"acc": 1.0, "len": 3} for _ in samples]), "dicts")
    args = _args(tmp_path, "--rm-type", "dicts", "--reward-key", "acc")
    groups = asyncio.run(rollout_manager(args, plugin_manager, ScriptedEngine(boxed_first_operand)).generate(0))
    assert [s.reward for s in groups[0]] == [{"acc": 1.0, "len": 3}] * 2


def test_through_the_cli_it_is_one_message_and_exit_2(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """A Miles-style generate function whose loss_mask is one token short, run by ``furlong train``."""
    import sys

    from furlong.core.cli.commands import main

    (tmp_path / "short_mask_gen.py").write_text(
        "def generate(args, sample, sampling_params):\n"
        "    sample.tokens, sample.response, sample.response_length = [5, 6, 7, 8], 'ab', 2\n"
        "    sample.loss_mask, sample.rollout_log_probs, sample.status = [1], [-0.1, -0.2], 'completed'\n"
        "    return sample\n")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--input-key", "prompt",
                 "--label-key", "label", "--rm-type", "math", "--num-rollout", "1", "--rollout-batch-size", "1",
                 "--n-samples-per-prompt", "2", "--global-batch-size", "2", "--rollout-max-response-len", "4",
                 "--custom-generate-function-path", "short_mask_gen.generate"])
    err = capsys.readouterr().err
    sys.modules.pop("short_mask_gen", None)
    assert code == 2 and "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: rollout 0 failed: generate plugin 'short_mask_gen.generate' (from --custom-generate-function-path) "
        "returned sample 0 whose per-token fields disagree: len(loss_mask)=1 != response_length=2; loss_mask and "
        "rollout_log_probs hold one entry per response token (the last response_length ids of tokens).",
        f"error:   The rollout's samples are in {tmp_path / 'failed_rollout_0.jsonl'}."]
