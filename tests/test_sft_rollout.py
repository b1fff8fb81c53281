"""Supervised fine-tuning through the loop: assistant-turn loss masks and Miles' SFT launch flags."""

from __future__ import annotations

import json

import pytest

from furlong.core.cli import main
from furlong.hooks import PluginError
from furlong.kit.chat_masks import assistant_loss_mask, response_span
from furlong.kit.hf import load_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# rewrites earlier turns: the last assistant turn is rendered differently from the others
UNSTABLE = ("{% for m in messages %}{% if loop.last %}[{{ m['content'] }}]{% else %}{{ m['content'] }}{% endif %}"
            "{% endfor %}")
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "and 4+4?"},
    {"role": "assistant", "content": "8", "step_loss_mask": 0},
    {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": "ok!"},
]


@pytest.fixture
def chat_tokenizer(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    tokenizer.chat_template = CHATML
    return tokenizer


def _trained_text(tokenizer, ids, mask) -> list[str]:
    spans, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans + ([tokenizer.decode(current)] if current else [])


def test_assistant_turns_are_trained_without_their_header(chat_tokenizer):
    ids, mask = assistant_loss_mask(chat_tokenizer, CONVERSATION, "qwen")
    rendered = chat_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert chat_tokenizer.decode(ids) == rendered
    assert _trained_text(chat_tokenizer, ids, mask) == ["5<|im_end|>\n", "ok!<|im_end|>\n"]
    assert response_span(mask) == len(ids) - rendered.index("5<|im_end|>")
    assert assistant_loss_mask(chat_tokenizer, CONVERSATION, "qwen3") == (ids, mask)


def test_distill_style_trains_the_last_message_after_the_first_prompt(chat_tokenizer):
    ids, mask = assistant_loss_mask(chat_tokenizer, CONVERSATION[1:3], "distill_qwen")
    prompt = "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert chat_tokenizer.decode(ids) == prompt + "5"
    assert mask == [0] * len(prompt) + [1]


def test_mask_errors_name_the_problem(chat_tokenizer):
    with pytest.raises(PluginError, match=r"--loss-mask-type 'llama': choose one of qwen, qwen3, distill_qwen"):
        assistant_loss_mask(chat_tokenizer, CONVERSATION, "llama")
    chat_tokenizer.chat_template = UNSTABLE
    with pytest.raises(PluginError, match=r"sample 7: message 1 \(user\): the chat template does not render"):
        assistant_loss_mask(chat_tokenizer, CONVERSATION, "qwen", where="sample 7")
    chat_tokenizer.chat_template = None
    with pytest.raises(PluginError, match="the tokenizer has no chat template"):
        assistant_loss_mask(chat_tokenizer, CONVERSATION, "qwen")


MILES_SFT = ["--rollout-function-path", "miles.rollout.sft_rollout.generate_rollout", "--input-key", "messages",
             "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
             "--loss-mask-type", "qwen", "--debug-train-only"]


def _conversations(path, n: int):
    rows = [{"messages": [{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": str(i + 1)}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_miles_sft_flags_train_the_masked_tokens_and_the_first_loss_is_the_mean_nll(tmp_path, tiny_model_dir):
    """Two conversations per rollout, one optimizer step: the first step's loss is the per-token mean NLL
    of the assistant tokens under the initial weights, computed here with transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    data = _conversations(tmp_path / "sft.jsonl", 4)
    logs = tmp_path / "logs"
    argv = ["train", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), *MILES_SFT,
            "--chat-template-path", str(template), "--num-rollout", "2", "--rollout-batch-size", "2",
            "--global-batch-size", "2", "--lr", "1e-3", "--log-dir", str(logs)]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/step" in r]
    assert len(steps) == 2

    tokenizer = load_tokenizer(str(tiny_model_dir))
    tokenizer.chat_template = CHATML
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    total, count = 0.0, 0
    for i in range(2):
        ids, mask = assistant_loss_mask(tokenizer, [{"role": "user", "content": f"{i}+1?"},
                                                    {"role": "assistant", "content": str(i + 1)}])
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        token_logp = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        trained = torch.tensor(mask[1:], dtype=torch.bool)
        total -= float(token_logp[trained].sum())
        count += int(trained.sum())
    assert steps[0]["train/loss"] == pytest.approx(total / count, rel=1e-5)
    assert "rollout/advantages" not in [r for r in rows if "rollout/step" in r][0]


def test_sft_rollout_refuses_a_reward_loss_and_groups(tmp_path, tiny_model_dir, capsys):
    data = _conversations(tmp_path / "sft.jsonl", 2)
    argv = ["train", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--input-key", "messages",
            "--rollout", "sft", "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--print-config"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--rollout sft makes one sample per conversation: --n-samples-per-prompt must be 1, got 2." in err
    assert "--rollout sft: its samples carry no reward, so --loss-type policy_loss would learn nothing" in err
    argv = ["train", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--input-key", "messages",
            "--num-rollout", "1", "--rollout-batch-size", "2", "--disable-compute-advantages-and-returns",
            "--print-config"]
    assert main(argv) == 2
    assert ("--disable-compute-advantages-and-returns leaves no advantages, which --loss-type policy_loss needs"
            in capsys.readouterr().err)
