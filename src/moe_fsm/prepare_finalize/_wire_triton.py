"""The Triton kernels of :mod:`moe_fsm.prepare_finalize.wire_kernels` (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def gather_rows_kernel(dst_ptr, dst_stride, src_ptr, src_stride, index_ptr, num_src, n_cols, empty_ptr,
                       HAS_EMPTY: tl.constexpr, BLOCK: tl.constexpr):
    """dst[r] = src[index[r]], or where index[r] >= num_src the row at empty_ptr (HAS_EMPTY) or zeros."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    src_row = tl.load(index_ptr + row).to(tl.int64)
    found = cols * 0 + src_row < num_src
    values = tl.load(src_ptr + src_row * src_stride + cols, mask=inside & found, other=0)
    if HAS_EMPTY:
        values = tl.where(found, values, tl.load(empty_ptr + cols, mask=inside & (found == 0), other=0))
    tl.store(dst_ptr + row.to(tl.int64) * dst_stride + cols, values, mask=inside)


@triton.jit
def _rounded_for(acc, out_ptr):
    """float32 ``acc`` rounded to nearest even at ``out_ptr``'s precision when that is bfloat16 (exact to cast).

    The same values a hardware cast gives; written out because Triton's interpreter rounds halfway up and drops
    the carry out of the mantissa.
    """
    if out_ptr.dtype.element_ty == tl.bfloat16:
        bits = acc.to(tl.int32, bitcast=True)
        acc = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return acc.to(out_ptr.dtype.element_ty)


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
    tl.store(out_ptr + token * out_stride + cols, _rounded_for(acc, out_ptr), mask=inside)


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
    tl.store(out_ptr + row * out_stride + cols, _rounded_for(acc, out_ptr), mask=inside)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def route_kernel(ids_ptr, ids_stride, owner_ptr, slot_ptr, counts_ptr, counts_stride, order_ptr, num_tokens, top_k,
                 num_experts, not_sent, capacity, WORLD: tl.constexpr, FIXED: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """One program: for each rank d in turn, which tokens route a slot to d's experts, and their send rows.

    slot[t, d] = start of d's rows + the number of earlier tokens that go to d, or not_sent; counts[d] = tokens
    that go to d. d's rows start at d * capacity (FIXED) or after the rows of ranks before d. FIXED also writes
    the send order: order[slot[t, d]] = t, and num_tokens (the empty row) in the rows of d's block past its count.
    (Scans and reductions go through tl.reduce / tl.associative_scan with the combiners above: see _kernel_module.)
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
            if FIXED:
                tl.store(order_ptr + slot, ts.to(tl.int64), mask=(ts < num_tokens) & (hit > 0))
            running += tl.reduce(hit, 0, _add)
        if FIXED:
            for p0 in range(running, capacity, BLOCK_T):
                ps = p0 + tl.arange(0, BLOCK_T)
                tl.store(order_ptr + base + ps, (ps * 0 + num_tokens).to(tl.int64), mask=ps < capacity)
        tl.store(counts_ptr + d * counts_stride, running.to(tl.int64))
        if not FIXED:
            base += running


@triton.jit
def _e4m3_bits(v):
    """The float8_e4m3fn byte of each float32 in [-448, 448], rounded to nearest even, by integer arithmetic.

    The same bytes as a hardware conversion (and torch's), written out because Triton's interpreter rounds
    halfway up, drops the carry out of the mantissa and mis-encodes subnormals.
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80)
    a = bits & 0x7FFFFFFF
    exp = (a >> 23) - 127
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)  # 3 mantissa bits; a carry moves the exponent
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(14 - exp, 25)  # subnormal: |v| * 2^9 rounded, i.e. mant >> shift
    sub = (mant + (1 << (shift - 1)) - 1 + ((mant >> shift) & 1)) >> shift
    sub = tl.where(14 - exp >= 25, 0, sub)
    return (tl.where(exp >= -6, normal, sub) | sign).to(tl.uint8)


@triton.jit
def quantize_rows_kernel(q_ptr, q_stride, s_ptr, s_stride, x_ptr, x_stride, index_ptr, index_cols, num_src, trash,
                         n_cols, GATHER: tl.constexpr, PER_TOKEN: tl.constexpr, GROUP: tl.constexpr,
                         GROUPS: tl.constexpr):
    """Dynamic FP8 of each source row, written with its scales straight into its send rows (one read of x).

    GATHER: program r fills send row r from source row index[r] (zeros and a zero scale where it is >= num_src);
    else program r reads source row r and writes every send row index[r, d] < trash. PER_TOKEN: one scale per
    row, max(amax, 1e-10) / 448 (one program walks the row twice); else one per GROUP columns (GROUPS groups per
    program). Divisions are correctly rounded, as the experts' own quantizer's, so the bytes are the same.
    """
    row = tl.program_id(0).to(tl.int64)
    if GATHER:
        src = tl.load(index_ptr + row).to(tl.int64)
    else:
        src = row
    valid = src < num_src
    raw = src
    src = tl.where(valid, src, 0)
    if PER_TOKEN:
        cols = tl.arange(0, GROUPS * GROUP)
        amax = 0.0
        for c0 in range(0, n_cols, GROUPS * GROUP):
            x = tl.load(x_ptr + src * x_stride + c0 + cols, mask=(c0 + cols < n_cols) & (cols * 0 + raw < num_src), other=0.0)
            amax = tl.maximum(amax, tl.reduce(tl.abs(x.to(tl.float32)), 0, _larger))
        scale = tl.div_rn(tl.maximum(amax, 1e-10), 448.0)
        for c0 in range(0, n_cols, GROUPS * GROUP):
            inside = c0 + cols < n_cols
            x = tl.load(x_ptr + src * x_stride + c0 + cols, mask=inside & (cols * 0 + raw < num_src), other=0.0)
            q = _e4m3_bits(tl.clamp(tl.div_rn(x.to(tl.float32), scale), -448.0, 448.0))
            if GATHER:
                tl.store(q_ptr + row * q_stride + c0 + cols, q, mask=inside)
            else:
                for d in range(index_cols):
                    dst = tl.load(index_ptr + row * index_cols + d).to(tl.int64)
                    tl.store(q_ptr + dst * q_stride + c0 + cols, q, mask=inside & (cols * 0 + dst < trash))
        scale = tl.where(valid, scale, 0.0)
        if GATHER:
            tl.store(s_ptr + row * s_stride, scale)
        else:
            for d in range(index_cols):
                dst = tl.load(index_ptr + row * index_cols + d).to(tl.int64)
                tl.store(s_ptr + dst * s_stride, scale, mask=dst < trash)
    else:
        groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        inside = cols < n_cols
        x = tl.load(x_ptr + src * x_stride + cols, mask=inside & (cols * 0 + raw < num_src), other=0.0).to(tl.float32)
        scale = tl.div_rn(tl.maximum(tl.reduce(tl.abs(x), 1, _larger), 1e-10), 448.0)
        q = _e4m3_bits(tl.clamp(tl.div_rn(x, scale[:, None]), -448.0, 448.0))
        scale = tl.where(groups * 0 + raw < num_src, scale, 0.0)
        has_group = groups * GROUP < n_cols
        if GATHER:
            tl.store(q_ptr + row * q_stride + cols, q, mask=inside)
            tl.store(s_ptr + row * s_stride + groups, scale, mask=has_group)
        else:
            for d in range(index_cols):
                dst = tl.load(index_ptr + row * index_cols + d).to(tl.int64)
                tl.store(q_ptr + dst * q_stride + cols, q, mask=inside & (cols * 0 + dst < trash))
                tl.store(s_ptr + dst * s_stride + groups, scale, mask=has_group & (groups * 0 + dst < trash))


@triton.jit
def local_ids_kernel(out_ptr, ids_ptr, ids_stride, map_ptr, num_rows, top_k, num_experts, BLOCK_R: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """out[r, j] = map[ids[r, j]] (the local id, -1 where this rank does not own it); ids outside [0, E) give -1."""
    rs = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    inside = (rs < num_rows)[:, None] & (ks < top_k)[None, :]
    ids = tl.load(ids_ptr + rs[:, None] * ids_stride + ks[None, :], mask=inside, other=-1)
    known = inside & (ids >= 0) & (ids < num_experts)
    local = tl.load(map_ptr + ids, mask=known, other=-1)
    tl.store(out_ptr + rs[:, None] * top_k + ks[None, :], local.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def slab_layout_kernel(ids_ptr, ids_stride, map_ptr, local_ptr, flat_ptr, counts_ptr, num_rows, top_k, num_experts,
                       capacity, trash, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program e: the slab row (e * capacity + position, rows in order) of every slot whose id maps to local expert
    e, and e's count. Program 0 also writes the local ids (map[id], -1 where not owned) and the trash row for
    the slots no local expert computes. A slot past the capacity (a row naming e twice) goes to the trash row.
    """
    e = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    running = 0
    for r0 in range(0, num_rows, BLOCK_R):
        rs = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        inside = (rs < num_rows)[:, None] & (ks < top_k)[None, :]
        ids = tl.load(ids_ptr + rs[:, None] * ids_stride + ks[None, :], mask=inside, other=-1)
        known = inside & (ids >= 0) & (ids < num_experts)
        local = tl.load(map_ptr + ids, mask=known, other=-1)
        mine = inside & (local == e)
        hit = tl.reduce(mine.to(tl.int32), 1, _larger)
        position = running + tl.associative_scan(hit, 0, _add) - hit
        flat = tl.where((position < capacity)[:, None] & (ks[None, :] >= 0), e * capacity + position[:, None], trash)
        out = rs[:, None] * top_k + ks[None, :]
        tl.store(flat_ptr + out, flat.to(tl.int64), mask=mine)
        if e == 0:
            tl.store(local_ptr + out, local.to(local_ptr.dtype.element_ty), mask=inside)
            tl.store(flat_ptr + out, (local * 0 + trash).to(tl.int64), mask=inside & (local < 0))
        running += tl.reduce(hit, 0, _add)
    tl.store(counts_ptr + e, tl.minimum(running, capacity).to(tl.int32))
