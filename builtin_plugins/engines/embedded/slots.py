"""A preallocated key/value cache of fixed slots and the attention function that reads and writes it.

The embedded engine decodes up to ``S`` requests at once, each in a *slot*: row ``s`` of
every layer's key and value buffers ``[S, H_kv, L + 1, D]``. A request's token at
position ``p`` keeps its key and value at column ``p``; column ``L`` is a scratch column
that padding writes into and no query ever attends to. The buffers are allocated once
and grown (doubled) only when a request needs more positions or more slots, so a decode
step allocates nothing and its shapes stay fixed (a CUDA graph can replay it).

The model runs with transformers' attention interface set to ``furlong_slots``
(:func:`slot_attention`); the decoder hands each forward pass a :class:`SlotPass` in the
``slot_pass`` keyword, which transformers passes down to every attention layer. Without
it the function is transformers' ``sdpa`` attention, so the model still works as usual.

For a mixture-of-experts model whose routing is recorded (:mod:`.experts`), the cache also
holds, per MoE layer, the experts each position was routed to: ``[S, 1, L + 1, k]`` integers,
grown, copied and moved with the keys and values, so a slot's record follows its request.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["ATTENTION_NAME", "SlotCache", "SlotPass", "attention_shape", "prefill_attention", "slot_attention",
           "use_slot_attention"]

ATTENTION_NAME = "furlong_slots"


@attrs.define(eq=False)
class SlotPass:
    """What one forward pass writes and attends to.

    Prefill (``causal`` is a mask ``[B, 1, q, q]``): the ``B`` rows are new prompts, left
    padded to ``q`` tokens; row ``b`` writes its keys into slot ``rows[b]`` at columns
    ``columns[b]`` (``[B, q]``, padding sends them to the scratch column) and attends
    within the prompt. Decode (``causal`` None): row ``b`` is slot ``b``, writes its one
    token at column ``columns[b, 0]`` and attends to the slot's columns ``0 .. columns[b, 0]``
    (``visible``, ``[B, 1, 1, width]``) of the first ``width`` columns; with ``kernel`` the
    decode step is :func:`~.decode_kernels.decode_attention` (CUDA), which reads each row's own
    columns and needs neither ``visible`` nor ``width``.
    """

    cache: "SlotCache"
    rows: Any
    columns: Any
    causal: Any = None
    visible: Any = None
    width: int = 0
    kernel: bool = False


def attention_shape(model) -> tuple[int, int, int]:
    """``(query heads, key/value heads, head size)`` of ``model``'s attention layers, from its config."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


class SlotCache:
    """Key and value buffers of every layer: ``[slots, H_kv, capacity + 1, D]`` each, in the model's dtype;
    with ``route_layers``, routing buffers of every recorded MoE layer: ``[slots, 1, capacity + 1, topk]``
    of ``route_dtype`` (expert ids)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, route_layers: int = 0,
                 topk: int = 0, route_dtype=None) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.route_layers, self.topk, self.route_dtype = route_layers, topk, route_dtype
        self.slots = 0
        self.capacity = 0
        self.keys: list = []
        self.values: list = []
        self.routes: list = []

    @classmethod
    def for_model(cls, model, routes: tuple[int, int, Any] | None = None) -> "SlotCache":
        """The cache of ``model``'s layers; ``routes``: ``(MoE layers, topk, dtype)`` to record routing."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        _, kv_heads, head_dim = attention_shape(model)
        param = next(model.parameters())
        return cls(config.num_hidden_layers, kv_heads, head_dim, param.dtype, param.device, *(routes or ()))

    def ensure(self, slots: int, capacity: int) -> bool:
        """Make room for ``slots`` slots of ``capacity`` positions (doubling); True when the buffers moved."""
        if slots <= self.slots and capacity <= self.capacity:
            return False
        import torch

        new_slots = max(slots, self.slots)
        new_capacity = self.capacity
        while new_capacity < capacity:
            new_capacity = max(2 * new_capacity, capacity if not new_capacity else 0, 16)

        def grown(old: list, count: int, heads: int, width: int, dtype) -> list:
            out = []
            for layer in range(count):
                buffer = torch.zeros((new_slots, heads, new_capacity + 1, width), dtype=dtype, device=self.device)
                if self.slots:
                    buffer[: self.slots, :, : self.capacity] = old[layer][:, :, : self.capacity]
                out.append(buffer)
            return out

        self.keys = grown(self.keys, self.layers, self.kv_heads, self.head_dim, self.dtype)
        self.values = grown(self.values, self.layers, self.kv_heads, self.head_dim, self.dtype)
        self.routes = grown(self.routes, self.route_layers, 1, self.topk, self.route_dtype)
        self.slots, self.capacity = new_slots, new_capacity
        return True

    @property
    def scratch(self) -> int:
        """The column padding writes into."""
        return self.capacity

    def copy_prefix(self, sources, targets, length: int) -> None:
        """Slots ``targets`` get the first ``length`` columns of slots ``sources`` (a shared prompt)."""
        # (index_select + index_copy_: half the time of [] indexing)
        for buffer in (*self.keys, *self.values, *self.routes):
            columns = buffer.narrow(2, 0, length)
            columns.index_copy_(0, targets, columns.index_select(0, sources))

    def release(self) -> None:
        self.keys, self.values, self.routes = [], [], []
        self.slots = self.capacity = 0


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function over a :class:`SlotCache` (``slot_pass`` keyword).

    :param query: ``[B, H, q, D]``; :param key: and :param value: ``[B, H_kv, q, D]``
        (rotary already applied).
    :returns: ``(output [B, q, H, D], None)``, as transformers' attention functions do.
    """
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    step: SlotPass | None = kwargs.get("slot_pass")
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    cache, layer = step.cache, module.layer_idx
    k_buf, v_buf = cache.keys[layer], cache.values[layer]
    if step.kernel and step.causal is None:
        from .decode_kernels import decode_attention

        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = decode_attention(_last_contiguous(query), _last_contiguous(key), _last_contiguous(value), k_buf, v_buf,
                               step.columns[:, 0], scale)
        return out, None
    slots = step.rows[:, None]
    k_buf[slots, :, step.columns] = key.transpose(1, 2)
    v_buf[slots, :, step.columns] = value.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if step.causal is not None:
        out = prefill_attention(query, key, value, step.causal, scaling, cuda=query.device.type == "cuda")
        return out.transpose(1, 2).contiguous(), None
    batch, heads, _, dim = query.shape
    keys, values = k_buf[:batch, :, : step.width], v_buf[:batch, :, : step.width]
    # one query token: the query heads sharing a key/value head become that head's query rows
    # (head h uses key/value head h // (heads / kv_heads), as transformers' repeat_kv), so the
    # cache is read once per key/value head instead of being repeated for every query head
    folded = query.reshape(batch, keys.shape[1], heads // keys.shape[1], dim)
    if query.device.type == "cpu":
        # two batched products and a softmax: for so few query rows this is faster on CPU than sdpa's kernel
        scores = torch.matmul(folded * (dim**-0.5 if scaling is None else scaling), keys.transpose(-1, -2))
        out = torch.matmul(scores.masked_fill(~step.visible, float("-inf")).softmax(-1), values)
    else:
        out = sdpa(folded, keys, values, attn_mask=step.visible, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def _last_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def prefill_attention(query, key, value, mask, scaling, *, cuda: bool):
    """Attention of a prefill pass: ``query [B, H, q, D]``, ``key`` and ``value [B, H_kv, q, D]``, boolean
    ``mask [B, 1, q, q]`` (True = attend); returns ``[B, H, q, D]``.

    On CUDA the key/value heads are repeated to the query heads (query head ``h`` reads key/value head
    ``h // (H / H_kv)``, as transformers' ``repeat_kv``) and torch's memory-efficient kernel is asked for
    first: it takes any mask but not grouped heads, and without the repeat torch chose cuDNN, whose call took
    86 ms of host time with the GPU idle before a 256 x 128-token prefill on an H100 (most likely its plan for
    each new shape; prefill shapes change with every admission). cuDNN, then the math kernel, stay as
    fallbacks. Elsewhere ``scaled_dot_product_attention`` with ``enable_gqa``.
    """
    import torch

    sdpa = torch.nn.functional.scaled_dot_product_attention
    groups = query.shape[1] // key.shape[1]
    if not cuda:
        return sdpa(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    order = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    try:
        backends = sdpa_kernel(order, set_priority=True)
    except TypeError:  # a torch without priorities: the three enabled, in torch's own order
        backends = sdpa_kernel(order)
    with backends:
        return sdpa(query, key, value, attn_mask=mask, scale=scaling)


def use_slot_attention(model) -> None:
    """Register :func:`slot_attention` with transformers and switch ``model`` to it."""
    from transformers import AttentionInterface

    import torch

    # never traced by torch.compile (--embedded-torch-compile compiles the layers around it)
    AttentionInterface.register(ATTENTION_NAME, torch.compiler.disable(slot_attention))
    try:
        model.set_attn_implementation(ATTENTION_NAME)
    except (AttributeError, ValueError):
        model.config._attn_implementation = ATTENTION_NAME
