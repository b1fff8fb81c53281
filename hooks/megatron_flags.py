"""How a train backend says which Megatron-LM flags it honours.

``furlong train`` accepts every flag of Megatron-LM's parser (the table in
``core/config/data/megatron_args.json``) and hands the given ones to the train backend:
as attributes of ``args`` (Megatron's own names and defaults) and as the dict
``args.megatron_args`` (``{dest: value}`` of the given ones only). Before any model loads,
the core compares the given flags with what the chosen backend declares and reports, in
the backend's name, one warning line listing the flags it ignores that do not change
results (fusions, kernels, overlap, logging...) and one error line listing those that
would change the model or the math (fp8, MoE or MLA on a model without them...).

A train backend plugin declares its support with a module-level (plugin object)
attribute ``MEGATRON_FLAGS`` holding a :class:`MegatronFlags`; a backend without it
honours none::

    # furlong_megatron/__init__.py (the plugin object registered under "megatron")
    from furlong.hooks import MegatronFlags

    MEGATRON_FLAGS = MegatronFlags(honours="all", except_=frozenset({"fp4"}))
"""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["MegatronFlags"]


@attrs.frozen
class MegatronFlags:
    """The Megatron-LM flags a train backend honours.

    ``honours``: the flag attributes (``dest``, e.g. ``"moe_router_topk"``) the backend
    reads and acts on, or ``"all"``. ``except_``: attributes taken out of ``"all"``.
    ``at_values``: ``{dest: values}`` of flags the backend honours at those values only
    (fsdp trains without dropout: ``{"attention_dropout": (0.0,)}``).
    ``architecture_from_hf``: the backend builds the model from the ``--hf-checkpoint``
    config, so flags that describe the architecture (layer counts, MoE, MLA, rotary...)
    are not read but are checked against that config where it can be read: a feature the
    config lacks (``--num-experts`` on a dense model, ``--multi-latent-attention`` on a
    model without MLA) is an error; others are listed in the warning.
    """

    honours: frozenset[str] | Literal["all"] = frozenset()
    except_: frozenset[str] = frozenset()
    at_values: dict[str, tuple] = attrs.field(factory=dict)
    architecture_from_hf: bool = False

    def honoured(self, dest: str, value=None) -> bool:
        """Does the backend act on the Megatron flag attribute ``dest`` (given as ``value``)?"""
        if dest in self.except_:
            return False
        if dest in self.at_values:
            return value in self.at_values[dest]
        return self.honours == "all" or dest in self.honours
