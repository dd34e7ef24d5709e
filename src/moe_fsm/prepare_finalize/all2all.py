"""Expert-parallel prepare/finalize: all-to-all dispatch to the experts' owners, all-to-all combine back.

Dispatch: every (token, expert) pair must reach the rank that owns the expert
(:class:`ExpertPlacement`). A token whose top-k experts live on several ranks
goes to each of them once, carrying all its top-k ids and weights; the
receiving rank's expert map turns the ids it does not own into -1, so the
experts compute exactly the pairs they own. (Sending one row per pair would
send a token twice to a rank owning two of its experts; one row per
(token, rank) is what DeepEP's high-throughput dispatch does, and it carries
every pair all the same.)

Each row is the (quantized) payload, its row-wise scale, the top-k ids and
weights side by side in one byte row, so a dispatch is one ``all_to_all_single``.
Before it, one small all-to-all exchanges the per-destination counts (and each
rank's row layout, so a mismatch fails with a reason); reading those counts
is the one host synchronisation, because ``all_to_all_single`` takes its split
sizes as Python integers. The send order is computed on the device
(:mod:`moe_fsm.prepare_finalize.dispatch_layout`) and the received fields are
read as views of the received bytes.

Combine: each rank weights and sums its own experts' slots per received row
(the local finalize), sends the partial rows back with the reverse splits, and
the source rank adds them into its tokens. Ranks may hold any number of tokens,
including none, and experts may receive none.

:class:`moe_fsm.prepare_finalize.fixed_all2all.FixedCapacityAllToAllPrepareFinalize`
is the variant without the host synchronisation for batched experts; built with
``max_tokens_per_rank``, this P/F has none either, for the Standard format (see
:class:`AllToAllPrepareFinalize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from moe_fsm.distributed.collectives import (
    RowLayout,
    all_gather_ints,
    all_to_all_equal,
    all_to_all_v,
    exchange_counts,
    row_layout,
    unpack_row_bytes,
    wire_view,
)
from moe_fsm.distributed.expert_map import ExpertPlacement
from moe_fsm.distributed.group import group_rank_and_size
from moe_fsm.errors import KernelInputError
from moe_fsm.modular.interfaces import (
    ActivationFormat,
    DynamicFP8RowQuantizer,
    InputQuantizer,
    PrepareFinalize,
    PreparedTokens,
    WeightAndReduce,
)
from moe_fsm.prepare_finalize.dispatch_graphs import DispatchGraphs
from moe_fsm.prepare_finalize.dispatch_layout import destinations, empty_row, send_slots
from moe_fsm.prepare_finalize.reduce import apply_router_weight_to_input
from moe_fsm.prepare_finalize.transport import (
    PlacementGuard,
    SourceRows,
    check_row_layouts,
    layout_signature,
    local_prepare_finalize,
    receiving_quantizer,
    source_rows,
)
from moe_fsm.prepare_finalize.wire_kernels import (
    FP8_GROUP,
    FUSED_FP8_ROWS,
    Routes,
    SourcePack,
    WireBuffers,
    combine_returned,
    kernels_apply,
    local_ids,
    pack_source,
    route,
    send_rows,
)


@dataclass(frozen=True)
class WirePlan:
    """What one kind of source rows fixes, worked out on its first call and reused by every later one.

    ``layout`` and ``signature`` (:func:`layout_signature`) describe the packed row, ``empty`` is the packed
    empty row; ``fused`` is the description (meta tensors) of the quantized rows where the send-row kernel
    quantizes them, else None. Looked up by the fields' dtypes and trailing shapes, so a steady-state call builds
    no layout, digest or empty row.
    """

    layout: RowLayout
    signature: tuple[int, int]
    empty: torch.Tensor
    fused: Optional[SourceRows] = None


@dataclass(frozen=True)
class DispatchState:
    """How the rows went out, so they can come back: each token's send rows, the splits.

    ``row_bytes`` is the width of one dispatched row on the wire (payload plus scale, ids, weights, padding).
    ``send_counts`` / ``recv_counts`` are None where every rank sent every rank a block of ``max_tokens_per_rank``
    rows (the combine returns them the same way); ``received_rows`` is the rows this rank's experts got.
    """

    slot: torch.Tensor  # [M, W] the send (and return) row of token t for rank d; >= the rows sent where t does not go to d
    send_counts: Optional[tuple[int, ...]]
    recv_counts: Optional[tuple[int, ...]]
    row_bytes: int
    local: PreparedTokens
    received_rows: int


class ExpertParallelDispatch(PrepareFinalize):
    """What both all-to-all P/Fs share: the placement, its checks, and the rows as they leave this rank.

    ``captures_in_step``: after its first call, a call only launches device work and collectives whose sizes do
    not depend on the data, so every rank of the group may capture it in a CUDA graph at the same point of its
    calls and replay it in step (``moe-fsm run --nproc N`` does). Not ``host_sync_free``: a graph captured by one
    process alone (``eager_graphs``) would hold collectives the other ranks do not make at the same time.
    """

    name = "ExpertParallelDispatch"
    captures_in_step = False

    def __init__(self, placement: ExpertPlacement, *, group: Optional[dist.ProcessGroup], quantize_first: bool) -> None:
        self.placement = placement
        self.group = group
        self.quantize_first = quantize_first
        self._guard = PlacementGuard(placement, self.name)
        self._owner: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._plans: dict[tuple, WirePlan] = {}
        self._maps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # expert map -> its int32 copy
        self._buffers = WireBuffers()
        self._agreed: set[tuple[int, int]] = set()

    def _agree_on_layout(self, signature: tuple[int, int], device: torch.device) -> None:
        """Once per row layout: check every rank packs rows alike (the only call that waits on the host).

        For the paths that send fixed blocks, whose calls otherwise never wait on the host. Ranks meet here on
        their first call with a layout, outside any graph capture, since a capture replays the shapes of the
        warm-up call before it. Ranks must switch layouts (dtype, quantizer) together: a rank meeting here while
        the others dispatch would stall them until the process group's timeout.
        """
        if signature in self._agreed:
            return
        records = all_gather_ints(list(signature), group=self.group, device=device)
        check_row_layouts(records, signature, self.name)
        self._agreed.add(signature)

    def _check_call(self, num_experts: int, expert_map: Optional[torch.Tensor]) -> int:
        """The world size, after checking that this rank, group and layer are the ones the placement describes."""
        rank, world = group_rank_and_size(self.group)
        placement = self.placement
        if (rank, world, num_experts) != (placement.rank, placement.world_size, placement.num_experts):
            raise KernelInputError(
                f"{self.name} was built for rank {placement.rank} of {placement.world_size} with "
                f"{placement.num_experts} experts, but runs as rank {rank} of {world} with {num_experts}"
            )
        self._guard(expert_map)
        return world

    def _routes(
        self, topk_ids: torch.Tensor, world: int, capacity: Optional[int] = None, counts_out: Optional[torch.Tensor] = None
    ) -> Routes:
        """Each token's send row per rank and the send counts (``wire_kernels.route``).

        One kernel on CUDA (writing the counts into ``counts_out`` where given); off it, torch operations.
        """
        device = topk_ids.device
        if kernels_apply(topk_ids):
            key = ("table", device)
            if key not in self._owner:
                self._owner[key] = self.placement.owner_table(device).to(torch.int32)
            return route(topk_ids, self._owner[key], world, capacity=capacity, counts_out=counts_out)
        key = ("mask", device)
        if key not in self._owner:
            self._owner[key] = self.placement.owner_mask(device)
        dest = destinations(topk_ids, self._owner[key])
        counts = dest.sum(dim=0) if counts_out is None else torch.sum(dest, dim=0, out=counts_out)
        if capacity is None:
            return Routes(send_slots(dest, torch.cumsum(counts, 0) - counts, dest.numel()), counts)
        return Routes(send_slots(dest, torch.arange(world, device=device) * capacity, world * capacity), counts)

    def _local_map(self, expert_map: torch.Tensor) -> torch.Tensor:
        """``expert_map`` as int32 for the id kernels, converted once per map tensor."""
        held = self._maps.get(expert_map.device)
        if held is None or held[0] is not expert_map:
            held = (expert_map, expert_map.to(torch.int32).contiguous())
            self._maps[expert_map.device] = held
        return held[1]

    def _source(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        apply_router_weight_on_input: bool,
        quantize: Optional[InputQuantizer],
        buffers: Optional[WireBuffers],
    ) -> tuple[SourceRows, SourcePack, WirePlan]:
        """This rank's rows as they leave (quantized where the scheme allows), packed for the send rows, and
        their plan.

        A dynamic per-token or 1x128-group FP8 quantizer (:class:`DynamicFP8RowQuantizer`) is applied by the
        send-row kernel itself where the kernels run, so the tokens are read once; the layout is then built
        from descriptions of the quantized fields (meta tensors). ``buffers`` holds the packed small fields
        (None: a fresh tensor, as in a CUDA graph's capture, whose memory belongs to the graph).
        """
        device = hidden_states.device
        fused = self._fused_fp8_rows(hidden_states, quantize)
        if fused is not None:
            hidden = apply_router_weight_to_input(hidden_states, topk_weights) if apply_router_weight_on_input else hidden_states
            key = (fused, hidden.dtype, hidden.shape[1], topk_ids.dtype, topk_ids.shape[1], topk_weights.dtype,
                   topk_weights.shape[1], device)
            plan = self._plans.get(key)
            if plan is None:
                hidden_size = hidden.shape[1]
                groups = 1 if fused == "token" else -(-hidden_size // FP8_GROUP)
                q = torch.empty((0, hidden_size), dtype=torch.float8_e4m3fn, device="meta")
                scale = torch.empty((0, groups), dtype=torch.float32, device="meta")
                plan = self._plan(key, [wire_view(q), scale, topk_ids, topk_weights], device, SourceRows(q, scale, None, True))
            source = plan.fused
            fields = [hidden, source.row_scale, topk_ids, topk_weights]  # the scale only stands for what the kernel writes
        else:
            source = source_rows(
                hidden_states,
                topk_weights,
                apply_router_weight_on_input=apply_router_weight_on_input,
                quantize=quantize,
                quantize_first=self.quantize_first,
            )
            fields = source.wire_fields(topk_ids, topk_weights)
            key = (*((f.dtype, f.shape[1:]) for f in fields), device)
            plan = self._plans.get(key) or self._plan(key, fields, device)
        return source, pack_source(fields, plan.layout, plan.empty, fp8_rows=fused, buffers=buffers), plan

    def _plan(self, key: tuple, fields: list[torch.Tensor], device: torch.device, fused: Optional[SourceRows] = None) -> WirePlan:
        """The plan of rows of ``fields``' dtypes and trailing shapes, made once per ``key``."""
        layout = row_layout(fields)
        plan = WirePlan(layout, layout_signature(layout), empty_row(layout, -2, device), fused)
        self._plans[key] = plan
        return plan

    def _fused_fp8_rows(self, hidden_states: torch.Tensor, quantize: Optional[InputQuantizer]) -> Optional[str]:
        """"token" / "group" where the send-row kernel can quantize (see ``_source``), else None."""
        rows = quantize.rows if isinstance(quantize, DynamicFP8RowQuantizer) else None
        if rows not in FUSED_FP8_ROWS or not self.quantize_first or not kernels_apply(hidden_states):
            return None
        return rows if hidden_states.dtype in (torch.bfloat16, torch.float16, torch.float32) else None


class AllToAllPrepareFinalize(ExpertParallelDispatch):
    """EP dispatch/combine with ``all_to_all_single`` over ``group``, Standard or Batched format.

    ``placement`` says which experts each rank owns; the kernel must be called with
    ``expert_map=placement.expert_map()`` and the local experts' weights.
    ``quantize_first`` and ``max_num_tokens`` as in the all-gather P/F.

    Without ``max_tokens_per_rank`` the splits are the exact row counts, exchanged before the dispatch and read
    by the host (``all_to_all_single`` takes them as Python integers): the fewest bytes, one host
    synchronisation. With it (the most tokens any rank passes in one call, the same on every rank, as engines
    pad data-parallel ranks to one batch size), every rank sends every rank a block of that many rows, the
    rows its tokens do not fill being the empty row (ids -1, computed by no expert), and the combine returns
    them the same way: no counts travel, no call waits on the host after the first (which checks the row
    layouts once), and in the Standard format a call can be captured in a CUDA graph (the Batched format's
    local packing reads its busiest expert's count on the host; the fixed-capacity P/F is the batched one); a token goes to a rank at
    most once, so a block never overflows. The price is the unfilled rows on the wire and in the experts' input.
    On CUDA such a Standard-format call is replayed from CUDA graphs the P/F captures itself, its inputs copied
    into static buffers of ``max_tokens_per_rank`` rows (:mod:`moe_fsm.prepare_finalize.dispatch_graphs`: when it
    runs the plain call instead, and ``MOE_FSM_DISPATCH_GRAPHS=0``).
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
        max_tokens_per_rank: Optional[int] = None,
    ) -> None:
        if max_tokens_per_rank is not None and (
            isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1
        ):
            raise KernelInputError(f"max_tokens_per_rank must be a positive integer or None; got {max_tokens_per_rank!r}")
        super().__init__(placement, group=group, quantize_first=quantize_first)
        self.max_tokens_per_rank = max_tokens_per_rank
        self._format = ActivationFormat(activation_format)
        self.local = local_prepare_finalize(self._format, max_num_tokens)
        self._records_held: dict[tuple[tuple[int, int], torch.device], torch.Tensor] = {}
        # Fixed blocks in the Standard format: a call's work depends on no token count, so the eager call
        # replays graphs this P/F captures itself (dispatch_graphs.py)
        self._graphs = DispatchGraphs(max_tokens_per_rank) if self.captures_in_step else None

    @property
    def activation_format(self) -> ActivationFormat:
        return self._format

    @property
    def captures_in_step(self) -> bool:
        """Fixed blocks in the Standard format (the Batched format's local packing reads a count on the host)."""
        return self.max_tokens_per_rank is not None and self._format is ActivationFormat.STANDARD

    def _records(self, signature: tuple[int, int], device: torch.device, world: int) -> torch.Tensor:
        """int64 [2W, 3], made once per layout: rows 0..W-1 are the records this rank sends, one per destination
        (the count in column 0, written by the route on each call, and this rank's layout signature), rows W..2W-1
        receive the other ranks' records, so that one small all-to-all and one host read of the whole buffer give
        the splits both ways and the check of the layouts."""
        key = (signature, device)
        held = self._records_held.get(key)
        if held is None:
            held = torch.tensor([[0, *signature]] * (2 * world), dtype=torch.int64, device=device)
            self._records_held[key] = held
        return held

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
        capacity = self.max_tokens_per_rank
        if capacity is not None and hidden_states.shape[0] > capacity:
            raise KernelInputError(
                f"{self.name} was built for at most {capacity} tokens per rank (max_tokens_per_rank) but was "
                f"called with {hidden_states.shape[0]}; split the batch or build it with a larger capacity"
            )
        if self._graphs is not None:
            replayed = self._graphs.prepare(self, hidden_states, topk_weights, topk_ids, expert_map=expert_map,
                                            apply_router_weight_on_input=apply_router_weight_on_input, quantize=quantize)
            if replayed is not None:
                return replayed
        return self._dispatch(hidden_states, topk_weights, topk_ids, num_experts=num_experts, expert_map=expert_map,
                              apply_router_weight_on_input=apply_router_weight_on_input, quantize=quantize, world=world,
                              buffers=self._buffers)

    def _dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        num_experts: int,
        expert_map: Optional[torch.Tensor],
        apply_router_weight_on_input: bool,
        quantize: Optional[InputQuantizer],
        world: int,
        buffers: Optional[WireBuffers],
    ) -> PreparedTokens:
        """The dispatch's work (every launch and collective of a prepare), after the call's checks."""
        capacity = self.max_tokens_per_rank
        source, packed, plan = self._source(
            hidden_states, topk_weights, topk_ids, apply_router_weight_on_input=apply_router_weight_on_input, quantize=quantize,
            buffers=buffers,
        )
        layout = packed.layout
        send: Optional[tuple[int, ...]]
        recv: Optional[tuple[int, ...]]
        if capacity is None:
            # Each pair's send row, its count written straight into the records that travel (with this rank's
            # layout signature), and the other ranks' records received into the same buffer, before the host waits.
            records = self._records(plan.signature, hidden_states.device, world)
            routes = self._routes(topk_ids, world, counts_out=records[:world, 0])
            exchange_counts(records[:world], group=self.group, out=records[world:], world=world)
            # The one host synchronisation: all_to_all_single takes its splits as Python integers. Everything
            # but the send rows' one pass is queued before it, so little is left to launch after it. (The send
            # rows need no count on the host, but queued before the read they make it wait for their kernel too:
            # measured no faster on 2 and 4 x H200, docs/perf/distributed.md.)
            held = records.tolist()
            send = tuple(record[0] for record in held[:world])
            check_row_layouts([tuple(record[1:]) for record in held[world:]], plan.signature, self.name)
            recv = tuple(record[0] for record in held[world:])
            wire = all_to_all_v(send_rows(packed, routes.slot, sum(send), buffers=buffers), send, recv,
                                group=self.group, world=world)
        else:
            # Fixed blocks: the rows past each rank's count hold the empty row.
            self._agree_on_layout(plan.signature, hidden_states.device)
            routes = self._routes(topk_ids, world, capacity)
            wire = all_to_all_equal(send_rows(packed, routes.slot, world * capacity, counts=routes.counts,
                                              capacity=capacity, buffers=buffers), group=self.group, world=world)
            send = recv = None
        rows, row_scale, ids, weights = source.from_wire(unpack_row_bytes(wire, layout))
        if expert_map is not None and kernels_apply(ids):
            # The ids mapped to local ones here, in one kernel; the local P/F then sees only local experts.
            ids, expert_map, num_experts = local_ids(ids, self._local_map(expert_map)), None, self.placement.num_local_experts
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
            state=DispatchState(routes.slot, send, recv, layout.row_bytes, local, wire.shape[0]),
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
        if self._graphs is not None and self._graphs.finalize(
            self, output, expert_output, prepared, apply_router_weight_on_input=apply_router_weight_on_input, reduce=reduce
        ):
            return
        self._combine(output, expert_output, prepared, apply_router_weight_on_input=apply_router_weight_on_input,
                      reduce=reduce)

    def _combine(
        self,
        output: torch.Tensor,
        expert_output: torch.Tensor,
        prepared: PreparedTokens,
        *,
        apply_router_weight_on_input: bool,
        reduce: WeightAndReduce,
    ) -> None:
        """The combine's work (every launch and collective of a finalize) for tokens ``_dispatch`` prepared."""
        state: DispatchState = prepared.state
        if reduce is WeightAndReduce.EXPERTS and expert_output.dtype == output.dtype:
            partial = expert_output  # the experts already reduced each row: send it as it is
        else:
            partial = output.new_empty((state.received_rows, output.shape[1]))
            self.local.finalize(
                partial,
                expert_output,
                state.local,
                topk_weights=state.local.topk_weights,
                topk_ids=state.local.topk_ids,
                apply_router_weight_on_input=apply_router_weight_on_input,
                reduce=reduce,
            )
        world = self.placement.world_size  # the group's size, checked by prepare
        if state.send_counts is None:
            returned = all_to_all_equal(partial, group=self.group, world=world)
        else:
            returned = all_to_all_v(partial, state.recv_counts, state.send_counts, group=self.group, world=world)
        combine_returned(output, returned, state.slot)
