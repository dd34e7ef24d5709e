"""Prepare/finalize for one rank with no EP/DP token movement, in both activation formats.

Prepare applies the router weight to the input (top-1 only), maps global expert
ids to local ones when an ``expert_map`` is given (slots of other ranks' experts
become -1), and quantizes with the experts' quantizer. The Standard variant hands
the rows over as they are; the Batched one packs them per local expert, as
vLLM's ``BatchedPrepareAndFinalize`` does, and keeps the layout to scatter back.
Finalize applies the router weights and sums over top-k unless the experts did.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.kernels.grouping import ExpertGroups, group_by_expert, local_expert_ids, num_local_experts
from moe_fsm.modular.interfaces import ActivationFormat, InputQuantizer, PrepareFinalize, PreparedTokens, WeightAndReduce
from moe_fsm.prepare_finalize.reduce import (
    BatchedLayout,
    apply_router_weight_to_input,
    reduce_batched,
    reduce_standard,
    require_batched_reduce,
)


def _input_rows(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    apply_router_weight_on_input: bool,
    quantize: Optional[InputQuantizer],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    hidden = apply_router_weight_to_input(hidden_states, topk_weights) if apply_router_weight_on_input else hidden_states
    return quantize(hidden) if quantize is not None else (hidden, None)


class LocalPrepareFinalize(PrepareFinalize):
    """Standard format, tokens stay where they are."""

    name = "LocalPrepareFinalize"
    host_sync_free = True  # the expert-map lookup and finalize's copy or sum are device operations

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.STANDARD

    def prepare(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        num_experts: int,
        expert_map: Optional[torch.Tensor],
        apply_router_weight_on_input: bool,
        quantize: Optional[InputQuantizer],
    ) -> PreparedTokens:
        hidden, scale = _input_rows(hidden_states, topk_weights, apply_router_weight_on_input, quantize)
        return PreparedTokens(hidden=hidden, scale=scale, topk_ids=local_expert_ids(topk_ids, expert_map), topk_weights=topk_weights)

    def finalize(
        self,
        output: torch.Tensor,
        expert_output: torch.Tensor,
        prepared: PreparedTokens,
        *,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        reduce: WeightAndReduce,
    ) -> None:
        reduce_standard(reduce, output, expert_output, topk_weights, apply_router_weight_on_input=apply_router_weight_on_input)


def pack_rows(rows: torch.Tensor, groups: ExpertGroups, max_tokens: int) -> torch.Tensor:
    """Per-token rows ``[M, ...]`` to per-expert batches ``[E_local, max_tokens, ...]``, zero-padded."""
    packed = torch.zeros((groups.num_experts, max_tokens, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    packed[groups.expert, groups.position] = rows[groups.token]
    return packed


def pack_scale(scale: Optional[torch.Tensor], groups: ExpertGroups, max_tokens: int) -> Optional[torch.Tensor]:
    """Row-wise (2-D) scales travel with their rows; a shared scale stays as it is."""
    if scale is None or scale.dim() < 2:
        return scale
    return pack_rows(scale, groups, max_tokens)


class LocalBatchedPrepareFinalize(PrepareFinalize):
    """Batched format: rows packed per local expert, ``max_num_tokens`` rows each.

    ``max_num_tokens`` is the per-expert capacity (vLLM's ``max_num_tokens``); None
    sizes each call to its busiest expert. A call that needs more raises.
    """

    name = "LocalBatchedPrepareFinalize"

    def __init__(self, max_num_tokens: Optional[int] = None) -> None:
        if max_num_tokens is not None and (isinstance(max_num_tokens, bool) or not isinstance(max_num_tokens, int) or max_num_tokens < 1):
            raise KernelInputError(f"max_num_tokens must be a positive integer or None; got {max_num_tokens!r}")
        self.max_num_tokens = max_num_tokens

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.BATCHED

    def _capacity(self, groups: ExpertGroups) -> int:
        busiest = groups.max_count
        if self.max_num_tokens is None:
            return busiest
        if busiest > self.max_num_tokens:
            raise KernelInputError(
                f"an expert received {busiest} tokens, more than this prepare/finalize's max_num_tokens={self.max_num_tokens}"
            )
        return self.max_num_tokens

    def prepare(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        num_experts: int,
        expert_map: Optional[torch.Tensor],
        apply_router_weight_on_input: bool,
        quantize: Optional[InputQuantizer],
    ) -> PreparedTokens:
        hidden, scale = _input_rows(hidden_states, topk_weights, apply_router_weight_on_input, quantize)
        local_ids = local_expert_ids(topk_ids, expert_map)
        groups = group_by_expert(local_ids, num_local_experts(num_experts, expert_map))
        capacity = self._capacity(groups)
        layout = BatchedLayout(token=groups.token, slot=groups.slot, expert=groups.expert, position=groups.position)
        return PreparedTokens(
            hidden=pack_rows(hidden, groups, capacity),
            scale=pack_scale(scale, groups, capacity),
            topk_ids=local_ids,
            topk_weights=topk_weights,
            expert_num_tokens=groups.counts.to(torch.int32),
            state=layout,
        )

    def finalize(
        self,
        output: torch.Tensor,
        expert_output: torch.Tensor,
        prepared: PreparedTokens,
        *,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        reduce: WeightAndReduce,
    ) -> None:
        require_batched_reduce(reduce)
        reduce_batched(output, expert_output, prepared.state, topk_weights, apply_router_weight_on_input=apply_router_weight_on_input)
