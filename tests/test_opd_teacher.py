"""On-policy distillation with a served teacher: ``furlong serve`` on loopback scores the samples."""

from __future__ import annotations

import asyncio
import json

import pytest

from furlong.core.cli import main
from furlong.core.config.launch_args import launch_config
from furlong.core.rollout.opd_teacher import OpdTeacher, teacher_body, teacher_log_probs
from furlong.hooks import PluginError, Sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_teacher_log_probs_of_the_response_equal_transformers(serve_server, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    config = launch_config("--use-opd", "--opd-type", "sglang", "--rm-url", serve_server.url + "/generate",
                           configure=False)
    samples = [Sample(index=0, tokens=[40, 41, 42, 43, 44, 45], response_length=2),
               Sample(index=1, tokens=[50, 60, 70, 80], response_length=3)]
    teacher = OpdTeacher(config)

    async def score():
        try:
            await teacher.score(samples)
        finally:
            await teacher.close()

    asyncio.run(score())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for sample in samples:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([sample.tokens])).logits[0, :-1].float(), -1)
        want = logp.gather(-1, torch.tensor(sample.tokens[1:])[:, None])[:, 0][-sample.response_length:]
        assert sample.teacher_log_probs == pytest.approx(want.tolist(), abs=1e-5)


def test_teacher_routes_by_metadata_then_default_then_rm_url():
    config = launch_config("--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "math=http://m/generate",
                           "default=http://d/generate", configure=False)
    teacher = OpdTeacher(config)
    assert teacher.url_of(Sample(metadata={"opd_teacher": "math"})) == "http://m/generate"
    assert teacher.url_of(Sample(metadata={"opd_teacher": "code"})) == "http://d/generate"
    only = OpdTeacher(launch_config("--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "math=http://m",
                                    configure=False))
    with pytest.raises(PluginError, match=r"sample 4 has metadata\['opd_teacher'\]='code', which names none of "
                                          r"\['math'\], and there is no 'default' teacher nor --rm-url"):
        only.url_of(Sample(index=4, metadata={"opd_teacher": "code"}))


def test_the_request_scores_without_generating_and_a_bad_answer_is_named():
    assert teacher_body([1, 2]) == {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 0,
                                    "sampling_params": {"max_new_tokens": 0, "temperature": 0.0,
                                                        "skip_special_tokens": False}}
    answer = {"meta_info": {"input_token_logprobs": [[None, 1], [-0.5, 2], [-0.25, 3]]}}
    assert teacher_log_probs(answer, 2, "t") == [-0.5, -0.25]
    with pytest.raises(PluginError, match="t: the teacher scored 2 positions, fewer than the response's 3 tokens"):
        teacher_log_probs(answer, 3, "t")
    with pytest.raises(PluginError, match="t: the answer has no meta_info.input_token_logprobs"):
        teacher_log_probs({"text": ""}, 1, "t")


def test_miles_opd_script_flags_distill_from_furlong_serve(serve_server, tiny_model_dir, arithmetic_jsonl, tmp_path):
    """Miles' OPD flags, unchanged. The teacher serves the student's own weights: at rollout 0 the OPD term
    (student minus teacher log-prob) is 0 on every token and the zero reward gives no GRPO signal, so the
    advantages are 0; after one update the student has moved and they are not."""
    logs = tmp_path / "logs"
    argv = ["train", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(arithmetic_jsonl),
            "--input-key", "prompt", "--label-key", "label", "--num-rollout", "2", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--lr", "1e-2",
            "--custom-rm-path", "miles.rollout.on_policy_distillation.reward_func",
            "--custom-reward-post-process-path", "miles.rollout.on_policy_distillation.post_process_rewards",
            "--rm-url", serve_server.url + "/generate", "--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "1.0",
            "--log-dir", str(logs)]
    assert main(argv) == 0
    rollouts = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in rollouts if "rollout/step" in r]
    assert [r["rollout/raw_reward"] for r in rollouts] == [0.0, 0.0]
    assert rollouts[0]["rollout/advantages"] == pytest.approx(0.0, abs=1e-5)
    assert abs(rollouts[1]["rollout/advantages"]) > 1e-4
