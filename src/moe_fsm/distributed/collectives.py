"""Variable-size collectives built from primitives that gloo and NCCL both run.

Data parallelism gives every rank its own number of tokens, and expert
parallelism sends every rank a different number of rows, so the prepare/finalize
objects need all-gather-v, reduce-scatter-v and all-to-all-v. torch.distributed
has only the equal-size forms everywhere, and gloo on CPU has lacked
``reduce_scatter`` in several releases and cannot carry float8 tensors at all.
So:

* sizes travel first (one small all-gather or all-to-all of int64 counts);
* all-gather-v pads every rank's rows to the largest count and runs an equal-size
  all-gather (the single-tensor form on NCCL, the list form on gloo);
* reduce-scatter-v is an ``all_to_all_single`` that sends rank j the partial
  rows of rank j's tokens, followed by a local sum over the sources (the same
  bytes on the wire as a reduce-scatter, summed in float32 in rank order, so the
  result does not depend on the backend);
* several row-aligned tensors travel as one byte matrix (:func:`pack_row_bytes`), so a
  dispatch is one collective whatever the dtypes (fp8, packed fp4, int ids,
  float weights), and the receiver reads the fields back as views;
* a fixed-capacity exchange (:func:`all_to_all_equal`) sends the same number of
  rows to every rank, so it needs no sizes at all and never waits on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from moe_fsm.distributed.group import group_rank_and_size
from moe_fsm.errors import KernelInputError


# Every field starts on a multiple of its element size, and rows are padded to this many bytes,
# so the packed matrix can be read back through typed views (no copies) and rows stay aligned
# for vectorised copies on the GPU.
ROW_ALIGN = 16


@dataclass(frozen=True)
class RowField:
    """One tensor inside a packed byte row: its dtype, trailing shape and byte span."""

    dtype: torch.dtype
    trailing: tuple[int, ...]
    start: int
    nbytes: int


@dataclass(frozen=True)
class RowLayout:
    """How :func:`pack_row_bytes` laid out its tensors, so :func:`unpack_row_bytes` can undo it."""

    fields: tuple[RowField, ...]
    row_bytes: int


def row_layout(tensors: Sequence[torch.Tensor]) -> RowLayout:
    """The byte layout of one row of ``tensors`` (each [M, ...], same M), fields aligned to their element size."""
    fields = []
    start = 0
    for t in tensors:
        if t.dim() == 0:
            raise KernelInputError("pack_row_bytes needs row-aligned tensors [M, ...]; got a 0-d tensor")
        size = t.element_size()
        start = -(-start // size) * size
        trailing = tuple(t.shape[1:])
        nbytes = math.prod(trailing) * size
        fields.append(RowField(t.dtype, trailing, start, nbytes))
        start += nbytes
    return RowLayout(tuple(fields), -(-start // ROW_ALIGN) * ROW_ALIGN)


def pack_row_bytes(tensors: Sequence[torch.Tensor], *, spare_rows: int = 0) -> tuple[torch.Tensor, RowLayout]:
    """Lay row-aligned tensors of any dtypes side by side in one uint8 matrix [M + spare_rows, row_bytes].

    One allocation and one copy per tensor; the ``spare_rows`` at the end and the
    alignment padding are left for the caller to fill (or to ignore).
    """
    if not tensors:
        raise KernelInputError("pack_row_bytes needs at least one tensor")
    rows = tensors[0].shape[0] if tensors[0].dim() else 0
    layout = row_layout(tensors)
    for t in tensors:
        if t.shape[0] != rows:
            raise KernelInputError(
                f"pack_row_bytes needs tensors with the same number of rows; got {[tuple(x.shape) for x in tensors]}"
            )
    packed = torch.empty((rows + spare_rows, layout.row_bytes), dtype=torch.uint8, device=tensors[0].device)
    if rows:
        for t, f in zip(tensors, layout.fields):
            packed[:rows, f.start : f.start + f.nbytes].copy_(t.contiguous().reshape(rows, -1).view(torch.uint8))
    return packed, layout


def unpack_row_bytes(packed: torch.Tensor, layout: RowLayout) -> list[torch.Tensor]:
    """Typed views [R, ...] of the fields of a byte matrix [R, row_bytes] from :func:`pack_row_bytes`.

    Views, not copies: each field keeps the packed matrix's row stride.
    """
    if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[1] != layout.row_bytes:
        raise KernelInputError(
            f"expected packed rows uint8 [R, {layout.row_bytes}], got {packed.dtype} {tuple(packed.shape)}"
        )
    rows = packed.shape[0]
    if rows == 0:
        return [torch.empty((0, *f.trailing), dtype=f.dtype, device=packed.device) for f in layout.fields]
    # A field of one trailing dimension is its byte columns viewed as its dtype already: one view fewer a field.
    return [packed[:, f.start : f.start + f.nbytes].view(f.dtype) if len(f.trailing) == 1
            else packed[:, f.start : f.start + f.nbytes].view(f.dtype).view(rows, *f.trailing) for f in layout.fields]


def all_gather_ints(values: Sequence[int], *, group: Optional[dist.ProcessGroup] = None, device: torch.device) -> list[tuple[int, ...]]:
    """All-gather a few integers per rank (a token count, a row width); every rank gets all ranks' tuples."""
    _, world = group_rank_and_size(group)
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    gathered = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    _all_gather_equal(gathered, mine, group)
    flat = gathered.tolist()
    n = mine.numel()
    return [tuple(int(v) for v in flat[r * n : (r + 1) * n]) for r in range(world)]


def exchange_sizes(count: int, *, group: Optional[dist.ProcessGroup] = None, device: torch.device) -> list[int]:
    """All-gather one integer per rank (e.g. its token count); every rank gets the list."""
    return [t[0] for t in all_gather_ints([count], group=group, device=device)]


def exchange_counts(
    send_counts: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    out: Optional[torch.Tensor] = None,
    world: Optional[int] = None,
) -> torch.Tensor:
    """All-to-all of per-destination counts [W] (or [W, c] records): row s of the result came from rank s.

    ``out`` (contiguous, ``send_counts``' shape, int64, e.g. the second half of one buffer whose first half is
    ``send_counts``, so both are read back by one host read) receives them where given. ``world``: as for
    :func:`all_to_all_v`.
    """
    world = _group_size(group, world)
    if send_counts.dim() not in (1, 2) or send_counts.shape[0] != world:
        raise KernelInputError(
            f"send_counts must have one entry (or record) per rank ({world}), got shape {tuple(send_counts.shape)}"
        )
    send = send_counts if send_counts.dtype == torch.int64 and send_counts.is_contiguous() else \
        send_counts.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty_like(send)
    elif out.shape != send.shape or out.dtype != torch.int64 or not out.is_contiguous():
        raise KernelInputError(f"exchange_counts needs out as contiguous int64 {tuple(send.shape)}, got "
                               f"{out.dtype} {tuple(out.shape)}")
    dist.all_to_all_single(out, send, group=group)
    return out


def all_gather_v(
    rows: torch.Tensor, sizes: Sequence[int], *, group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """Concatenate every rank's rows [sizes[r], ...] in rank order; ``sizes`` from :func:`exchange_sizes`."""
    rank, world = group_rank_and_size(group)
    _check_sizes(sizes, world)
    if rows.shape[0] != sizes[rank]:
        raise KernelInputError(f"rank {rank} holds {rows.shape[0]} rows but sizes says {sizes[rank]}")
    longest = max(sizes)
    if longest == 0:
        return rows.new_empty((0, *rows.shape[1:]))
    send = wire_view(rows.contiguous())  # pad, gather and cut in the wire dtype (bytes for float8)
    if send.shape[0] < longest:
        padded = send.new_zeros((longest, *send.shape[1:]))
        padded[: send.shape[0]] = send
        send = padded
    gathered = send.new_empty((world * longest, *send.shape[1:]))
    _all_gather_equal(gathered, send, group)
    if any(s != longest for s in sizes):
        gathered = torch.cat([gathered[r * longest : r * longest + s] for r, s in enumerate(sizes)], dim=0)
    return gathered if gathered.dtype == rows.dtype else gathered.view(rows.dtype)


def reduce_scatter_v(
    rows: torch.Tensor,
    sizes: Sequence[int],
    *,
    group: Optional[dist.ProcessGroup] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Sum every rank's partial rows [sum(sizes), ...] and keep this rank's block [sizes[rank], ...].

    Rows are laid out in rank order as :func:`all_gather_v` produced them. The
    partials travel in ``rows``' dtype and are summed in float32 (``out_dtype``
    defaults to ``rows.dtype``).
    """
    rank, world = group_rank_and_size(group)
    _check_sizes(sizes, world)
    total = sum(sizes)
    if rows.shape[0] != total:
        raise KernelInputError(f"reduce_scatter_v expects {total} rows (sum of sizes {list(sizes)}), got {rows.shape[0]}")
    mine = sizes[rank]
    received = all_to_all_v(rows, list(sizes), [mine] * world, group=group)
    summed = received.reshape(world, mine, *rows.shape[1:]).to(torch.float32).sum(dim=0)
    return summed.to(out_dtype or rows.dtype)


def all_to_all_v(
    rows: torch.Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    *,
    group: Optional[dist.ProcessGroup] = None,
    world: Optional[int] = None,
) -> torch.Tensor:
    """Send ``rows[offsets[d]:offsets[d]+send_counts[d]]`` to rank d; receive ``recv_counts[s]`` rows from s.

    Rows must already be grouped by destination. Float8 and other dtypes gloo
    cannot carry go as bytes; the result has ``rows``' dtype. ``world``: the group's size where the caller has
    already looked it up (a dispatch does once a call), which spares the lookup here; else it is looked up.
    """
    world = _group_size(group, world)
    _check_sizes(send_counts, world)
    _check_sizes(recv_counts, world)
    if rows.shape[0] != sum(send_counts):
        raise KernelInputError(f"all_to_all_v has {rows.shape[0]} rows but send_counts sum to {sum(send_counts)}")
    send = rows.contiguous()
    wire = wire_view(send)
    out = wire.new_empty((sum(recv_counts), *wire.shape[1:]))
    dist.all_to_all_single(out, wire, output_split_sizes=list(recv_counts), input_split_sizes=list(send_counts), group=group)
    if wire.dtype == send.dtype:
        return out
    return out.view(send.dtype).reshape(out.shape[0], *send.shape[1:])


def all_to_all_equal(
    rows: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None, world: Optional[int] = None
) -> torch.Tensor:
    """Send block d of ``rows`` [W * n, ...] to rank d; block s of the result came from rank s.

    Equal splits: no sizes, no host synchronisation, so it can be captured in a CUDA graph. ``world``: as for
    :func:`all_to_all_v`.
    """
    world = _group_size(group, world)
    if rows.shape[0] % world:
        raise KernelInputError(f"all_to_all_equal needs a multiple of {world} rows (one block per rank), got {rows.shape[0]}")
    send = rows.contiguous()
    wire = wire_view(send)
    out = torch.empty_like(wire)
    dist.all_to_all_single(out, wire, group=group)
    return out if wire.dtype == send.dtype else out.view(send.dtype)


def _group_size(group: Optional[dist.ProcessGroup], world: Optional[int]) -> int:
    return world if world is not None else group_rank_and_size(group)[1]


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """float8 tensors as uint8 bytes (gloo rejects float8 dtypes, and byte gathers work everywhere); others as they are."""
    if t.dtype.is_floating_point and t.element_size() == 1:
        return t.view(torch.uint8)
    return t


# Newer torch (2.13 here) calls the single-tensor all-gather ``all_gather_single`` and warns on its
# older name ``all_gather_into_tensor``, the only one older releases have; both take (output, input, group).
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather_equal(out: torch.Tensor, send: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Equal-size all-gather into ``out`` [W * rows, ...]: the single-tensor form on NCCL, the list form elsewhere."""
    wire_out, wire_send = wire_view(out), wire_view(send)
    if dist.get_backend(group) == "nccl":
        _ALL_GATHER_SINGLE(wire_out, wire_send, group=group)
    else:
        world = dist.get_world_size(group)
        dist.all_gather(list(wire_out.chunk(world, dim=0)), wire_send, group=group)


def _check_sizes(sizes: Sequence[int], world: int) -> None:
    if len(sizes) != world or any((not isinstance(s, int)) or s < 0 for s in sizes):
        raise KernelInputError(f"expected {world} non-negative integer sizes (one per rank), got {list(sizes)}")
