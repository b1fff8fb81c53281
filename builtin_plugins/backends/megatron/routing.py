"""Routing replay for mixture-of-experts models, through megatron-core's own ``RouterReplay``
(``moe_enable_routing_replay``): each router records its top-k experts, or takes given ones instead of its own.

Routing is kept per sample as int64 ``[len(tokens) - 1, moe_layers, topk]`` (``Sample.rollout_routed_experts``'
layout: row ``t`` is the routing of input position ``t``). A micro-batch's routers see its tokens in the
order of the decoder's ``[s, b, h]`` input flattened to ``[s * b]`` (position-major when right-padded,
the packed order when packed; this rank's chunks under context parallelism): :func:`token_positions` maps
that order to ``(sample, position)``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["RoutingReplay", "token_positions"]


def token_positions(tokens: Sequence[Any], response_lengths: Sequence[int], packed: bool,
                    sequence_parallel: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sample, position)``, int64 ``[N]`` each, of the ``N`` tokens a micro-batch's routers see on this rank
    (this context-parallel rank's chunks; the whole sequence-parallel share before :meth:`RoutingReplay._share`),
    in their order; ``-1`` for pad positions.

    Each token's ``(sample, position)`` is written as one code in place of its id and laid out by
    :func:`~.logprobs.micro_batch_inputs` itself (padding, packing, context-parallel chunks), then read in the
    decoder's ``[s, b]`` order, so the routing and the model's input cannot disagree.

    :param tokens: the micro-batch's sequences; ``response_lengths``, ``packed``, ``sequence_parallel``: as
        :func:`~.logprobs.micro_batch_inputs` gets them.
    """
    from .logprobs import micro_batch_inputs

    width = max(len(t) for t in tokens) + 1  # code = 1 + sample * width + position; 0 is padding
    codes = [1 + i * width + torch.arange(len(t)) for i, t in enumerate(tokens)]
    grid = micro_batch_inputs(codes, response_lengths, "cpu", packed=packed, sequence_parallel=sequence_parallel).ids
    order = grid.cpu().t().reshape(-1)  # [B, L] -> the decoder's [L, B], position-major
    real = order > 0
    return torch.where(real, (order - 1) // width, -1), torch.where(real, (order - 1) % width, -1)


class RoutingReplay:
    """The ``RouterReplay`` of every MoE layer of one GPTModel, driven one micro-batch forward at a time.

    :meth:`replay` makes the routers take given experts; :meth:`record` makes them keep their own choice
    for :meth:`recorded`; :meth:`own_choice` additionally computes each router's own top-k while it replays
    (the disagreement metric). :meth:`finish` returns the routers to their own routing.

    Under sequence parallelism (``sp_group``: the tensor-parallel group) each TP rank's routers see their
    share of the ``N`` tokens, the contiguous ``N / TP`` of rank ``r`` (the decoder's ``[s, b]`` order split
    along ``s``): the methods take every token's ``(sample, position)`` and keep this rank's; :meth:`recorded`
    gathers the shares. On a pipeline stage (``pp_group``) the routers are the stage's MoE layers, columns
    :attr:`columns` of the routing's ``L`` (the model's MoE layers in order, ``moe_layers``): the methods take
    every layer's routing and use those columns; :meth:`recorded` fills the other columns with -1 and
    :meth:`merge_stages`, once the pipeline schedule is done, fills them from the other stages. Under context
    parallelism (``cp_group``) each rank routes its chunks of every sequence (:func:`token_positions` gives
    their ``(sample, position)``); :meth:`recorded` gathers the ranks' chunks.
    """

    def __init__(self, model, moe_layers: Sequence[int] = (), sp_group=None, pp_group=None, cp_group=None) -> None:
        layers = [layer for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
        self.routers = [layer.mlp.router for layer in layers]
        order = sorted(moe_layers) or list(range(len(layers)))
        # megatron-core numbers layers from 1 across the stages (its layer offset)
        self.columns = [order.index(layer.layer_number - 1) for layer in layers] if moe_layers else order
        self.width = len(order)
        self._own: list = []
        self._hooks: list = []
        self._sp_group = sp_group
        self._pp_group = pp_group
        self._cp_group = cp_group

    def _share(self, *tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This TP rank's share of each ``[N]`` tensor (all of it without sequence parallelism)."""
        import torch.distributed as dist

        if self._sp_group is None:
            return tokens
        size, rank = dist.get_world_size(self._sp_group), dist.get_rank(self._sp_group)
        return tuple(t.chunk(size)[rank] for t in tokens)

    def replay(self, routing: Sequence[Any], samples: torch.Tensor, positions: torch.Tensor) -> None:
        """Route the next forward's tokens to ``routing[i][t]`` (sample ``i``, position ``t``; int ``[T_i - 1, L, k]``
        each); tokens with no row there (the last of a sample, pad positions) go to experts ``0 ... k - 1``, which
        change no log-prob (the last position predicts nothing; pads are never read).

        :param samples: ``[N]`` sample of each routed token (:func:`token_positions`); ``positions``: its position.
        """
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        samples, positions = self._share(samples, positions)
        k = self.routers[0].topk
        targets = torch.arange(k).repeat(len(samples), len(self.routers), 1)  # [N, L, k]
        for i, rows in enumerate(routing):
            rows = torch.as_tensor(rows, dtype=torch.int64)[:, self.columns]
            mine = (samples == i) & (positions >= 0) & (positions < len(rows))
            targets[mine] = rows[positions[mine]]
        for layer, router in enumerate(self.routers):
            router.router_replay.set_target_indices(targets[:, layer].contiguous().to(router.weight.device))
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def record(self) -> None:
        """Let the next forward's routers route by their own scores and keep their choice."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for router in self.routers:
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)

    def own_choice(self) -> None:
        """While the next forward replays, also compute each router's own top-k from its input (a pre-hook:
        megatron-core's gating ``input @ weight.T`` in the router's dtype; the top-k of the logits is that of the
        softmax scores) for :meth:`disagreement`."""
        self._own = [None] * len(self.routers)

        def hook(index):
            def pre(router, args):
                hidden = args[0].detach()
                dtype = torch.float32 if router.config.moe_router_dtype == "fp32" else (
                    torch.float64 if router.config.moe_router_dtype == "fp64" else hidden.dtype)
                logits = hidden.reshape(-1, hidden.shape[-1]).to(dtype) @ router.weight.detach().to(dtype).t()
                self._own[index] = logits.topk(router.topk, dim=-1).indices
            return pre

        self._hooks = [router.register_forward_pre_hook(hook(i)) for i, router in enumerate(self.routers)]

    def recorded(self, lengths: Sequence[int], samples: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Per sample, the experts the last recording forward chose: int64 ``[T_i - 1, L, k]`` on the host."""
        chosen = torch.stack([r.router_replay.get_recorded_indices() for r in self.routers], dim=1)
        if self._sp_group is not None:
            import torch.distributed as dist

            shares = [torch.empty_like(chosen) for _ in range(dist.get_world_size(self._sp_group))]
            dist.all_gather(shares, chosen.contiguous(), group=self._sp_group)
            chosen = torch.cat(shares)
        chosen = chosen.cpu()
        if self._cp_group is not None:  # every rank's chunks, with their (sample, position)
            import torch.distributed as dist

            size = dist.get_world_size(self._cp_group)
            parts = []
            for local in (chosen, samples, positions):
                every = [torch.empty_like(local) for _ in range(size)]
                dist.all_gather(every, local.contiguous(), group=self._cp_group)
                parts.append(torch.cat(every))
            chosen, samples, positions = parts
        if self.width != len(self.columns):  # a pipeline stage: the other stages' layers come in merge_stages
            whole = torch.full((chosen.shape[0], self.width, chosen.shape[2]), -1, dtype=chosen.dtype)
            whole[:, self.columns] = chosen
            chosen = whole
        return self._per_sample(chosen, lengths, samples, positions)

    def merge_stages(self, routing: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``routing`` (per sample, from :meth:`recorded`, in the same order on every stage) with every stage's
        columns filled in: a collective over the pipeline stages (each column is -1 on all stages but its own;
        one maximum over the stages). Not inside the schedule, where the stages wait on one another's sends."""
        import torch.distributed as dist

        if self._pp_group is None or not routing:
            return list(routing)
        flat = torch.cat([r.reshape(-1) for r in routing])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self._pp_group)
        return [part.reshape(r.shape) for part, r in zip(flat.split([r.numel() for r in routing]), routing)]

    def disagreement(self, routing: Sequence[Any], samples: torch.Tensor, positions: torch.Tensor) -> tuple[int, int]:
        """``(differing, compared)``: of the (token, layer) pairs with a row in ``routing``, how many had an own
        top-k set (:meth:`own_choice`) other than the replayed one; this TP rank's tokens only under sequence
        parallelism, this stage's layers only on a pipeline stage."""
        samples, positions = self._share(samples, positions)
        own = torch.stack([o.cpu() for o in self._own], dim=1).sort(dim=-1).values  # [N, L, k]
        differing = compared = 0
        for i, rows in enumerate(routing):
            rows = torch.as_tensor(rows, dtype=torch.int64)[:, self.columns]
            mine = (samples == i) & (positions >= 0) & (positions < len(rows))
            given = rows[positions[mine]].sort(dim=-1).values
            differing += int((own[mine] != given).any(dim=-1).sum())
            compared += given.shape[0] * given.shape[1]
        return differing, compared

    def finish(self) -> None:
        """Back to the routers' own routing; drop targets, recordings and hooks."""
        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._own = [], []

    @staticmethod
    def _per_sample(chosen, lengths, samples, positions) -> list[torch.Tensor]:
        out = []
        for i, n in enumerate(lengths):
            mine = (samples == i) & (positions >= 0) & (positions < n - 1)
            order = positions[mine].argsort()
            out.append(chosen[mine][order])
        return out
