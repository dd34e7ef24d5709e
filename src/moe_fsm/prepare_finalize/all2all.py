"""Expert-parallel prepare/finalize: all-to-all dispatch to the experts' owners, all-to-all combine back.

Dispatch: every (token, expert) pair must reach the rank that owns the expert
(:class:`ExpertPlacement`). A token whose top-k experts live on several ranks
goes to each of them once, carrying all its top-k ids and weights; the
receiving rank's expert map turns the ids it does not own into -1, so the
experts compute exactly the pairs they own. (Sending one row per pair would
send a token twice to a rank owning two of its experts; one row per
(token, rank) is what DeepEP's high-throughput dispatch does, and it carries
every pair all the same.) The number of rows for each destination is exchanged
first, then ``all_to_all_single`` moves the rows: the (quantized) payload as it
is, and the row-wise scales, top-k ids and weights packed into one byte row.

Combine: each rank weights and sums its own experts' slots per received row
(the local finalize), sends the partial rows back with the reverse splits, and
the source rank adds them into its tokens in their original order. Ranks may
hold any number of tokens, including none, and experts may receive none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from moe_fsm.distributed.collectives import all_to_all_v, exchange_counts, pack_row_bytes, unpack_row_bytes, wire_view
from moe_fsm.distributed.expert_map import ExpertPlacement
from moe_fsm.distributed.group import group_rank_and_size
from moe_fsm.errors import KernelInputError
from moe_fsm.modular.interfaces import ActivationFormat, InputQuantizer, PrepareFinalize, PreparedTokens, WeightAndReduce
from moe_fsm.prepare_finalize.transport import (
    PlacementGuard,
    check_row_layouts,
    local_prepare_finalize,
    receiving_quantizer,
    source_rows,
)


@dataclass(frozen=True)
class DispatchState:
    """How the rows went out, so they can come back: source token of each sent row, the splits.

    ``row_bytes`` is the width of one dispatched row on the wire (payload plus packed scales, ids, weights).
    """

    token: torch.Tensor  # [S] this rank's token index of each row sent, grouped by destination
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    row_bytes: int
    local: PreparedTokens


def destinations(topk_ids: torch.Tensor, owner: torch.Tensor, world_size: int) -> torch.Tensor:
    """bool [M, W]: token t must go to rank d (it routes at least one slot to an expert d owns)."""
    ids = topk_ids.long()
    ranks = torch.where(ids >= 0, owner[ids.clamp(min=0)], torch.full_like(ids, -1))
    return (ranks.unsqueeze(-1) == torch.arange(world_size, device=ids.device)).any(dim=1)


class AllToAllPrepareFinalize(PrepareFinalize):
    """EP dispatch/combine with ``all_to_all_single`` over ``group``, Standard or Batched format.

    ``placement`` says which experts each rank owns; the kernel must be called with
    ``expert_map=placement.expert_map()`` and the local experts' weights.
    ``quantize_first`` and ``max_num_tokens`` as in the all-gather P/F.
    """

    name = "AllToAllPrepareFinalize"

    def __init__(
        self,
        placement: ExpertPlacement,
        *,
        activation_format: ActivationFormat = ActivationFormat.STANDARD,
        group: Optional[dist.ProcessGroup] = None,
        quantize_first: bool = True,
        max_num_tokens: Optional[int] = None,
    ) -> None:
        self.placement = placement
        self._format = ActivationFormat(activation_format)
        self.group = group
        self.quantize_first = quantize_first
        self.local = local_prepare_finalize(self._format, max_num_tokens)
        self._guard = PlacementGuard(placement, self.name)
        self._owner: dict[torch.device, torch.Tensor] = {}

    @property
    def activation_format(self) -> ActivationFormat:
        return self._format

    def _owner_table(self, device: torch.device) -> torch.Tensor:
        if device not in self._owner:
            self._owner[device] = self.placement.owner_table(device)
        return self._owner[device]

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
        placement = self.placement
        if (rank, world, num_experts) != (placement.rank, placement.world_size, placement.num_experts):
            raise KernelInputError(
                f"{self.name} was built for rank {placement.rank} of {placement.world_size} with "
                f"{placement.num_experts} experts, but runs as rank {rank} of {world} with {num_experts}"
            )
        self._guard(expert_map)
        device = hidden_states.device
        source = source_rows(
            hidden_states,
            topk_weights,
            apply_router_weight_on_input=apply_router_weight_on_input,
            quantize=quantize,
            quantize_first=self.quantize_first,
        )
        dest = destinations(topk_ids, self._owner_table(device), world)
        # Rows grouped by destination rank, tokens in order within each group.
        dest_rank, token = dest.t().nonzero(as_tuple=True)
        send_counts = torch.bincount(dest_rank, minlength=world)

        payload = wire_view(source.payload).index_select(0, token)  # gathers run on bytes for float8
        meta, layout = pack_row_bytes(source.metadata(topk_ids, topk_weights))
        meta = meta.index_select(0, token)
        widths = (source.payload_row_bytes, layout.row_bytes)
        records = torch.stack([send_counts, *(torch.full_like(send_counts, w) for w in widths)], dim=1)
        received = exchange_counts(records, group=self.group).tolist()
        check_row_layouts([r[1:] for r in received], widths, self.name)
        send = tuple(int(c) for c in send_counts.tolist())
        recv = tuple(int(r[0]) for r in received)

        rows = all_to_all_v(payload, send, recv, group=self.group).view(source.payload.dtype)
        row_scale, ids, weights = source.split_metadata(
            unpack_row_bytes(all_to_all_v(meta, send, recv, group=self.group), layout)
        )
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
            state=DispatchState(token, send, recv, sum(widths), local),
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
        """Weighted partial sums of our experts per received row, sent back and added into each token."""
        state: DispatchState = prepared.state
        partial = output.new_empty((sum(state.recv_counts), output.shape[1]))
        self.local.finalize(
            partial,
            expert_output,
            state.local,
            topk_weights=state.local.topk_weights,
            topk_ids=state.local.topk_ids,
            apply_router_weight_on_input=apply_router_weight_on_input,
            reduce=reduce,
        )
        returned = all_to_all_v(partial, state.recv_counts, state.send_counts, group=self.group)
        total = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
        total.index_add_(0, state.token, returned.to(torch.float32))
        output.copy_(total)
