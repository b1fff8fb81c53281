"""The fsdp critic's model: the policy's transformers decoder with a scalar value head.

``V = value_head(h)``: ``value_head`` is ``nn.Linear(hidden_size, 1)`` on the decoder's last
hidden state ``h`` (float32 values). Its weights are named ``model.*`` (the decoder, as in the
policy's checkpoint) and ``value_head.weight`` / ``value_head.bias``; a saved critic's
``model/`` folder is a Hugging Face directory (the policy's ``config.json``, those weights in
``model.safetensors``) that ``--critic-load`` takes back. A fresh head starts at zero, so every
value starts at 0 (the first advantages are then the discounted returns).
"""

from __future__ import annotations

import functools
import glob
import os
from typing import Any, Sequence

from furlong.hooks import PluginError, RunConfig
from furlong.kit.critic import HEAD_PREFIX
from furlong.kit.hf import is_hf_dir, save_safetensors
from furlong.kit.trainer import right_padded, to_device

from . import packing
from .model import load_causal_lm

__all__ = ["HEAD_PREFIX", "forward_values", "load_value_model", "value_model_class"]


@functools.cache
def value_model_class():
    """The ``ValueModel`` class (built on first use, so that importing the plugin does not import torch)."""
    import torch

    class ValueModel(torch.nn.Module):
        """A decoder (``model``) and ``value_head = nn.Linear(hidden_size, 1)``; ``forward`` gives
        float32 values ``[B, L]``, one per position."""

        def __init__(self, decoder) -> None:
            super().__init__()
            self.model = decoder
            self.value_head = torch.nn.Linear(decoder.config.hidden_size, 1)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
            self._no_split_modules = list(getattr(decoder, "_no_split_modules", None) or [])

        @property
        def config(self):
            return self.model.config

        def forward(self, input_ids, position_ids=None, **kwargs):
            hidden = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                **kwargs).last_hidden_state
            return self.value_head(hidden).squeeze(-1).float()

        def save_pretrained(self, path: str, state_dict: dict | None = None) -> None:
            """``config.json`` and ``model.safetensors`` (the given full state dict, else this module's)."""
            os.makedirs(path, exist_ok=True)
            self.config.save_pretrained(path)
            save_safetensors(dict(state_dict if state_dict is not None else self.state_dict()),
                             os.path.join(path, "model.safetensors"))

    return ValueModel


def load_value_model(config: RunConfig, device) -> tuple[Any, str]:
    """The critic, in host memory (the caller places it), and where it came from.

    ``--critic-load`` when it is a Hugging Face directory (a saved critic's ``model/``, or any
    model of the policy's architecture): its decoder, and its value head when its weights hold
    one (else a fresh head). Otherwise ``--hf-checkpoint``'s decoder with a fresh head. The
    policy's output layer is dropped.

    :raises PluginError: the directory does not load (:func:`~.model.load_causal_lm`).
    """
    from safetensors import safe_open

    source, flag = ((config.critic_load, "--critic-load") if is_hf_dir(config.critic_load)
                    else (config.hf_checkpoint, "--hf-checkpoint"))
    causal = load_causal_lm(source, config, device, flag)
    decoder = getattr(causal, getattr(causal, "base_model_prefix", "model"), None)
    if decoder is None or decoder is causal:
        raise PluginError(f"{flag} {source}: {type(causal).__name__} has no decoder under base_model_prefix, so no "
                          "value head can be put on it.")
    model = value_model_class()(decoder)
    head = {}
    for file in sorted(glob.glob(os.path.join(source, "*.safetensors"))):
        with safe_open(file, "pt") as f:
            head.update({k[len(HEAD_PREFIX):]: f.get_tensor(k) for k in f.keys() if k.startswith(HEAD_PREFIX)})
    if head:
        model.value_head.load_state_dict(head)
    return model, f"{flag} {source}" + (" (with its value head)" if head else " with a fresh value head")


def forward_values(model, tokens: Sequence[Any], response_lengths: Sequence[int], device, *, grad: bool) -> list:
    """Per-sample values of the response tokens: ``V_t`` read at the position that predicts token ``t``.

    One pass over the right-padded sequences, or over the sequences packed into one row when the
    model runs packed attention (:mod:`.packing`).

    :param model: a ``ValueModel`` (:func:`value_model_class`; FSDP2-sharded or not).
    :param tokens: B sequences of prompt + response ids; :param response_lengths: B ``T_i``.
    :param grad: keep the autograd graph (training) or not.
    :returns: B float32 tensors ``[T_i]``.
    :raises ValueError: a sample whose response starts at position 0.
    """
    import torch

    seqs, ids = right_padded(tokens, response_lengths)
    with torch.set_grad_enabled(grad):
        if packing.packs(model.model if hasattr(model, "model") else model):
            ids, positions, spans = packing.pack(seqs, device)
            out = model(input_ids=ids, position_ids=positions, packed_spans=spans)
            rows = [(0, end - t - 1, t) for end, t in zip(spans.bounds[1:], response_lengths)]
        else:
            out = model(input_ids=to_device(ids, device))
            rows = [(i, len(seq) - t - 1, t) for i, (seq, t) in enumerate(zip(seqs, response_lengths))]
        return [out[i, s : s + t] for i, s, t in rows]
