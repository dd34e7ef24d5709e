"""Where each row goes and how it comes back, computed on the device with fixed-size tensors.

Both expert-parallel all-to-all P/Fs send one row per (token, destination rank)
and add the returned rows back into their tokens. The index arithmetic here
uses only tensor ops whose output sizes are known on the host (cumsum, scatter,
stable sort, index_add), never ``nonzero``, ``bincount`` or ``.tolist()``: the
variable-size P/F synchronises with the host once, to learn how many rows it
receives, and the fixed-capacity P/F never does, so it can be captured in a CUDA
graph. Slots that must not be written (unused capacity, pairs another rank
computes) are sent to one extra "trash" row past the end of the buffer instead
of being filtered out, which would need a host-side count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe_fsm.distributed.collectives import RowLayout
from moe_fsm.prepare_finalize.wire_kernels import kernels_apply, reduce_from_slabs, scatter_to_slabs, send_order

__all__ = ["Slabs", "destinations", "empty_row", "send_order", "send_slots", "slabs_for", "slot_chunks"]


def destinations(topk_ids: torch.Tensor, owner_mask: torch.Tensor) -> torch.Tensor:
    """bool [M, W]: token t must go to rank d (it routes at least one slot to an expert d owns).

    ``owner_mask`` is :meth:`ExpertPlacement.owner_mask`; a skipped slot (id -1) indexes its last row, no rank.
    """
    return owner_mask[topk_ids.long()].any(dim=1)


def send_slots(dest: torch.Tensor, starts: torch.Tensor, not_sent: int) -> torch.Tensor:
    """int64 [M, W]: the send row of token t for rank d, or ``not_sent`` where t does not go to d.

    Rank d's rows start at ``starts[d]`` and hold its tokens in order. The returned
    rows come back in the same places, so this also says where to find them.
    ``not_sent`` must be at least the number of send rows.
    """
    # The running count per rank along the tokens, scanned as W contiguous rows: a scan down the
    # columns of [M, W] is a serial kernel in torch (0.4 ms at 4096 tokens on an H200).
    running = torch.cumsum(dest.t().to(torch.int32).contiguous(), dim=1).t()
    return torch.where(dest, running + (starts - 1).view(1, -1), not_sent)


def empty_row(layout: RowLayout, ids_field: int, device: torch.device) -> torch.Tensor:
    """uint8 [row_bytes]: a packed row no expert computes: zero payload, scale and weights, ids -1."""
    row = torch.zeros(layout.row_bytes, dtype=torch.uint8, device=device)
    f = layout.fields[ids_field]
    row[f.start : f.start + f.nbytes] = 255  # -1 in two's complement, whatever the integer width
    return row


@dataclass(frozen=True)
class Slabs:
    """Where each received (row, top-k slot) pair sits in the batched ``[E_local, capacity, ...]`` slabs.

    ``flat`` [R, top_k]: expert * capacity + position, or ``E_local * capacity`` (the
    trash row) for a slot this rank does not compute; ``counts`` [E_local] int32.
    """

    flat: torch.Tensor
    counts: torch.Tensor
    num_experts: int
    capacity: int

    @property
    def trash(self) -> int:
        return self.num_experts * self.capacity

    def scatter(self, rows: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Rows [R, ...] into slabs [E_local, capacity, ...]; rows past each count are left unwritten."""
        if rows is None or rows.dim() < 2:
            return rows  # no scale, or one scale shared by every row
        num_rows, trailing = rows.shape[0], rows.shape[1:]
        wire = rows.view(torch.uint8) if rows.element_size() == 1 else rows  # index_copy_ has no float8 kernels
        slab = wire.new_empty((self.trash + 1, *trailing))
        if kernels_apply(rows, self.flat):
            scatter_to_slabs(slab, wire, self.flat, self.trash)
            slab = slab[: self.trash].view(self.num_experts, self.capacity, *trailing)
            return slab if slab.dtype == rows.dtype else slab.view(rows.dtype)
        for slots in slot_chunks(self.flat.shape[1], num_rows * wire[:1].numel() * wire.element_size()):
            width = slots.stop - slots.start
            pairs = wire.unsqueeze(1).expand(num_rows, width, *trailing).reshape(num_rows * width, *trailing)
            slab.index_copy_(0, self.flat[:, slots].reshape(-1), pairs)
        slab = slab[: self.trash].view(self.num_experts, self.capacity, *trailing)
        return slab if slab.dtype == rows.dtype else slab.view(rows.dtype)

    def reduce(self, expert_output: torch.Tensor, weights: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
        """[R, K]: per received row, the (weighted) sum of its slots' expert rows; 0 for slots computed elsewhere.

        Unwritten slab rows may hold anything (NaN included), so invalid slots are
        selected away, not multiplied by zero. Sums run in float32.
        """
        num_rows, top_k = self.flat.shape
        hidden = expert_output.shape[-1]
        if self.trash == 0:
            return torch.zeros((num_rows, hidden), dtype=out_dtype, device=expert_output.device)
        flat_out = expert_output.reshape(self.trash, hidden)
        if kernels_apply(flat_out, self.flat):
            out = torch.empty((num_rows, hidden), dtype=out_dtype, device=expert_output.device)
            reduce_from_slabs(out, flat_out, self.flat, weights, self.trash)
            return out
        total = torch.zeros((num_rows, hidden), dtype=torch.float32, device=expert_output.device)
        invalid = (self.flat >= self.trash).unsqueeze(-1)
        index = self.flat.clamp(max=self.trash - 1)
        if weights is None:
            weights = torch.ones((num_rows, top_k), dtype=torch.float32, device=expert_output.device)
        weights = weights.to(torch.float32)
        for slots in slot_chunks(top_k, num_rows * hidden * 4):
            width = slots.stop - slots.start
            rows = flat_out.index_select(0, index[:, slots].reshape(-1)).view(num_rows, width, hidden)
            rows = rows.masked_fill_(invalid[:, slots], 0).to(torch.float32)
            total.unsqueeze(1).baddbmm_(weights[:, slots].unsqueeze(1), rows)
        return total.to(out_dtype)


# Bytes of the temporaries of one pass over the top-k slots. Decode-sized calls take every slot in one
# pass (fewer kernels, which is what a CUDA graph replays); large ones loop, so memory stays bounded.
SLOT_PASS_BYTES = 128 * 2**20


def slot_chunks(top_k: int, bytes_per_slot: int) -> list[slice]:
    """The top-k slots in as few passes as keep each pass's temporaries under SLOT_PASS_BYTES."""
    width = max(1, min(top_k, SLOT_PASS_BYTES // max(bytes_per_slot, 1)))
    return [slice(start, min(start + width, top_k)) for start in range(0, top_k, width)]


def slabs_for(local_ids: torch.Tensor, num_experts: int, capacity: int) -> Slabs:
    """Place every row in the slab of each local expert it names (id >= 0), in row order, without a host sync.

    A row naming one expert in several of its top-k slots takes one slab row of it, which all those slots point at
    (the reduce adds each slot's weight), as the slab kernel does; so no expert holds more than one row per
    received row, and ``capacity`` at least the number of rows never drops a pair.
    """
    num_rows, top_k = local_ids.shape
    ids = local_ids.long()
    # Slot j's first slot naming the same id in its row (j itself where none before does): argmax finds the first
    # True of each row of the [top_k, top_k] equality, and the diagonal is always True.
    first = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(torch.int8).argmax(dim=2)
    repeat = first != torch.arange(top_k, device=ids.device)
    key = torch.where((ids < 0) | repeat, torch.full_like(ids, num_experts), ids).reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=key.device)
    counts.index_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    position = torch.empty_like(key)
    position.scatter_(0, order, torch.arange(key.numel(), device=key.device) - starts[sorted_key])
    # The bound only keeps a caller's too-small capacity from writing out of range.
    placed = (key < num_experts) & (position < capacity)
    flat = torch.where(placed, key * capacity + position, torch.full_like(key, num_experts * capacity)).view(num_rows, top_k)
    flat = torch.gather(flat, 1, first)  # a repeated slot takes its first slot's slab row
    return Slabs(flat, counts[:num_experts].clamp(max=capacity).to(torch.int32), num_experts, capacity)
