"""Loading Hugging Face model directories with errors that name the flag and the file at fault.

Engines, train backends and data sources all read ``--hf-checkpoint`` (or ``--ref-load``);
these helpers turn the many ways that can fail (missing tokenizer files, a truncated or
corrupt ``*.safetensors``, an unreadable ``config.json``) into one :class:`PluginError`.
"""

from __future__ import annotations

import glob
import os
from typing import Any

from .errors import PluginError

__all__ = ["load_causal_lm_weights", "load_tokenizer"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "merges.txt", "spiece.model")


def load_tokenizer(path: str, flag: str = "--hf-checkpoint") -> Any:
    """``AutoTokenizer.from_pretrained(path)``.

    :raises PluginError: the directory holds no usable tokenizer (the message names
        ``flag``, ``path`` and the files a tokenizer needs).
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here
        found = [n for n in _TOKENIZER_FILES if os.path.exists(os.path.join(path, n))] if os.path.isdir(path) else []
        problem = f"cannot load the tokenizer ({_first_line(exc)})" if found else "no tokenizer files"
        raise PluginError(
            f"{flag} {path}: {problem}. The directory needs the model's tokenizer files (tokenizer.json and "
            "tokenizer_config.json, or its vocabulary files); copy them from where the model came from."
        ) from exc


def load_causal_lm_weights(path: str, flag: str, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path, **kwargs)``.

    ``ImportError`` and ``ValueError`` pass through unchanged, so a caller can fall back
    to another attention implementation (and report them if it cannot).

    :raises PluginError: no weights, a corrupt or truncated weight file, or an unreadable
        config (the message names ``flag``, ``path`` and, where known, the file).
    """
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (ImportError, ValueError):
        raise  # e.g. an attention implementation that is not installed: the caller may fall back
    except OSError as exc:
        raise PluginError(f"{flag} {path}: cannot load the model ({_first_line(exc)}).") from exc
    except Exception as exc:  # noqa: BLE001 - e.g. safetensors' SafetensorError on a corrupt file
        files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) or sorted(glob.glob(os.path.join(path, "*.bin")))
        named = ", ".join(os.path.basename(f) for f in files) or "the weight files"
        raise PluginError(
            f"{flag} {path}: cannot read the weights in {named} ({type(exc).__name__}: {_first_line(exc)}); "
            "the file is corrupt or truncated: download or export it again."
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
