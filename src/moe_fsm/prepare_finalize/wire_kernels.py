"""The passes around the wire of expert-parallel dispatch and combine, each one kernel on the GPU.

Dispatch and combine move each token's bytes across the wire once; every other
pass over those bytes is overhead, so on CUDA each is one Triton kernel that
reads its input once and writes its output once:

* :func:`route`: every token's send row for each rank, and the per-rank counts, in one
  kernel whose programs scan blocks of tokens side by side, instead of a dozen torch
  operations (a destination mask, a count, a scan down its columns that torch runs as
  a serial kernel, index arithmetic);
* :func:`send_rows`: the send buffer, grouped by destination, written straight from
  the (quantized) payload and the small per-token fields (scale, top-k ids, weights,
  packed by :func:`pack_source`): each token is read (and quantized) once and written
  to each of its send rows, and with fixed blocks the same launch writes the empty row
  into the rows no token fills, instead of packing every token's whole row and then
  gathering the packed rows (two passes, and ``index_select`` on bytes);
* :func:`combine_returned`: each token's returned partial rows (at most one per
  rank) summed in float32 and written to the output in its dtype, instead of zeros,
  a float32 copy of every returned row, an atomic ``index_add_`` and a cast;
* :func:`scatter_to_slabs` / :func:`reduce_from_slabs` (fixed capacity): each
  received row written into the slabs of the experts it names, and each row's
  weighted sum of its experts' output rows, without materialising a copy per
  (row, top-k slot) pair.

All of them take their sizes from tensor shapes and their indices from the device
(no host synchronisation), so they replay in a CUDA graph. Off CUDA (gloo on the
CPU) the same functions run torch operations that compute the same values;
``TRITON_INTERPRET=1`` runs the kernels on CPU tensors through Triton's
interpreter, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Optional, Sequence

import torch

from moe_fsm.distributed.collectives import RowLayout
from moe_fsm.errors import KernelInputError
from moe_fsm.kernels.triton_moe._runtime import HAS_TRITON, interpreter_enabled
from moe_fsm.prepare_finalize.wire_launch import launch

# Columns (of the word type the rows are viewed as) one program copies: 4 KiB of int32 words.
BLOCK_COLUMNS = 1024


@functools.lru_cache(maxsize=None)
def _kernel_module(interpreted: bool) -> ModuleType:
    """The kernels, JIT-compiled for CUDA, or a second copy made under TRITON_INTERPRET=1 for CPU tensors.

    Triton fixes a kernel's mode when the module defining it is executed, so the
    interpreted copy is executed afresh while the variable is set. (Helpers that
    triton.language itself defines with ``@triton.jit``, such as ``tl.zeros``, keep
    the mode of the first import of triton, so the kernels use only builtins.)
    """
    if not interpreted:
        from moe_fsm.prepare_finalize import _wire_triton

        return _wire_triton
    path = Path(__file__).with_name("_wire_triton.py")
    spec = importlib.util.spec_from_file_location("moe_fsm.prepare_finalize._wire_triton_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Triton's interpreter looks the kernels' globals up by module name
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return module


def _kernels(*tensors: torch.Tensor) -> ModuleType:
    return _kernel_module(any(t.device.type != "cuda" for t in tensors))


def kernels_apply(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels run for these tensors: all on CUDA, or anywhere under TRITON_INTERPRET=1."""
    if not HAS_TRITON:
        return False
    return interpreter_enabled() or all(t.device.type == "cuda" for t in tensors)


def _word_dtype(*byte_counts: int) -> torch.dtype:
    """The widest of int32 / int16 / uint8 that divides every byte count (offsets, widths, row strides)."""
    for dtype in (torch.int32, torch.int16):
        if all(n % dtype.itemsize == 0 for n in byte_counts):
            return dtype
    return torch.uint8


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """[R, ...] with contiguous trailing dimensions as uint8 [R, bytes per row] (a view where the strides allow)."""
    rows = t.shape[0]
    flat = t.reshape(rows, -1) if t.dim() != 2 else t
    if flat.stride(-1) != 1:  # .contiguous() keeps a stride of 0 on a dimension of size 1, which view() refuses
        flat = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device).copy_(flat)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.view(dtype)


def _grid(rows: int, cols: int) -> tuple[int, int]:
    return rows, -(-cols // BLOCK_COLUMNS)


class WireBuffers:
    """Buffers a P/F writes and sends on every call, allocated once per (name, dtype, device, row shape) and reused.

    Each grows to the most rows a call has needed; a call gets a leading slice, which is contiguous. Only for
    buffers no caller keeps: the send rows and the packed small fields are read by the collective (on the same
    stream, so the next call's writes wait for it) and never handed out.
    """

    def __init__(self) -> None:
        self._held: dict[tuple, torch.Tensor] = {}

    def rows(self, name: str, rows: int, trailing: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device, trailing)
        held = self._held.get(key)
        if held is None or held.shape[0] < rows:
            held = torch.empty((rows, *trailing), dtype=dtype, device=device)
            self._held[key] = held
        return held[:rows]


def _buffer(buffers: Optional[WireBuffers], name: str, rows: int, trailing: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    if buffers is None:
        return torch.empty((rows, *trailing), dtype=dtype, device=device)
    return buffers.rows(name, rows, trailing, dtype, device)


@dataclass(frozen=True)
class Routes:
    """Where this rank's rows go: ``slot`` [M, W] int64 (token t's send row for rank d) and ``counts`` [W] int64
    (tokens per rank; a column of a bigger buffer where one was given)."""

    slot: torch.Tensor
    counts: torch.Tensor


# Tokens one route program scans at a time, and the most programs: each program also counts every token (the
# ones before its own set where its rows start), so more programs cost more of that counting.
ROUTE_BLOCK_T = 256
ROUTE_PROGRAMS = 64
# Slots of top-k ids one counting step of the route loads (a chunk of tokens x top_k).
ROUTE_COUNT_SLOTS = 8192


def route(
    topk_ids: torch.Tensor,
    owner: torch.Tensor,
    world: int,
    *,
    capacity: Optional[int] = None,
    counts_out: Optional[torch.Tensor] = None,
) -> Routes:
    """Where each token's rows go, in one kernel.

    ``owner`` [E] int32 is the rank of each expert (:meth:`ExpertPlacement.owner_table`). Token t goes to rank d
    when one of its top-k ids is an expert of d; its row for d is ``slot[t, d]``: rank d's rows start at
    ``d * capacity`` (fixed blocks), else right after the rows of the ranks before d, and hold d's tokens in
    order. A pair not sent holds ``W * capacity``, else ``M * W`` (at least the number of send rows either way).
    ``counts_out`` (int64 [W], any stride) receives the counts where given: a column of the records that travel
    next to them, so no copy is needed. Only on CUDA or under the interpreter (:func:`kernels_apply`);
    ``send_slots`` is the torch form.
    """
    num_tokens, top_k = topk_ids.shape
    fixed = capacity is not None
    not_sent = world * capacity if fixed else num_tokens * world
    device = topk_ids.device
    slot = torch.empty((num_tokens, world), dtype=torch.int64, device=device)
    counts = counts_out if counts_out is not None else torch.empty(world, dtype=torch.int64, device=device)
    ids = topk_ids if topk_ids.stride(-1) == 1 else topk_ids.contiguous()
    block_k = max(_next_power_of_2(top_k), 2)
    programs = max(1, min(ROUTE_PROGRAMS, -(-num_tokens // ROUTE_BLOCK_T)))
    span = -(-num_tokens // programs)
    launch(
        _kernels(ids).route_kernel, (programs,),
        (ids, ids.stride(0), owner, slot, counts, counts.stride(0), num_tokens, top_k, owner.shape[0], not_sent,
         capacity or 0, span),
        dict(WORLD=world, FIXED=fixed, BLOCK_T=ROUTE_BLOCK_T, COUNT_T=max(ROUTE_BLOCK_T, ROUTE_COUNT_SLOTS // block_k),
             BLOCK_K=block_k, BLOCK_W=max(_next_power_of_2(world), 2)),
        num_warps=8,
    )
    return Routes(slot, counts)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def send_order(slot: torch.Tensor, total: int) -> torch.Tensor:
    """int64 [total]: the token each send row carries (``slot`` from ``send_slots``); rows no token fills hold M."""
    num_tokens, world = slot.shape
    order = torch.full((total + 1,), num_tokens, dtype=torch.int64, device=slot.device)
    token = torch.arange(num_tokens, device=slot.device).unsqueeze(1)  # broadcast over the W destinations
    order.index_put_((slot.clamp(max=total),), token.expand(num_tokens, world))  # pairs not sent land past the end
    return order[:total]


# Dynamic FP8 row quantizations the send-row kernel applies while packing (InputQuantizer.fused_fp8_rows).
FUSED_FP8_ROWS = ("token", "group")
FP8_GROUP = 128
# Tokens one program of the FP8 send-row kernel quantizes. 1x128 groups: a [4 tokens, 8 groups, 128] tile, 32
# values a thread over FP8_ROWS_WARPS warps, so a program has 8 KiB of loads in flight, stores 16 bytes a thread
# and pays its slot loads, address arithmetic and scale stores once for the four tokens. Per token: one token a
# program, its row walked twice (the scale needs the whole row first).
FP8_GROUP_ROWS = 4
FP8_TOKEN_ROWS = 1
FP8_ROWS_WARPS = 4


@dataclass(frozen=True)
class SourcePack:
    """This rank's rows ready to leave: the payload, and the small fields packed per token.

    ``payload`` is the payload's bytes, read where it lies when the send rows are written; with ``fp8_rows``
    ("token" or "group") it is the layer-dtype rows, which the send-row kernel quantizes to the layout's
    payload and row-scale fields (the first two) in the same pass. ``meta`` [M, row_bytes - meta_start] holds
    the fields the kernels copy (top-k ids and weights, and the row scale of a payload quantized before) at
    their places in the row; ``empty`` is the whole packed empty row.
    """

    payload: torch.Tensor
    meta: Optional[torch.Tensor]
    layout: RowLayout
    empty: torch.Tensor
    fp8_rows: Optional[str] = None

    @property
    def meta_start(self) -> int:
        return self.layout.row_bytes - (self.meta.shape[1] if self.meta is not None else 0)

    @property
    def num_tokens(self) -> int:
        return self.payload.shape[0]


def pack_source(
    fields: Sequence[torch.Tensor],
    layout: RowLayout,
    empty: torch.Tensor,
    *,
    fp8_rows: Optional[str] = None,
    buffers: Optional[WireBuffers] = None,
) -> SourcePack:
    """``fields`` (the row-aligned tensors of ``layout``, payload first) as a :class:`SourcePack`.

    ``empty`` is the packed empty row (:func:`moe_fsm.prepare_finalize.dispatch_layout.empty_row`). Only the
    small fields are copied here (one concatenation into a reused buffer); the payload is read where it lies when
    the send rows are written. With ``fp8_rows``, ``fields[0]`` is the unquantized rows and ``fields[1]`` only
    stands for the scale the kernel will write (it is not read).
    """
    if fp8_rows is not None and fp8_rows not in FUSED_FP8_ROWS:
        raise KernelInputError(f"fp8_rows must be one of {FUSED_FP8_ROWS} or None; got {fp8_rows!r}")
    payload = fields[0] if fp8_rows is not None else _byte_rows(fields[0])
    first_meta = 2 if fp8_rows is not None else 1
    if len(fields) <= first_meta:
        return SourcePack(payload, None, layout, empty, fp8_rows)
    meta_start = layout.fields[first_meta].start
    rows = payload.shape[0]
    meta = _buffer(buffers, "meta", rows, (layout.row_bytes - meta_start,), torch.uint8, payload.device)
    # One concatenation (one launch) writes every small field, and the alignment gaps between them and after the
    # last (the empty row's bytes there, as views), instead of one copy a field.
    parts, at = [], meta_start
    for t, f in zip(fields[first_meta:], layout.fields[first_meta:]):
        if f.start > at:
            parts.append(empty[at : f.start].expand(rows, f.start - at))
        parts.append(_byte_rows(t))
        at = f.start + f.nbytes
    if layout.row_bytes > at:
        parts.append(empty[at:].expand(rows, layout.row_bytes - at))
    torch.cat(parts, dim=1, out=meta)
    return SourcePack(payload, meta, layout, empty, fp8_rows)


def _torch_send_rows(source: SourcePack, order: torch.Tensor) -> torch.Tensor:
    """The send rows by torch ops: every token's whole row packed (the empty row last), then gathered."""
    if source.fp8_rows is not None:
        raise KernelInputError("rows quantized while packing need the Triton kernels (CUDA, or TRITON_INTERPRET=1)")
    layout = source.layout
    packed = torch.empty((source.num_tokens + 1, layout.row_bytes), dtype=torch.uint8, device=order.device)
    packed[-1].copy_(source.empty)
    packed[:-1, : source.payload.shape[1]].copy_(source.payload)
    if source.meta is not None:
        packed[:-1, source.meta_start :].copy_(source.meta)
    return packed.index_select(0, order)


# Programs per rank that write the empty row into the rows of its fixed block that no token fills.
PAD_PROGRAMS = 32


def send_rows(
    source: SourcePack,
    slot: torch.Tensor,
    total: int,
    *,
    counts: Optional[torch.Tensor] = None,
    capacity: Optional[int] = None,
    buffers: Optional[WireBuffers] = None,
) -> torch.Tensor:
    """uint8 [total, row_bytes]: token t's row written to send row ``slot[t, d]`` for each rank d it goes to.

    Variable counts (``capacity`` None): the counts fill every send row. Fixed blocks of ``capacity`` rows a rank
    (``counts`` [W], the route's): the rows of rank d's block past ``counts[d]`` hold the empty row. One kernel
    either way, each token read (and, with ``source.fp8_rows``, quantized) once.
    """
    if (capacity is None) != (counts is None):
        raise KernelInputError("send_rows takes counts and capacity together (fixed blocks) or neither (variable counts)")
    if not kernels_apply(slot, source.payload):
        return _torch_send_rows(source, send_order(slot, total))
    layout = source.layout
    send = _buffer(buffers, "send", total, (layout.row_bytes,), torch.uint8, slot.device)
    fixed = capacity is not None
    pad_programs = PAD_PROGRAMS if fixed else 0
    world = slot.shape[1]
    if total == 0 or (source.num_tokens == 0 and not fixed):
        return send
    index = slot.contiguous()
    counts_arg = counts if fixed else index  # a placeholder pointer where no program pads
    meta = source.meta
    if source.fp8_rows is not None:
        _quantize_into(source, send, index, total, counts_arg, capacity or 0, pad_programs)
        return send
    payload = source.payload
    strides = [payload.shape[1], payload.stride(0), payload.storage_offset(), send.stride(0), layout.row_bytes]
    if meta is not None:
        strides += [source.meta_start, meta.stride(0)]  # meta: a leading slice, offset 0
    word = _word_dtype(*strides)
    size = word.itemsize
    dst = _words(send, word)
    meta_words = _words(meta, word) if meta is not None else dst  # a placeholder pointer without small fields
    grid = (source.num_tokens + world * pad_programs, -(-dst.shape[1] // BLOCK_COLUMNS))
    launch(
        _kernels(index).send_rows_kernel, grid,
        (dst, dst.stride(0), _words(payload, word), payload.stride(0) // size, payload.shape[1] // size, meta_words,
         meta_words.stride(0), source.meta_start // size, dst.shape[1], index, world, total, source.num_tokens,
         _words(source.empty, word), counts_arg, max(pad_programs, 1), capacity or 0),
        dict(HAS_META=meta is not None, FIXED=fixed, BLOCK=BLOCK_COLUMNS),
    )
    return send  # alignment padding between fields is sent as it is: nobody reads it


def _quantize_into(source: SourcePack, send: torch.Tensor, index: torch.Tensor, total: int, counts: torch.Tensor,
                   capacity: int, pad_programs: int) -> None:
    """``send`` from the unquantized rows, quantized in the same pass, with the small fields and empty rows."""
    x = source.payload if source.payload.stride(-1) == 1 else source.payload.contiguous()
    hidden = x.shape[1]
    payload, scale = source.layout.fields[0], source.layout.fields[1]
    q = send[:, payload.start : payload.start + payload.nbytes]  # float8_e4m3fn bytes
    s = send[:, scale.start : scale.start + scale.nbytes].view(torch.float32)
    # Rows are ROW_ALIGN bytes, and the small fields after the float32 scales (int32/int64 ids, float32 weights)
    # start on a 4-byte word, so the small fields and the empty row are copied as int32 words.
    words = send.view(torch.int32)
    meta = source.meta
    meta_start = source.meta_start // 4
    meta_words = meta.view(torch.int32) if meta is not None else words  # a placeholder pointer without small fields
    per_token = source.fp8_rows == "token"
    num_groups = -(-hidden // FP8_GROUP)
    groups = 8 if per_token else min(8, _next_power_of_2(num_groups))  # groups of 128 columns per program or pass
    q_columns = 1 if per_token else -(-num_groups // groups)
    tokens = FP8_TOKEN_ROWS if per_token else FP8_GROUP_ROWS
    token_programs = -(-source.num_tokens // tokens)
    meta_count = words.shape[1] - meta_start if meta is not None else 0  # small-field words per row
    world = index.shape[1]
    grid = (token_programs + world * pad_programs, q_columns)
    interpreted = index.device.type != "cuda"
    launch(
        _kernels(index).quantize_rows_kernel, grid,
        (q, q.stride(0), s, s.stride(0), x, x.stride(0), index, total, source.num_tokens, hidden, token_programs,
         words, words.stride(0), meta_words, meta_words.stride(0), meta_start, words.shape[1],
         source.empty.view(torch.int32), counts, max(pad_programs, 1), capacity),
        dict(WORLD=world, TOKENS=tokens, PER_TOKEN=per_token, GROUP=FP8_GROUP, GROUPS=groups,
             META=_next_power_of_2(meta_count) if meta_count else 0, FIXED=pad_programs > 0, HW_FP8=not interpreted,
             BLOCK=BLOCK_COLUMNS),
        num_warps=FP8_ROWS_WARPS,
    )


def _id_blocks(top_k: int) -> tuple[int, int]:
    block_k = max(_next_power_of_2(top_k), 2)
    return max(16, min(1024, 4096 // block_k)), block_k


def local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """[R, top_k] (``topk_ids``' dtype, contiguous): global ids to this rank's local ids through ``expert_map``
    [E] int32 (-1: not here), -1 for skipped slots, in one kernel (``topk_ids`` may be a strided view)."""
    num_rows, top_k = topk_ids.shape
    out = torch.empty((num_rows, top_k), dtype=topk_ids.dtype, device=topk_ids.device)
    if num_rows == 0:
        return out
    block_r, block_k = _id_blocks(top_k)
    launch(
        _kernels(topk_ids).local_ids_kernel, (-(-num_rows // block_r),),
        (out, topk_ids, topk_ids.stride(0), expert_map, num_rows, top_k, expert_map.shape[0]),
        dict(BLOCK_R=block_r, BLOCK_K=block_k),
    )
    return out


def slab_layout(
    topk_ids: torch.Tensor, expert_map: torch.Tensor, num_local: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(local ids [R, top_k], flat [R, top_k] int64, counts [num_local] int32) in one kernel, from global ids.

    ``flat[r, j]`` is the slab row of slot j of row r: local expert * capacity + the number of earlier rows
    naming that expert, or ``num_local * capacity`` (the trash row) for a slot this rank does not compute (see
    ``dispatch_layout.Slabs``); ``expert_map`` [E] int32 as for :func:`local_ids`.
    """
    num_rows, top_k = topk_ids.shape
    device = topk_ids.device
    ids_out = torch.empty((num_rows, top_k), dtype=topk_ids.dtype, device=device)
    flat = torch.empty((num_rows, top_k), dtype=torch.int64, device=device)
    counts = torch.empty(num_local, dtype=torch.int32, device=device)
    if num_local == 0:
        return local_ids(topk_ids, expert_map), flat.fill_(0), counts
    block_r, block_k = _id_blocks(top_k)
    launch(
        _kernels(topk_ids).slab_layout_kernel, (num_local,),
        (topk_ids, topk_ids.stride(0), expert_map, ids_out, flat, counts, num_rows, top_k, expert_map.shape[0],
         capacity, num_local * capacity),
        dict(BLOCK_R=block_r, BLOCK_K=block_k),
    )
    return ids_out, flat, counts


def combine_returned(output: torch.Tensor, returned: torch.Tensor, slot: torch.Tensor) -> None:
    """``output`` [M, K] = per token, the float32 sum of its returned rows, in ``output``'s dtype.

    ``slot`` [M, W] is where token t's row for rank d sits in ``returned`` (>= its row count: not sent).
    """
    num_tokens, hidden = output.shape
    if not kernels_apply(output, returned, slot):
        output.copy_(add_returned_rows(returned, send_order(slot, returned.shape[0]), num_tokens))
        return
    if num_tokens == 0:
        return
    if returned.stride(-1) != 1:
        returned = returned.contiguous()
    direct = output.stride(-1) == 1
    target = output if direct else torch.empty_like(output, memory_format=torch.contiguous_format)
    launch(
        _kernels(returned).combine_kernel, _grid(num_tokens, hidden),
        (target, target.stride(0), returned, returned.stride(0), slot.contiguous(), returned.shape[0], hidden),
        dict(WORLD=slot.shape[1], BLOCK=BLOCK_COLUMNS),
    )
    if not direct:
        output.copy_(target)


def add_returned_rows(returned: torch.Tensor, order: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """float32 [M, K]: each token's returned partial rows summed (rows of the empty token land in a trash row)."""
    total = torch.zeros((num_tokens + 1, returned.shape[1]), dtype=torch.float32, device=returned.device)
    total.index_add_(0, order, returned.to(torch.float32))
    return total[:num_tokens]


def scatter_to_slabs(slab: torch.Tensor, rows: torch.Tensor, flat: torch.Tensor, trash: int) -> None:
    """``slab[flat[r, j]] = rows[r]`` for every slot with ``flat[r, j] < trash`` (``slab`` [>= trash, ...], viewed flat)."""
    num_rows, top_k = flat.shape
    if num_rows == 0 or trash == 0:
        return
    src = _byte_rows(rows)
    dst = slab.reshape(slab.shape[0], -1).view(torch.uint8)
    word = _word_dtype(src.shape[1], src.stride(0), src.storage_offset(), dst.stride(0), dst.storage_offset())
    src, dst = _words(src, word), _words(dst, word)
    launch(
        _kernels(rows).scatter_rows_kernel, _grid(num_rows, src.shape[1]),
        (dst, dst.stride(0), src, src.stride(0), flat.contiguous(), top_k, trash, src.shape[1]), dict(BLOCK=BLOCK_COLUMNS),
    )


def reduce_from_slabs(
    out: torch.Tensor, slab_rows: torch.Tensor, flat: torch.Tensor, weights: Optional[torch.Tensor], trash: int
) -> None:
    """``out[r]`` = sum over valid slots of ``weights[r, j] * slab_rows[flat[r, j]]`` in float32 (``out`` contiguous)."""
    num_rows, top_k = flat.shape
    hidden = out.shape[1]
    if num_rows == 0:
        return
    w = weights if weights is not None else flat  # a placeholder pointer: HAS_WEIGHTS=False never reads it
    launch(
        _kernels(out).slab_reduce_kernel, _grid(num_rows, hidden),
        (out, out.stride(0), slab_rows, slab_rows.stride(0), flat.contiguous(), w, w.stride(0), top_k, trash, hidden),
        dict(HAS_WEIGHTS=weights is not None, BLOCK=BLOCK_COLUMNS),
    )
