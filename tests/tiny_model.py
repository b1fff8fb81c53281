"""A tiny random Llama and a character-level tokenizer, written to a directory, for backend tests.

The tokenizer maps every printable ASCII character and newline to one token, plus
``<pad>`` (0), ``<unk>`` (1), ``<s>`` (2) and ``</s>`` (3). It adds no special tokens
when encoding, so ``decode(encode(text)) == text`` for any ASCII text. The model is a
2-layer Llama (hidden 32, 2 heads), random weights from a fixed seed, float32.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


def build_tiny_model(path: Path, seed: int = 0) -> Path:
    """Write ``config.json``, weights and tokenizer files of the tiny model to ``path``; return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=len(vocab), max_position_embeddings=1024, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, tie_word_embeddings=False,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    torch.random.set_rng_state(state)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _train_flags(hf_dir: Path | str, overrides: dict) -> dict:
    values = dict(
        hf_checkpoint=str(hf_dir), optimizer="adam", lr=1e-2, lr_decay_style="constant", lr_decay_iters=None,
        weight_decay=0.0, clip_grad=1.0, rollout_batch_size=4, global_batch_size=4, micro_batch_size=1,
        use_dynamic_batch_size=False, max_tokens_per_gpu=None, bf16=False, fp16=False,
    )
    values.update(overrides)
    return values


def train_args(hf_dir: Path | str, **overrides) -> argparse.Namespace:
    """The launch flags of a 1-rollout run on the model in ``hf_dir``, through the parser: what a
    backend's ``configure`` gets.

    Defaults: 1 rollout of 4 samples, ``gbs`` 4 in fixed micro-batches of 1 (no dynamic
    batch size), Adam at lr 1e-2 (constant, decaying over the backend's own step count), no
    weight decay, clip 1.0, float32; every other flag takes the parser's default.
    ``overrides`` replace any of them (flag attribute names: see
    :func:`furlong.core.config.launch_args.launch_args`).
    """
    from furlong.core.config.launch_args import launch_args

    return launch_args(**_train_flags(hf_dir, overrides))


def train_config(hf_dir: Path | str, **overrides) -> "RunConfig":
    """The run configuration of :func:`train_args`' flags: what ``train_backend`` and ``init`` get.

    ``overrides`` name a field (``lr=1e-2``), a plugin's flag, or a Megatron-LM flag (``sgd_momentum=0.9``:
    set in ``megatron_args``, as if given), applied after the freeze like :func:`train_args`' after the parse.
    """
    import attrs

    from furlong.core.config.launch_args import launch_config
    from furlong.hooks import RunConfig

    values = _train_flags(hf_dir, overrides)
    base = launch_config(configure=False)
    known = set(attrs.fields_dict(RunConfig)) | {dest for section in base.plugins.values() for dest in section}
    megatron = {name: values.pop(name) for name in list(values) if name not in known}
    config = launch_config(configure=False, **values)
    return config.replace(megatron_args={**config.megatron_args, **megatron}) if megatron else config


# flags of the 2-rank FSDP2 test (worker and single-process reference): SGD's first update is
# -lr * clipped gradient, so weights compare gradients without Adam's g/|g| amplification.
TWO_RANK_FLAGS = dict(optimizer="sgd", sgd_momentum=0.9, lr=0.1, clip_grad=1.0)

PROMPTS = ["Q: 2+3=", "Say hi:", "abc", "The sky is"]
RESPONSES = [" 5.", " hi there", "def", " blue today"]


def make_batch(tokenizer, steps, temperature: float = 1.0, advantages=(1.0, -0.5, 2.0, 1.0),
               entropy_coef: float = 0.0, pad_in_prompt: bool = False):
    """A ``TrainBatch`` of the four fixed prompt/response pairs, with a :class:`MeanPG` objective.

    :param steps: ``TrainBatch.steps`` (micro-batches of sample indices per step).
    :param entropy_coef: weight of the entropy bonus in the objective's loss.
    :param pad_in_prompt: the first prompt's second token is the pad token (``tokenizer.pad_token_id``).
    """
    import torch

    from furlong.hooks import TrainBatch

    tokens, lengths = [], []
    for prompt, response in zip(PROMPTS, RESPONSES):
        p, r = tokenizer.encode(prompt), tokenizer.encode(response)
        tokens.append(p + r)
        lengths.append(len(r))
    if pad_in_prompt:
        tokens[0][1] = tokenizer.pad_token_id
    batch = TrainBatch(tokens=tokens, response_lengths=lengths, loss_masks=[torch.ones(n) for n in lengths],
                       steps=steps, temperature=temperature)
    batch.objective = MeanPG(list(advantages), global_batch_size=len(tokens), entropy_coef=entropy_coef)
    return batch


class MeanPG:
    """A per-sample policy-gradient objective (the core's per-sample mode, unit masks).

    Micro-batch loss ``sum_i (-A_i * mean_t(logp_{i,t}) - c * mean_t(H_{i,t})) / gbs`` (``c``:
    ``entropy_coef``): summed over a step's micro-batches (and ranks) it is the step objective,
    whatever the packing.
    """

    def __init__(self, advantages: list[float], global_batch_size: int, scale: float = 1.0,
                 entropy_coef: float = 0.0):
        self.advantages = advantages
        self.entropy_coef = entropy_coef
        self.gbs = global_batch_size
        self.scale = scale
        self.calls: list[list[int]] = []

    async def __call__(self, sample_ids, log_probs, entropy, values=None):
        self.calls.append(list(sample_ids))
        loss = sum(-self.advantages[i] * lp.mean() for i, lp in zip(sample_ids, log_probs)) / self.gbs
        if self.entropy_coef:
            loss = loss - self.entropy_coef * sum(e.mean() for e in entropy) / self.gbs
        loss = loss * self.scale
        return loss, {"loss": float(loss.detach()), "entropy": float(sum(e.detach().mean() for e in entropy)) / self.gbs}


def run_two_ranks(worker: str, *argv: str, timeout: float = 220, nproc: int = 2) -> None:
    """Run ``tests/<worker>`` under ``torchrun --standalone`` with ``nproc`` ranks (one torch thread each).

    :raises AssertionError: the run fails (the tail of its stderr is the message).
    """
    import os
    import subprocess
    import sys

    script = Path(__file__).with_name(worker)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(script),
           *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


def one_process_and_torchrun(flags: list[str], cwd: Path, one: list[str], two: list[str],
                             timeout: float = 200) -> tuple[dict, str]:
    """``furlong train`` with ``flags`` in one process (plus ``one``, saving to ``cwd/one``) and under
    ``torchrun --nproc-per-node 2`` (plus ``two``, saving to ``cwd/two``).

    :returns: ``({"one": rows, "two": rows}, torchrun's stderr)``: the ``rollout/step`` rows of each
        run's metrics.jsonl.
    :raises AssertionError: a run fails (the tail of its stderr is the message).
    """
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    for cmd in ([sys.executable, "-m", "furlong.core", *flags, "--save", str(cwd / "one"), *one],
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                 "furlong.core", *flags, "--save", str(cwd / "two"), *two]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        assert done.returncode == 0, done.stderr[-4000:]
    rows = {name: [json.loads(line) for line in (cwd / name / "metrics.jsonl").read_text().splitlines()
                   if '"rollout/step"' in line] for name in ("one", "two")}
    return rows, done.stderr


def build_tiny_moe_model(path: Path, seed: int = 0, *, num_experts: int = 4, top_k: int = 2,
                         norm_topk_prob: bool = True, tied: bool = False) -> Path:
    """Write a tiny random Qwen3-MoE (``Qwen3MoeForCausalLM``) with the character tokenizer to ``path``.

    2 layers, hidden 32, 4 query / 2 key-value heads of 16, ``num_experts`` experts of
    intermediate size 16 on every layer, ``top_k`` routed per token, float32.
    """
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    build_tiny_model(path, seed)  # the tokenizer (the dense weights are replaced below)
    for stale in path.glob("model*.safetensors*"):
        stale.unlink()
    config = Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=num_experts,
        num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=len(SPECIALS) + 96, max_position_embeddings=1024, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, tie_word_embeddings=tied, rope_theta=10000.0, router_aux_loss_coef=0.001,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    torch.random.set_rng_state(state)
    model.save_pretrained(path)
    return path


def build_tiny_glm4_model(path: Path, seed: int = 0, *, attention_bias: bool = True, tied: bool = False,
                          std: float | None = None) -> Path:
    """Write a tiny random GLM-4 (``Glm4ForCausalLM``) with the character tokenizer to ``path``.

    2 layers, hidden 32, 4 query / 2 key-value heads of 16, intermediate 64, RoPE on half of each
    head (``partial_rotary_factor`` 0.5, interleaved as transformers' GLM-4 applies it), q/k/v bias when
    ``attention_bias``, float32. Every weight is random, the four norms of each layer and the biases
    included (transformers initialises norms to 1 and biases to 0, which would hide a misplaced one);
    ``std``: every matrix drawn with this standard deviation instead of transformers' 0.02 (large
    weights make attention and RoPE matter in logit comparisons).
    """
    import torch
    from transformers import Glm4Config, Glm4ForCausalLM

    build_tiny_model(path, seed)  # the tokenizer (the Llama weights are replaced below)
    for stale in path.glob("model*.safetensors*"):
        stale.unlink()
    config = Glm4Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=len(SPECIALS) + 96, max_position_embeddings=1024, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=tied, attention_bias=attention_bias,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Glm4ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif std is not None:
                param.normal_(0.0, std)
    torch.random.set_rng_state(state)
    model.save_pretrained(path)
    return path


def build_script_model(path: Path, transitions: dict[str, str], *, extra_words=(), eos: str = "</s>",
                       chat_template: str | None = None, strength: float = 2.0, hidden: int | None = None) -> Path:
    """A real one-layer Llama with a word-level tokenizer that writes a fixed script under greedy decoding.

    Attention and MLP outputs are zero, so the logits at a position depend on its token alone:
    ``lm_head`` sends word ``a`` to ``transitions[a]`` and every other word to ``eos``
    (log-probs a few thousandths below 0 at ``strength`` 2). One token per whitespace-separated
    word; ``extra_words`` join the vocabulary (a tool's output), any other word is ``<unk>``.
    ``chat_template`` (jinja) is saved with the tokenizer. ``hidden`` (at least the vocabulary
    size, even; default the smallest such) is also the one head's dimension: servers whose
    attention kernels take only some head sizes need 64 or 128.
    """
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", eos, "<unk>"]
    words = specials + sorted({w for pair in transitions.items() for w in pair} - set(specials) | set(extra_words))
    vocab = {w: i for i, w in enumerate(words)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token=eos, unk_token="<unk>",
                                        pad_token="<pad>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    size = len(words)
    hidden = hidden or size + size % 2  # RoPE needs an even head dimension
    assert hidden >= size and hidden % 2 == 0, (hidden, size)
    config = LlamaConfig(vocab_size=size, hidden_size=hidden, intermediate_size=4, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        layer = model.model.layers[0]
        for norm in (model.model.norm, layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.fill_(1.0)
        model.model.embed_tokens.weight[:, :size] = torch.eye(size)
        model.lm_head.weight[vocab[eos], :] = strength
        for a, b in transitions.items():
            model.lm_head.weight[:, vocab[a]] = 0.0
            model.lm_head.weight[vocab[b], vocab[a]] = strength
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_bf16_model_for_fp8(path: Path, seed: int = 0) -> Path:
    """The tiny model's tokenizer with a 2-layer Llama whose linear layers are multiples of the FP8
    block (hidden 128, MLP 256, 2 heads of 64, 2 KV heads), saved in bfloat16: the BF16 source of
    ``furlong quantize-fp8`` in the FP8 tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    build_tiny_model(path, seed)
    config = LlamaConfig.from_pretrained(path)
    config.hidden_size, config.intermediate_size = 128, 256
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 2, 64
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    torch.random.set_rng_state(state)
    model.save_pretrained(path)
    return path


def record_module_calls(monkeypatch) -> tuple[list, list]:
    """Patch ``torch.nn.Module.__call__`` to record each call as ``(thread name, module class)``, in the first
    list when the calling thread holds the process's compute turn (``furlong.kit.compute_thread``), else in
    the second; returns both lists."""
    import threading

    import torch

    from furlong.kit.compute_thread import compute_turn

    turn, plain_call = compute_turn(), torch.nn.Module.__call__
    held, outside = [], []

    def recording_call(module, *args, **kwargs):
        (held if turn._is_owned() else outside).append((threading.current_thread().name, type(module).__name__))
        return plain_call(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", recording_call)
    return held, outside
