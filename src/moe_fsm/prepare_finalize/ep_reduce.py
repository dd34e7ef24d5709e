"""Expert parallelism without data parallelism: same tokens everywhere, own experts, all-reduce.

In vLLM, EP without DP means the experts are spread over the tensor-parallel
ranks, which all hold the same tokens: nothing is dispatched
(``use_all2all_kernels`` is false), each rank runs the local no-EP
prepare/finalize with its expert map, computing only the slots of its own
experts, and the layer's ``reduce_results`` all-reduces the partial outputs
afterwards. moe-fsm puts that all-reduce into finalize, so the modular kernel
returns the layer's full output on every rank like every other P/F here.

The all-reduce runs in float32 (the local partials are widened first) so the
sum over ranks is as exact as the other P/Fs' float32 sums, at twice the bytes
of a bf16 all-reduce.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from moe_fsm.distributed.expert_map import ExpertPlacement
from moe_fsm.distributed.group import group_rank_and_size
from moe_fsm.errors import KernelInputError
from moe_fsm.modular.interfaces import ActivationFormat, InputQuantizer, PrepareFinalize, PreparedTokens, WeightAndReduce
from moe_fsm.prepare_finalize.transport import PlacementGuard, local_prepare_finalize


class ExpertParallelReducePrepareFinalize(PrepareFinalize):
    """Local prepare with the expert map; finalize sums every rank's partial output (all-reduce)."""

    name = "ExpertParallelReducePrepareFinalize"

    def __init__(
        self,
        placement: ExpertPlacement,
        *,
        activation_format: ActivationFormat = ActivationFormat.STANDARD,
        group: Optional[dist.ProcessGroup] = None,
        max_num_tokens: Optional[int] = None,
    ) -> None:
        self.placement = placement
        self._format = ActivationFormat(activation_format)
        self.group = group
        self.local = local_prepare_finalize(self._format, max_num_tokens)
        self._guard = PlacementGuard(placement, self.name)

    @property
    def activation_format(self) -> ActivationFormat:
        return self._format

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
        rank, world = group_rank_and_size(self.group)
        if (rank, world) != (self.placement.rank, self.placement.world_size):
            raise KernelInputError(
                f"{self.name} was built for rank {self.placement.rank} of {self.placement.world_size}, "
                f"but runs as rank {rank} of {world}"
            )
        self._guard(expert_map)
        return self.local.prepare(
            hidden_states,
            topk_weights,
            topk_ids,
            num_experts=num_experts,
            expert_map=expert_map,
            apply_router_weight_on_input=apply_router_weight_on_input,
            quantize=quantize,
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
        partial = torch.empty(output.shape, dtype=torch.float32, device=output.device)
        self.local.finalize(
            partial,
            expert_output,
            prepared,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            apply_router_weight_on_input=apply_router_weight_on_input,
            reduce=reduce,
        )
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self.group)
        output.copy_(partial)
