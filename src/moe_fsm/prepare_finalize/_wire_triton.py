"""The Triton kernels of :mod:`moe_fsm.prepare_finalize.wire_kernels` (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def gather_rows_kernel(dst_ptr, dst_stride, src_ptr, src_stride, index_ptr, num_src, n_cols, BLOCK: tl.constexpr):
    """dst[r] = src[index[r]], or zeros where index[r] >= num_src."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    src_row = tl.load(index_ptr + row).to(tl.int64)
    values = tl.load(src_ptr + src_row * src_stride + cols, mask=inside & (cols * 0 + src_row < num_src), other=0)
    tl.store(dst_ptr + row.to(tl.int64) * dst_stride + cols, values, mask=inside)


@triton.jit
def combine_kernel(out_ptr, out_stride, ret_ptr, ret_stride, slot_ptr, world, num_returned, n_cols,
                   BLOCK: tl.constexpr):
    """out[t] = sum over ranks d of returned[slot[t, d]] (slots >= num_returned skipped), summed in float32."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    acc = tl.full((BLOCK,), 0.0, tl.float32)  # tl.full, not tl.zeros: see _kernel_module
    for d in range(world):
        slot = tl.load(slot_ptr + token * world + d).to(tl.int64)
        rows = tl.load(ret_ptr + slot * ret_stride + cols, mask=inside & (cols * 0 + slot < num_returned), other=0.0)
        acc += rows.to(tl.float32)
    tl.store(out_ptr + token * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def scatter_rows_kernel(dst_ptr, dst_stride, src_ptr, src_stride, index_ptr, top_k, trash, n_cols,
                        BLOCK: tl.constexpr):
    """dst[index[r, j]] = src[r] for every slot j with index[r, j] < trash."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    values = tl.load(src_ptr + row * src_stride + cols, mask=inside)
    for j in range(top_k):
        dst_row = tl.load(index_ptr + row * top_k + j).to(tl.int64)
        tl.store(dst_ptr + dst_row * dst_stride + cols, values, mask=inside & (cols * 0 + dst_row < trash))


@triton.jit
def slab_reduce_kernel(out_ptr, out_stride, slab_ptr, slab_stride, index_ptr, w_ptr, w_stride, top_k, trash,
                       n_cols, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    """out[r] = sum over slots j with index[r, j] < trash of w[r, j] * slab[index[r, j]], in float32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    acc = tl.full((BLOCK,), 0.0, tl.float32)  # tl.full, not tl.zeros: see _kernel_module
    for j in range(top_k):
        src_row = tl.load(index_ptr + row * top_k + j).to(tl.int64)
        valid = src_row < trash
        rows = tl.load(slab_ptr + src_row * slab_stride + cols, mask=inside & (cols * 0 + src_row < trash), other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            weight = tl.load(w_ptr + row * w_stride + j).to(tl.float32)
            rows = rows * tl.where(valid, weight, 0.0)
        acc += rows
    tl.store(out_ptr + row * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def route_kernel(ids_ptr, ids_stride, owner_ptr, slot_ptr, counts_ptr, num_tokens, top_k, num_experts, not_sent,
                 capacity, WORLD: tl.constexpr, FIXED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: for each rank d in turn, which tokens route a slot to d's experts, and their send rows.

    slot[t, d] = start of d's rows + the number of earlier tokens that go to d, or not_sent; counts[d] = tokens
    that go to d. d's rows start at d * capacity (FIXED) or after the rows of ranks before d. (Scans and
    reductions go through tl.reduce / tl.associative_scan with the combiners above: see _kernel_module.)
    """
    ks = tl.arange(0, BLOCK_K)
    base = 0
    for d in tl.static_range(WORLD):
        if FIXED:
            base = d * capacity
        running = 0
        for t0 in range(0, num_tokens, BLOCK_T):
            ts = t0 + tl.arange(0, BLOCK_T)
            inside = (ts < num_tokens)[:, None] & (ks < top_k)[None, :]
            ids = tl.load(ids_ptr + ts.to(tl.int64)[:, None] * ids_stride + ks[None, :], mask=inside, other=-1)
            valid = inside & (ids >= 0) & (ids < num_experts)
            owner = tl.load(owner_ptr + ids, mask=valid, other=-1)
            hit = tl.reduce((owner == d).to(tl.int32), 1, _larger)
            before = tl.associative_scan(hit, 0, _add) - hit
            slot = tl.where(hit > 0, base + running + before, not_sent)
            tl.store(slot_ptr + ts.to(tl.int64) * WORLD + d, slot.to(tl.int64), mask=ts < num_tokens)
            running += tl.reduce(hit, 0, _add)
        tl.store(counts_ptr + d, running.to(tl.int64))
        if not FIXED:
            base += running
