"""The contract test kit (``furlong.hooks.testing``): every built-in passes it, broken plugins fail it by name."""

from __future__ import annotations

import types

import pytest
import torch

from furlong.core.config.launch_args import launch_config
from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import AdvantageOutput, FilterResult, LossOutput, Status, hookimpl
from furlong.hooks.testing import ContractViolation, NoConfigGiven, TinyEngine, check_plugin

from .configs import training_dataset
from .test_rewards_remote_rm import server  # noqa: F401 - the reward server fixture, for remote_rm

# what the kit exercises of each built-in, and what it leaves to integration tests
EXERCISED = {
    "check_reward_nonzero_std": ["filter"], "no_aborted": ["filter"], "pop_first": ["buffer_pop"],
    "single_turn": ["generate"], "multi_turn": ["configure", "generate", "abort"], "jsonl": ["data_source"], "parquet": ["data_source"], "hf_datasets": ["data_source"],
    "policy_loss": ["configure", "loss"], "sft_loss": ["loss"], "sft": ["configure"], "value_loss": ["loss"],
    "dr_grpo": ["configure", "loss_reducer"], "embedded": ["add_arguments", "configure"], "fsdp": ["configure"],
    "local": ["configure", "executor_fit"], "fully_async": ["configure"],
    "megatron": ["configure"], "sglang": ["add_arguments", "configure"],
    "ray": ["add_arguments", "configure", "executor_fit"], "sync": ["configure"],
    "tensorboard": ["add_arguments", "on_eval_end", "on_rollout_end", "on_train_step_end"],
    "wandb": ["on_eval_end", "on_rollout_end", "on_train_step_end"],
    "mlflow": ["on_eval_end", "on_rollout_end", "on_train_step_end"],
    "prometheus": ["on_eval_end", "on_rollout_end", "on_train_step_end"],
    **{name: ["configure", "advantage"] for name in ("grpo", "gspo", "ppo", "reinforce_plus_plus",
                                                      "reinforce_plus_plus_baseline", "on_policy_distillation")},
    "remote_rm": ["add_arguments", "configure", "reward"],
    **{name: ["reward"] for name in ("math", "dapo", "deepscaler", "f1", "gpqa", "random", "deterministic_random", "zero")},
}


@pytest.fixture(scope="module")
def builtins(tmp_path_factory, server):
    """``(plugin manager, run configuration)``: every installed plugin, the configuration a run would give them."""
    data = tmp_path_factory.mktemp("kit") / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "label": "{i + 1}"}}\n' for i in range(5)))
    pm = get_plugin_manager()
    url = f"http://127.0.0.1:{server.server_address[1]}/length"
    return pm, launch_config("--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label", "--rm-url",
                             url, "--rollout-max-response-len", "16", pm=pm)


def test_the_table_names_every_built_in(furlong_entry_points):
    assert sorted(EXERCISED) == sorted(furlong_entry_points)


def test_the_kit_knows_every_hook():
    from furlong.hooks import specs
    from furlong.hooks.testing import checks

    assert sorted([*checks.CHECKS, *checks.NOT_EXERCISED]) == sorted(specs.__all__)


def test_a_data_source_whose_state_does_not_round_trip_fails(tmp_path):
    class Rows:
        def __init__(self):
            self.offset = 0

        def next_rows(self, k):
            self.offset += k
            return [{"prompt": f"{self.offset - k + i}+1="} for i in range(k)]

        def state(self):
            return {"offset": self.offset}

        def load_state(self, state):
            pass  # forgets the position

    config = launch_config("--prompt-data", str(tmp_path / "unused.jsonl"))
    assert _kit_error(_plugin(data_source=lambda config, dataset: Rows()), config=config,
                      dataset=training_dataset(config)) == (
        "plugin 'careless' breaks the `data_source` contract: next_rows(2) after load_state(state()) returned other "
        "rows; a resumed run must see the same data.")


@pytest.fixture(scope="module")
def own_data(builtins, tmp_path_factory):
    """The kit's rows in the files the parquet and hf_datasets data sources read."""
    import json

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, config = builtins
    with open(config.prompt_data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    folder = tmp_path_factory.mktemp("kit_data")
    pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(folder / "saved"))
    return {"parquet": str(folder / "train.parquet"), "hf_datasets": str(folder / "saved")}


@pytest.fixture(scope="module")
def tool_run(builtins, tmp_path_factory):
    """The run configuration with generate multi_turn and its tools (a real module on sys.path)."""
    import sys

    pm, config = builtins
    folder = tmp_path_factory.mktemp("kit_tools")
    (folder / "kit_tools.py").write_text(
        'TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]\n\n'
        "def execute(name, arguments):\n    return str(sum(arguments.values()))\n")
    sys.path.insert(0, str(folder))
    yield launch_config("--prompt-data", config.prompt_data, "--rollout-max-response-len", "16", "--generate",
                        "multi_turn", "--generate-tool-specs-path", "kit_tools.TOOLS", "--generate-tool-call-parser",
                        "qwen25", "--generate-execute-tool-function-path", "kit_tools.execute", pm=pm)
    sys.path.remove(str(folder))


@pytest.mark.parametrize("name", sorted(EXERCISED))
def test_every_built_in_plugin_passes_the_kit(builtins, own_data, tool_run, name):
    pm, config = builtins
    config = tool_run if name == "multi_turn" else config
    report = check_plugin(pm.get_plugin(name), name, config=config, dataset=training_dataset(config, own_data.get(name)))
    assert report.checked == EXERCISED[name]
    assert sorted(report.checked + list(report.not_exercised)) == pm.hooks_of(name)


def _kit_error(plugin, name="careless", **kwargs) -> str:
    with pytest.raises(ContractViolation) as excinfo:
        check_plugin(plugin, name, **kwargs)
    return str(excinfo.value)


def _plugin(**functions) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{k: hookimpl(v) for k, v in functions.items()})


def test_registration_mistakes_fail_with_the_core_s_message():
    assert _kit_error(_plugin(reward=lambda config, sample: [1.0])) == (
        "plugin 'careless' does not register: `reward(config, sample)` takes 'sample', which is not an argument of "
        "hook `reward`; its arguments are: config, samples (take any of them, by name); did you mean 'samples'?")
    assert _kit_error(types.SimpleNamespace(reward=lambda config, samples: [1.0])) == (
        "plugin 'careless' does not register: defines `reward` without @hookimpl: decorate each hook function with "
        "@hookimpl (from furlong.hooks import hookimpl).")


def _two_turn(mistake):
    async def generate(sample, sampling_params, engine):
        prompt = engine.tokenizer(sample.prompt)["input_ids"]
        budget = sampling_params["max_new_tokens"]
        first = await engine.generate(prompt, {**sampling_params, "max_new_tokens": budget})
        tool = engine.tokenizer(" [tool: 2] ")["input_ids"]
        left = budget - len(first.output_ids) if mistake != "budget_per_turn" else budget
        second = await engine.generate(prompt + first.output_ids + tool, {**sampling_params, "max_new_tokens": left})
        response = first.output_ids + tool + second.output_ids
        sample.tokens, sample.response_length = prompt + response, len(response)
        sample.loss_mask = [1] * len(first.output_ids) + [0] * len(tool) + [1] * len(second.output_ids)
        sample.rollout_log_probs = first.output_log_probs + [0.0] * len(tool) + second.output_log_probs
        sample.weight_versions += [first.weight_version, second.weight_version]
        if mistake == "one_version":
            sample.weight_versions.pop()
        if mistake == "log_probs_of_generated_tokens_only":
            sample.rollout_log_probs = first.output_log_probs + second.output_log_probs
        sample.status = Status.TRUNCATED if second.finish_reason == "length" else Status.COMPLETED
        return sample
    return _plugin(generate=generate)


def test_a_two_turn_generate_plugin_that_keeps_the_rules_passes():
    assert check_plugin(_two_turn(None), "two_turn").checked == ["generate"]


@pytest.mark.parametrize(("mistake", "expected"), [
    ("log_probs_of_generated_tokens_only",
     "plugin 'careless' breaks the `generate` contract: returned sample 0 whose per-token fields "
     "disagree: len(rollout_log_probs)=48 != response_length=59; loss_mask and rollout_log_probs hold one entry per "
     "response token (the last response_length ids of tokens)."),
    ("one_version",
     "plugin 'careless' breaks the `generate` contract: it made 2 engine call(s) but recorded 1 weight version(s); "
     "append GenerateOutput.weight_version to sample.weight_versions once per engine call."),
    ("budget_per_turn",
     "plugin 'careless' breaks the `generate` contract: the engine generated 10 tokens for max_new_tokens=5; the "
     "budget covers every turn together: ask each turn for what is left."),
])
def test_a_generate_mistake_names_plugin_and_rule(mistake, expected):
    assert _kit_error(_two_turn(mistake)) == expected


def test_a_generate_plugin_gets_the_engine_it_is_given():
    engine = TinyEngine(reply=lambda prompt, call: "\\boxed{2}", version=7)
    check_plugin(_two_turn(None), "two_turn", engine=engine)
    assert [r["max_new_tokens"] for r in engine.requests[:2]] == [64, 55]


@pytest.mark.parametrize(("functions", "expected"), [
    (dict(reward=lambda samples: 1.0),
     "plugin 'careless' breaks the `reward` contract: returned float 1.0 for 1 sample(s) (first "
     "sample index 0); `reward` returns a list with one reward per sample, e.g. [1.0]."),
    (dict(reward=lambda samples: [float("inf")] * len(samples)),
     "plugin 'careless' breaks the `reward` contract: returned inf for sample 0; a reward must be "
     "a finite number."),
    (dict(filter=lambda samples: FilterResult(keep=False, reason="all the same")),
     "plugin 'careless' breaks the `filter` contract: it gave the reason 'all the same'; a reason is a short "
     "snake_case word (counted in rollout/dynamic_filter/drop_<reason>) or None."),
    (dict(buffer_pop=lambda buffer, num_samples: buffer[:num_samples]),
     "plugin 'careless' breaks the `buffer_pop` contract: it returned a group it left in the buffer; remove the "
     "returned groups from `buffer`."),
    (dict(advantage=lambda batch: AdvantageOutput(advantages=[torch.full_like(m, float("nan")) for m in
                                                              batch.loss_masks])),
     "plugin 'careless' breaks the `advantage` contract: advantages[0] holds nan on a trained token; per-token "
     "values must be finite."),
    (dict(advantage=lambda batch: AdvantageOutput(advantages=[batch.rewards])),
     "plugin 'careless' breaks the `advantage` contract: advantages has 1 tensors for a batch of "
     "8 samples; return one per-token tensor per sample."),
    (dict(loss=lambda batch: LossOutput(token_loss=[(-a).detach() for a in batch.advantages])),
     "plugin 'careless' breaks the `loss` contract: token_loss carries no grad; compute it from batch.log_probs (or "
     "batch.values) without detaching."),
    (dict(loss=lambda batch: LossOutput(token_loss=[(lp * a).sum() for lp, a in zip(batch.log_probs,
                                                                                   batch.advantages)])),
     "plugin 'careless' breaks the `loss` contract: token_loss[0] has 1 values but the sample has "
     "5 response tokens; return per-token values and let the core reduce them."),
    (dict(loss_reducer=lambda values, loss_masks: sum(v.sum() for v in values)),
     "plugin 'careless' breaks the `loss_reducer` contract: a masked token (loss_masks 0) got a gradient; only "
     "trained tokens may count."),
    (dict(loss_reducer=lambda values: [v.sum() for v in values]),
     "plugin 'careless' breaks the `loss_reducer` contract: the reducer returned list; expected a 0-dim float "
     "tensor (the micro-batch's weighted sum)."),
    (dict(add_arguments=lambda parser: parser.add_argument("--scale", type=float, default=1.0)),
     "plugin 'careless' breaks the `add_arguments` contract: it adds the flag --scale; a plugin's flags start with "
     "its name (--careless-...)."),
    (dict(reward=lambda config, samples: [config.plugin_config("careless").careless_scale for _ in samples]),
     "plugin 'careless' raised in `reward` on the kit's realistic input: AttributeError: plugin 'careless' has no "
     "flag or derived value 'careless_scale' (it has no section: it added no flag, or no plugin is called that; "
     f"sections: {', '.join(sorted(launch_config(configure=False).plugins))}) (a plugin that reads flags needs them "
     "in check_plugin's config)"),
])
def test_a_broken_plugin_fails_naming_plugin_hook_and_rule(functions, expected):
    assert _kit_error(_plugin(**functions), config=launch_config()) == expected


def test_a_plugin_reads_its_own_flag_defaults_from_its_section(plugin_manager, register_plugin):
    seen = []
    plugin = _plugin(add_arguments=lambda parser: parser.add_argument("--careful-scale", type=float, default=2.0),
                     reward=lambda config, samples: seen.append(config.plugin_config("careful").careful_scale)
                     or [1.0 for _ in samples])
    register_plugin(plugin, "careful")
    config = launch_config(pm=plugin_manager)
    assert check_plugin(plugin, "careful", config=config).checked == ["add_arguments", "reward"]
    assert seen == [2.0, 2.0]


def test_an_old_form_hook_gets_the_namespace_view_of_the_config():
    seen = []
    plugin = _plugin(reward=lambda args, samples: seen.append(args.rollout_batch_size) or [1.0 for _ in samples])
    assert check_plugin(plugin, "old_form", config=launch_config("--rollout-batch-size", "3")).checked == ["reward"]
    assert seen == [3, 3]


def test_a_hook_that_reads_the_config_needs_one():
    with pytest.raises(NoConfigGiven, match=r"`reward` of plugin 'careful' reads the run configuration; pass "
                                            r"config=furlong\.core\.config\.launch_args\.launch_config"):
        check_plugin(_plugin(reward=lambda config, samples: [1.0 for _ in samples]), "careful")


def test_an_async_add_arguments_fails():
    async def add_arguments(parser):
        parser.add_argument("--careless-x")

    assert _kit_error(_plugin(add_arguments=add_arguments)) == (
        "plugin 'careless' breaks the `add_arguments` contract: it is async def; `add_arguments` is a set-up hook, "
        "run before the event loop starts, and may not be async.")


def test_kit_refuses_an_async_configure():
    async def configure(args, report):
        report.default(args, "gamma", 0.5)

    assert _kit_error(_plugin(configure=configure)) == (
        "plugin 'careless' breaks the `configure` contract: it is async def; `configure` is a set-up hook, "
        "run before the event loop starts, and may not be async.")


def _documented_example(marker: str) -> types.ModuleType:
    """The PLUGINS.md code block whose first line is ``# example: <marker>``, as a module."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "PLUGINS.md").read_text()
    [source] = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if b.startswith(f"# example: {marker}")]
    module = types.ModuleType(marker)
    exec(compile(source, f"PLUGINS.md:{marker}", "exec"), module.__dict__)
    return module


def test_the_documented_two_turn_plugin_passes_the_kit():
    module = _documented_example("two_turn")
    engine = TinyEngine(reply=lambda prompt, call: "calc(1+1)" if call % 2 else " so \\boxed{2}")
    assert check_plugin(module, "two_turn", engine=engine).checked == ["generate"]
    # the second turn sees the tool's answer; its own budget is what the first turn and the tool left
    assert engine.tokenizer.decode(engine.requests[1]["input_ids"]) == "What is 1+1?calc(1+1) = 2\n"
    assert engine.requests[1]["max_new_tokens"] == 64 - len("calc(1+1)") - len(" = 2\n")
