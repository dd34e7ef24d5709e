"""Data-parallel prepare/finalize: all-gather the tokens, reduce-scatter the results.

As vLLM's naive DP path and FlashInfer's all-gather P/F do: every rank
gathers every rank's tokens (quantized activations, their row-wise scales, top-k
ids and weights side by side in one byte row, so one all-gather moves them all), computes its share of all of them,
and a reduce-scatter sums the shares and hands each rank back its own tokens.

What "its share" is depends on expert parallelism:

* DP without EP: vLLM flattens tensor parallelism across the DP ranks, so each
  rank holds every expert's slice of the intermediate dimension
  (:func:`moe_fsm.distributed.shard_intermediate`) and computes a partial sum
  for every slot; the kernel is called with no expert map.
* DP with EP (``all2all=allgather_reducescatter``): each rank holds whole experts
  and the kernel's expert map turns other ranks' slots into -1, so each rank
  computes only its own experts' slots.

Either way the per-rank results are partial sums, which the reduce-scatter adds
up. Ranks may hold different numbers of tokens, including none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from moe_fsm.distributed.collectives import all_gather_ints, all_gather_v, pack_row_bytes, reduce_scatter_v, unpack_row_bytes
from moe_fsm.distributed.group import group_rank_and_size
from moe_fsm.modular.interfaces import ActivationFormat, InputQuantizer, PrepareFinalize, PreparedTokens, WeightAndReduce
from moe_fsm.prepare_finalize.transport import (
    check_row_layouts,
    layout_signature,
    local_prepare_finalize,
    receiving_quantizer,
    source_rows,
)


@dataclass(frozen=True)
class GatherState:
    """What finalize needs: every rank's token count and the local P/F's prepared tokens.

    ``row_bytes`` is the width of one gathered row on the wire (payload plus scale, ids, weights, padding).
    """

    sizes: tuple[int, ...]
    row_bytes: int
    local: PreparedTokens


class AllGatherReduceScatterPrepareFinalize(PrepareFinalize):
    """All-gather-v before the experts, reduce-scatter-v after, over ``group`` (default: world).

    ``quantize_first``: quantize on the source rank and gather the quantized bytes
    (see :func:`moe_fsm.prepare_finalize.transport.quantize_before_communication`);
    False gathers the layer dtype and quantizes the gathered rows.
    ``max_num_tokens``: per-expert capacity of the batched format (None: as needed).
    """

    name = "AllGatherReduceScatterPrepareFinalize"

    def __init__(
        self,
        *,
        activation_format: ActivationFormat = ActivationFormat.STANDARD,
        group: Optional[dist.ProcessGroup] = None,
        quantize_first: bool = True,
        max_num_tokens: Optional[int] = None,
    ) -> None:
        self._format = ActivationFormat(activation_format)
        self.group = group
        self.quantize_first = quantize_first
        self.local = local_prepare_finalize(self._format, max_num_tokens)

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
        group_rank_and_size(self.group)
        source = source_rows(
            hidden_states,
            topk_weights,
            apply_router_weight_on_input=apply_router_weight_on_input,
            quantize=quantize,
            quantize_first=self.quantize_first,
        )
        packed, layout = pack_row_bytes(source.wire_fields(topk_ids, topk_weights))
        signature = layout_signature(layout)
        records = all_gather_ints([source.payload.shape[0], *signature], group=self.group, device=hidden_states.device)
        check_row_layouts([r[1:] for r in records], signature, self.name)
        sizes = tuple(r[0] for r in records)
        gathered = all_gather_v(packed, sizes, group=self.group)
        rows, row_scale, ids, weights = source.from_wire(unpack_row_bytes(gathered, layout))
        local = self.local.prepare(
            rows,
            weights,
            ids,
            num_experts=num_experts,
            expert_map=expert_map,
            apply_router_weight_on_input=False,  # applied on the source rank, before quantizing
            quantize=receiving_quantizer(rows, source, row_scale, quantize),
        )
        return PreparedTokens(
            hidden=local.hidden,
            scale=local.scale,
            topk_ids=local.topk_ids,
            topk_weights=local.topk_weights,
            expert_num_tokens=local.expert_num_tokens,
            state=GatherState(sizes, layout.row_bytes, local),
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
        """Weight and reduce every gathered token's share here, then sum the shares and keep our tokens."""
        state: GatherState = prepared.state
        partial = output.new_empty((sum(state.sizes), output.shape[1]))
        self.local.finalize(
            partial,
            expert_output,
            state.local,
            topk_weights=state.local.topk_weights,
            topk_ids=state.local.topk_ids,
            apply_router_weight_on_input=apply_router_weight_on_input,
            reduce=reduce,
        )
        output.copy_(reduce_scatter_v(partial, list(state.sizes), group=self.group))
