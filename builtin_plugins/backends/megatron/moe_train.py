"""The mixture-of-experts parts of the megatron backend's passes: megatron-core's load-balancing loss in the
objective and its metric, the reduction of expert gradients under expert parallelism, and routing replay."""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["ExpertLayers", "aux_loss_value", "is_expert_parameter"]

# megatron-core's tracker name of each load-balancing type (router.py) and the flag its coefficient comes from
_TRACKED = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def is_expert_parameter(name: str) -> bool:
    """Whether parameter ``name`` belongs to one expert (held by one EP rank; its gradient is averaged over the
    expert-data-parallel ranks), not to the router or the dense layers."""
    return ".mlp.experts." in name


def aux_loss_value(config) -> float:
    """The load-balancing loss megatron-core's routers recorded since the tracker was last cleared, with its
    coefficients: ``sum_types coeff_type * sum_layers L_type(layer)``, summed over the micro-batches
    recorded (``L`` as ``switch_load_balancing_loss_func``: ``E / (k T^2) * sum_i (sum_x p_xi) (sum_x m_xi)``
    over a micro-batch's ``T`` tokens, ``p`` the softmax scores, ``m`` the top-k map; per sequence and averaged
    over sequences for ``seq_aux_loss``). Under sequence parallelism each TP rank's routers hold the terms of
    their share of the ``T`` tokens (the counts ``m`` are gathered) and each pipeline stage its layers' terms; the
    values are summed over the TP ranks and the stages.

    :param config: the megatron-core ``TransformerConfig`` (its types and coefficients).
    """
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    import torch.distributed as dist
    from megatron.core import parallel_state

    tracker = get_moe_layer_wise_logging_tracker()
    types = config.moe_router_load_balancing_type
    coeffs = config.moe_aux_loss_coeff
    types, coeffs = ([types], [coeffs]) if isinstance(types, str) else (list(types), list(coeffs))
    total = 0.0
    for kind, coeff in zip(types, coeffs):
        entry = tracker.get(_TRACKED.get(kind, ""))
        if entry is None:
            continue
        values, group = entry["values"].clone(), entry.get("reduce_group")
        if group is not None and dist.get_world_size(group) > 1:  # each TP rank's loss covers its share of the tokens
            dist.all_reduce(values, group=group)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # each stage holds its layers' values
            dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
        total += float(coeff) * float(values.sum())
    return total


class ExpertLayers:
    """Mixed into :class:`~.backend.MegatronBackend`: on a model with experts, each training step adds
    megatron-core's load-balancing loss to the objective and reports it, and forwards replay routing
    (:meth:`_routing`).

    The routers attach the loss to their outputs (``MoEAuxLossAutoScaler``), so its gradient joins the
    objective's in the backward pass, scaled by ``1 / (micro-batches of the step x data-parallel ranks)``:
    with gradients summed over the data-parallel ranks the step minimises the objective plus the mean
    over the step's micro-batches of the coefficient-weighted loss of every MoE layer (Megatron-LM's
    scaling: its mean over micro-batches, averaged over data-parallel ranks). ``moe_aux_loss`` in the step
    metrics is that mean (``train/moe_aux_loss``). The routers compute it in training mode only, so the backend
    puts the model in training mode during :meth:`train` (dropout is 0 here: the forward is unchanged).
    """

    # --- routing replay ---------------------------------------------------------------------------------------

    def _start_routing_replay(self) -> None:
        """Drive the actor's routers (:class:`~.routing.RoutingReplay`) under ``--use-routing-replay`` /
        ``--use-rollout-routing-replay`` on a model with experts (the reference model routes by itself)."""
        from .moe import replays_routing
        from .routing import RoutingReplay

        if self._moe() and replays_routing(self.config):
            from megatron.core import parallel_state

            self._replay = RoutingReplay(self.model, self.shape.moe_layers, self._sp_group(),
                                         parallel_state.get_pipeline_model_parallel_group() if self.pp > 1 else None,
                                         parallel_state.get_context_parallel_group() if self.cp > 1 else None)

    def _sp_group(self):
        """The tensor-parallel group under sequence parallelism (each TP rank routes its share of the tokens),
        else None."""
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group() if self._sequence_parallel() else None

    @contextlib.contextmanager
    def _routing(self, model, batch, ids: list[int], grad: bool, packed: bool):
        """Route one micro-batch forward of samples ``ids`` of ``batch``.

        Replayed, when every sample has routing: the engine's (``batch.routed_experts``,
        ``--use-rollout-routing-replay``; training forwards also count how often each router's own top-k differs
        from it, ``train/moe_routing_disagreement``), else the one the old-log-prob pass recorded for the same
        tokens (``--use-routing-replay``; also for a micro-batch with a sample the engine left without a record). Recorded, in a forward without grad (the old-log-prob pass) that has
        nothing to replay. Otherwise, and always for the reference model, the routers route by themselves.
        """
        replay = self._replay if model is self.model else None
        if replay is None:
            yield
            return
        from .routing import token_positions

        tokens = [batch.tokens[i] for i in ids]
        samples, positions = token_positions(tokens, [int(batch.response_lengths[i]) for i in ids], packed,
                                             self.tp if self._sequence_parallel() else 1)
        given = [batch.routed_experts[i] for i in ids] if batch.routed_experts is not None else None
        rollout = given is not None and all(r is not None for r in given)
        given = given if rollout else None
        if given is None and all(tuple(t) in self._recorded_routing for t in tokens):
            given = [self._recorded_routing[tuple(t)] for t in tokens]
        recording = given is None and not grad
        if given is not None:
            replay.replay(given, samples, positions)
            if grad and rollout:
                replay.own_choice()
        elif recording:
            replay.record()
        try:
            yield
            if recording:
                for t, routing in zip(tokens, replay.recorded([len(t) for t in tokens], samples, positions)):
                    self._recorded_routing[tuple(t)] = routing
                    self._unmerged.append(tuple(t))
            elif rollout and grad:
                differing, compared = replay.disagreement(given, samples, positions)
                self._disagreeing[0] += differing
                self._disagreeing[1] += compared
        finally:
            replay.finish()

    def _merge_stage_routing(self) -> None:
        """After a forward-only pass through the pipeline schedule: complete the routing each stage recorded for its
        layers with the other stages' (:meth:`~.routing.RoutingReplay.merge_stages`, a collective)."""
        if self._replay is None or not self._unmerged:
            return
        keys, self._unmerged = self._unmerged, []
        for key, routing in zip(keys, self._replay.merge_stages([self._recorded_routing[k] for k in keys])):
            self._recorded_routing[key] = routing

    def _disagreement_share(self) -> float:
        """This rank's share of the step's routing disagreement: its differing (token, layer) pairs over the
        pairs compared on every data-parallel rank (the core sums the shares); this rank's counts are its TP
        group's under sequence parallelism (each TP rank compares its share of the tokens), its pipeline's
        (each stage compares its layers) and its context-parallel group's (each rank its chunks)."""
        import torch
        import torch.distributed as dist

        counts = torch.tensor(self._disagreeing, dtype=torch.float64, device=self.device)
        if self._sp_group() is not None:
            dist.all_reduce(counts, group=self._sp_group())
        from megatron.core import parallel_state

        if self.pp > 1:  # each stage compares its layers
            dist.all_reduce(counts, group=parallel_state.get_pipeline_model_parallel_group())
        if self.cp > 1:  # each context-parallel rank its chunks of the tokens
            dist.all_reduce(counts, group=parallel_state.get_context_parallel_group())
        if self._dp_size() > 1:
            compared = counts[1:].clone()
            dist.all_reduce(compared, group=self._dp_group())
            counts[1] = compared[0]
        self._disagreeing = [0, 0]
        return float(counts[0] / counts[1]) if counts[1] else 0.0

    # --- load-balancing loss ----------------------------------------------------------------------------------

    def _moe(self) -> bool:
        return bool(self.shape is not None and self.shape.is_moe)

    def _aux_loss_on(self) -> bool:
        config = self.model.config
        coeffs = config.moe_aux_loss_coeff
        return self._moe() and any(float(c) for c in (coeffs if isinstance(coeffs, list) else [coeffs]))

    async def _train_step(self, batch, micro_batches) -> tuple[dict, bool]:
        aux = self._aux_loss_on()
        if aux:
            await self._in_thread(self._start_aux_loss, len(micro_batches))
        sums, finite = await super()._train_step(batch, micro_batches)
        if aux:
            share = await self._in_thread(aux_loss_value, self.model.config)
            sums = {**sums, "moe_aux_loss": share / (len(micro_batches) * self._dp_size())}
        if self._replay is not None and batch.routed_experts is not None:
            sums = {**sums, "moe_routing_disagreement": await self._in_thread(self._disagreement_share)}
        return sums, finite

    def _start_aux_loss(self, micro_batches: int) -> None:
        import torch
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, clear_aux_losses_tracker

        clear_aux_losses_tracker()
        MoEAuxLossAutoScaler.set_loss_scale(
            torch.tensor(1.0 / (micro_batches * self._dp_size()), dtype=torch.float32, device=self.device))

    def _expert_grads(self, named: list[tuple[str, Any]]) -> None:
        """Sum expert gradients over the expert-data-parallel ranks (those holding the same experts: the data-parallel
        and, experts being whole on every TP rank, the tensor-parallel ranks of this EP rank)."""
        if not named:
            return
        import torch.distributed as dist
        from megatron.core import parallel_state

        group = parallel_state.get_expert_data_parallel_group()
        if dist.get_world_size(group) > 1:
            for _, p in named:
                dist.all_reduce(p.grad, group=group)
