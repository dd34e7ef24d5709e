"""What every moe-fsm distributed prepare/finalize does around moving the tokens.

Each distributed P/F is a communication layer wrapped around a local one
(:class:`LocalPrepareFinalize` or :class:`LocalBatchedPrepareFinalize`): on the
source rank it applies the router weight (top-1) and, where the scheme allows,
quantizes, so that fp8 / packed fp4 bytes and their scales travel instead of
the layer dtype; on the receiving rank the local P/F maps global expert ids to
local ones, packs batches, and later weights and reduces over top-k. That keeps
one implementation of the id mapping, batching and reduction for local and
distributed runs.

Quantizing before the communication is right when every row's quantization is
independent of the other rows on its rank: per-token and 1x128-group FP8, NVFP4
(16-element blocks under a static global scale), and static per-tensor FP8 (the
same scale on every rank). Dynamic per-tensor FP8 computes one scale from the
rank's whole batch, which would differ between the rows that meet on a
receiving rank, so those rows travel unquantized and are quantized where the
experts run.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional

import torch

from moe_fsm.distributed.collectives import RowLayout, wire_view
from moe_fsm.distributed.expert_map import ExpertPlacement
from moe_fsm.errors import KernelInputError
from moe_fsm.inputs.quant import Granularity, QuantScheme
from moe_fsm.modular.interfaces import ActivationFormat, InputQuantizer, PrepareFinalize
from moe_fsm.prepare_finalize.local import LocalBatchedPrepareFinalize, LocalPrepareFinalize
from moe_fsm.prepare_finalize.reduce import apply_router_weight_to_input


def quantize_before_communication(scheme: Optional[QuantScheme]) -> bool:
    """False only for dynamic per-tensor activations (one scale per rank's batch); see the module doc."""
    if scheme is None or scheme.activation is None:
        return True
    key = scheme.activation
    return not (key.granularity is Granularity.TENSOR and not key.static)


def local_prepare_finalize(activation_format: ActivationFormat, max_num_tokens: Optional[int]) -> PrepareFinalize:
    """The local P/F that does the per-rank work after the tokens arrived."""
    if activation_format is ActivationFormat.BATCHED:
        return LocalBatchedPrepareFinalize(max_num_tokens)
    if max_num_tokens is not None:
        raise KernelInputError("max_num_tokens is the per-expert capacity of the batched format; the standard format takes none")
    return LocalPrepareFinalize()


@dataclass(frozen=True)
class SourceRows:
    """This rank's rows as they leave: the payload (quantized or not) and its scale.

    ``row_scale`` is a 2-D scale that travels with the rows; ``shared_scale`` a 0-D/1-D
    scale every rank holds alike (static per tensor); ``quantized`` says the payload
    is already in the experts' input form.

    On the wire, the payload, its row scale, the top-k ids and the top-k weights
    share one byte row (:func:`moe_fsm.distributed.collectives.pack_row_bytes`), so
    a dispatch is one collective, and the receiver reads the fields back as views.
    """

    payload: torch.Tensor
    row_scale: Optional[torch.Tensor]
    shared_scale: Optional[torch.Tensor]
    quantized: bool

    def wire_fields(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> list[torch.Tensor]:
        """The row-aligned tensors that travel, packed side by side into one byte row (float8 as bytes)."""
        scale = [wire_view(self.row_scale)] if self.row_scale is not None else []
        return [wire_view(self.payload), *scale, topk_ids, topk_weights]

    def from_wire(self, fields: list[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Received fields (views of the packed rows) back into (payload, row scale or None, top-k ids, weights)."""
        payload = fields[0] if fields[0].dtype == self.payload.dtype else fields[0].view(self.payload.dtype)  # float8 bytes
        scale = None if self.row_scale is None else fields[1] if fields[1].dtype == self.row_scale.dtype else \
            fields[1].view(self.row_scale.dtype)
        return payload, scale, fields[-2], fields[-1]


def source_rows(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    apply_router_weight_on_input: bool,
    quantize: Optional[InputQuantizer],
    quantize_first: bool,
) -> SourceRows:
    """Router weight on the input (top-1), then quantize here if ``quantize_first``."""
    hidden = apply_router_weight_to_input(hidden_states, topk_weights) if apply_router_weight_on_input else hidden_states
    if quantize is None or not quantize_first:
        return SourceRows(hidden, None, None, False)
    q, scale = quantize(hidden)
    if scale is not None and scale.dim() >= 2:
        if scale.shape[0] != q.shape[0]:
            raise KernelInputError(
                f"a row-wise activation scale must have one row per token: scale {tuple(scale.shape)}, rows {tuple(q.shape)}"
            )
        return SourceRows(q, scale, None, True)
    return SourceRows(q, None, scale, True)


@dataclass(frozen=True)
class Quantized:
    """InputQuantizer for rows that were quantized on their source rank: hands them back with their scale.

    The local P/F calls its quantizer on the rows it was given; this one checks it
    got exactly those rows and returns them as they are, so the local P/F packs
    the travelled scale alongside (batched format) without quantizing twice.
    """

    rows: torch.Tensor
    scale: Optional[torch.Tensor]

    def __call__(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if hidden is not self.rows:
            raise KernelInputError("rows quantized before communication were handed a different tensor to quantize")
        return hidden, self.scale


def receiving_quantizer(
    rows: torch.Tensor, source: SourceRows, row_scale: Optional[torch.Tensor], quantize: Optional[InputQuantizer]
) -> Optional[InputQuantizer]:
    """What the local P/F quantizes the received rows with: nothing new if they came quantized."""
    if not source.quantized:
        return quantize
    return Quantized(rows, row_scale if row_scale is not None else source.shared_scale)


class PlacementGuard:
    """Checks that the kernel's expert map is this P/F's placement, or tokens would reach the wrong experts.

    The comparison runs once per distinct map tensor (a device sync), not on every call.
    """

    def __init__(self, placement: ExpertPlacement, who: str) -> None:
        self.placement = placement
        self.who = who
        self._checked: Optional[torch.Tensor] = None

    def __call__(self, expert_map: Optional[torch.Tensor]) -> None:
        placement = self.placement
        if expert_map is None:
            raise KernelInputError(
                f"{self.who} computes only this rank's experts: call the kernel with "
                f"expert_map=ExpertPlacement(...).expert_map() and w1/w2 holding the "
                f"{placement.num_local_experts} local experts"
            )
        if expert_map is self._checked:
            return
        expected = placement.expert_map(expert_map.device)
        if expert_map.shape != expected.shape or not torch.equal(expert_map.to(expected.dtype), expected):
            raise KernelInputError(
                f"{self.who}: the expert_map given does not match rank {placement.rank}'s placement "
                f"(experts {placement.local_start}..{placement.local_end - 1} of {placement.num_experts} "
                f"over {placement.world_size} ranks)"
            )
        self._checked = expert_map


def layout_signature(layout: RowLayout) -> tuple[int, int]:
    """Two integers that differ between row layouts a rank could produce: the row width and a digest of the fields.

    Ranks exchange it (next to their counts, or once) so that a rank quantizing
    differently from the others fails with a reason instead of garbling rows.
    """
    described = ";".join(f"{f.start}:{f.nbytes}:{f.dtype}:{f.trailing}" for f in layout.fields)
    return layout.row_bytes, zlib.crc32(described.encode())


def check_row_layouts(received: list[tuple[int, ...]], mine: tuple[int, ...], who: str) -> None:
    """Every rank must send rows of the same layout (dtypes, quantization); say so instead of garbling."""
    if any(tuple(r) != tuple(mine) for r in received):
        raise KernelInputError(
            f"{who}: ranks send rows of different layouts (row bytes, field digest) {[tuple(r) for r in received]}; "
            f"every rank must use the same hidden dtype, top-k dtypes and activation quantizer"
        )
