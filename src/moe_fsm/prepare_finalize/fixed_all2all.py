"""Fixed-capacity expert-parallel all-to-all: batched experts, no host synchronisation, CUDA-graph capturable.

The low-latency dispatch of vLLM's batched-format backends (DeepEP low-latency,
pplx) sizes every buffer for at most ``max_tokens_per_rank`` tokens per rank,
fixed when the layer is built, so that no call needs to know how many rows
another rank sends. This is that design on ``all_to_all_single`` with equal
splits:

* dispatch: every rank sends every other rank a block of ``max_tokens_per_rank``
  packed rows (payload, row scale, top-k ids, top-k weights); the rows a rank's
  tokens do not fill are copies of the empty row, whose ids are all -1, so no
  expert computes them and no counts need to travel;
* the receiving rank maps the ids to its local experts and scatters each pair
  into the experts' slabs ``[E_local, W * max_tokens_per_rank, K]`` (a token names
  an expert once, so no expert receives more than that), with the per-expert
  counts left on the device;
* combine: per received row, the weighted sum of its slots' expert rows; the
  partial rows go back by the reverse all-to-all (equal splits again) and are
  added into their tokens.

Every tensor's size depends only on the build-time capacity, so one call is a
fixed sequence of kernels and two collectives, which a CUDA graph can capture
and replay with new tokens and routings. The price is bandwidth and memory for
the unused capacity: a rank that holds fewer tokens still sends full blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from moe_fsm.distributed.collectives import all_to_all_equal, unpack_row_bytes
from moe_fsm.distributed.expert_map import ExpertPlacement
from moe_fsm.errors import KernelInputError
from moe_fsm.kernels.grouping import local_expert_ids
from moe_fsm.modular.interfaces import ActivationFormat, InputQuantizer, PreparedTokens, WeightAndReduce
from moe_fsm.prepare_finalize.all2all import ExpertParallelDispatch
from moe_fsm.prepare_finalize.dispatch_layout import Slabs, slabs_for
from moe_fsm.prepare_finalize.reduce import require_batched_reduce
from moe_fsm.prepare_finalize.wire_kernels import combine_returned, kernels_apply, send_rows, slab_layout

# vLLM's default batch for batched-format DP dispatch (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS_FOR_BATCHED_DP).
DEFAULT_MAX_TOKENS_PER_RANK = 256


@dataclass(frozen=True)
class FixedDispatchState:
    """What finalize needs: each token's send (and return) rows, and where each received pair sits.

    ``row_bytes`` is the width of one dispatched row on the wire (payload plus scale, ids, weights, padding).
    """

    slot: torch.Tensor  # [M, W] the send (and return) row of token t for rank d; W * capacity where t does not go to d
    slabs: Slabs
    row_bytes: int


class FixedCapacityAllToAllPrepareFinalize(ExpertParallelDispatch):
    """EP dispatch/combine in the Batched format with fixed-size buffers and equal-split ``all_to_all_single``.

    ``max_tokens_per_rank``: the most tokens any rank passes in one call (a call with
    more raises; vLLM chunks its batches to this size). Each local expert's slab
    holds ``world_size * max_tokens_per_rank`` rows.
    """

    name = "FixedCapacityAllToAllPrepareFinalize"
    captures_in_step = True  # equal splits, slabs of the build-time capacity, counts left on the device

    def __init__(
        self,
        placement: ExpertPlacement,
        *,
        max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK,
        group: Optional[dist.ProcessGroup] = None,
        quantize_first: bool = True,
    ) -> None:
        if isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1:
            raise KernelInputError(f"max_tokens_per_rank must be a positive integer; got {max_tokens_per_rank!r}")
        super().__init__(placement, group=group, quantize_first=quantize_first)
        self.max_tokens_per_rank = max_tokens_per_rank

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.BATCHED

    @property
    def expert_capacity(self) -> int:
        """Rows of each local expert's slab: every rank's every token may pick the expert."""
        return self.placement.world_size * self.max_tokens_per_rank

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
        world = self._check_call(num_experts, expert_map)
        num_tokens, capacity = hidden_states.shape[0], self.max_tokens_per_rank
        if num_tokens > capacity:
            raise KernelInputError(
                f"{self.name} was built for at most {capacity} tokens per rank (max_tokens_per_rank) but was "
                f"called with {num_tokens}; split the batch or build it with a larger capacity"
            )
        source, packed, plan = self._source(
            hidden_states, topk_weights, topk_ids, apply_router_weight_on_input=apply_router_weight_on_input, quantize=quantize,
            buffers=self._buffers,
        )
        layout = packed.layout
        self._agree_on_layout(plan.signature, hidden_states.device)
        routes = self._routes(topk_ids, world, capacity)
        # The rows past each rank's count hold the empty row.
        send = send_rows(packed, routes.slot, world * capacity, counts=routes.counts, capacity=capacity,
                         buffers=self._buffers)
        wire = all_to_all_equal(send, group=self.group, world=world)
        rows, row_scale, ids, weights = source.from_wire(unpack_row_bytes(wire, layout))
        if not source.quantized and quantize is not None:
            rows, row_scale = quantize(rows)  # the empty rows are zeros: a per-tensor amax does not see them
        elif source.quantized and row_scale is None:
            row_scale = source.shared_scale
        num_local = self.placement.num_local_experts
        if kernels_apply(ids):
            # The local ids, each pair's slab row and the per-expert counts in one kernel.
            local_ids, flat, counts = slab_layout(ids, self._local_map(expert_map), num_local, self.expert_capacity)
            slabs = Slabs(flat, counts, num_local, self.expert_capacity)
        else:
            local_ids = local_expert_ids(ids, expert_map)
            slabs = slabs_for(local_ids, num_local, self.expert_capacity)
        return PreparedTokens(
            hidden=slabs.scatter(rows),
            scale=slabs.scatter(row_scale),
            topk_ids=local_ids,
            topk_weights=weights,
            expert_num_tokens=slabs.counts,
            state=FixedDispatchState(routes.slot, slabs, layout.row_bytes),
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
        """Weighted sums of our experts' rows per received row, sent back in equal blocks and added into each token."""
        require_batched_reduce(reduce)
        state: FixedDispatchState = prepared.state
        weights = None if apply_router_weight_on_input else prepared.topk_weights
        partial = state.slabs.reduce(expert_output, weights, output.dtype)
        returned = all_to_all_equal(partial, group=self.group, world=self.placement.world_size)  # checked by prepare
        combine_returned(output, returned, state.slot)
