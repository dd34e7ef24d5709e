"""The Triton kernels of :mod:`moe_fsm.prepare_finalize.wire_kernels` (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def _fill_empty_rows(dst_ptr, dst_stride, empty_ptr, counts_ptr, pad, pad_programs, capacity, n_cols, cols):
    """Pad program ``pad`` of rank d = pad // pad_programs: the empty row into every ``pad_programs``-th row of d's
    block past its count (rows d * capacity + counts[d] .. (d + 1) * capacity), columns ``cols``."""
    d = (pad // pad_programs).to(tl.int64)
    inside = cols < n_cols
    empty = tl.load(empty_ptr + cols, mask=inside, other=0)
    first = d * capacity + tl.load(counts_ptr + d) + pad % pad_programs
    for r in range(first, (d + 1) * capacity, pad_programs):
        tl.store(dst_ptr + r * dst_stride + cols, empty, mask=inside)


@triton.jit
def send_rows_kernel(dst_ptr, dst_stride, payload_ptr, payload_stride, payload_cols, meta_ptr, meta_stride, meta_start,
                     n_cols, slot_ptr, world, not_sent, num_tokens, empty_ptr, counts_ptr, pad_programs, capacity,
                     HAS_META: tl.constexpr, FIXED: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, c) for t < num_tokens: columns c of token t's whole row (the payload, then the packed small fields
    from column meta_start) read once and written to each send row slot[t, d] < not_sent. FIXED: programs past the
    tokens write the empty row into the rows of each rank's block that no token fills (_fill_empty_rows)."""
    program = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if program < num_tokens:
        token = program.to(tl.int64)
        in_payload = cols < payload_cols
        values = tl.load(payload_ptr + token * payload_stride + cols, mask=in_payload, other=0)
        inside = in_payload
        if HAS_META:
            in_meta = (cols >= meta_start) & (cols < n_cols)
            meta = tl.load(meta_ptr + token * meta_stride + cols - meta_start, mask=in_meta, other=0)
            values = tl.where(in_meta, meta, values)
            inside = in_payload | in_meta
        for d in range(world):
            dst_row = tl.load(slot_ptr + token * world + d)
            tl.store(dst_ptr + dst_row * dst_stride + cols, values, mask=inside & (cols * 0 + dst_row < not_sent))
    elif FIXED:
        _fill_empty_rows(dst_ptr, dst_stride, empty_ptr, counts_ptr, program - num_tokens, pad_programs, capacity, n_cols,
                         cols)


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
def combine_kernel(out_ptr, out_stride, ret_ptr, ret_stride, slot_ptr, num_returned, n_cols, WORLD: tl.constexpr,
                   BLOCK: tl.constexpr):
    """out[t] = sum over ranks d of returned[slot[t, d]] (slots >= num_returned skipped), summed in float32.

    The ranks' loop is unrolled (WORLD is a constant), so a program's W row loads are in flight together.
    """
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    acc = tl.full((BLOCK,), 0.0, tl.float32)  # tl.full, not tl.zeros: see _kernel_module
    for d in tl.static_range(WORLD):
        slot = tl.load(slot_ptr + token * WORLD + d).to(tl.int64)
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
def _rank_hits(ids_ptr, ids_stride, owner_ptr, ts, ks, ws, num_tokens, top_k, num_experts, ROWS: tl.constexpr,
               BLOCK_W: tl.constexpr, WORLD: tl.constexpr):
    """int32 [ROWS, BLOCK_W]: 1 where token ts routes a slot to an expert of rank ws (skipped slots, ids outside
    [0, E) and tokens past num_tokens route nowhere)."""
    inside = (ts < num_tokens)[:, None] & (ks < top_k)[None, :]
    ids = tl.load(ids_ptr + ts.to(tl.int64)[:, None] * ids_stride + ks[None, :], mask=inside, other=-1)
    owner = tl.load(owner_ptr + ids, mask=inside & (ids >= 0) & (ids < num_experts), other=-1)
    hits = tl.full((ROWS, BLOCK_W), 0, tl.int32)
    for d in tl.static_range(WORLD):
        hit = tl.reduce((owner == d).to(tl.int32), 1, _larger)
        hits = tl.where(ws[None, :] == d, hit[:, None], hits)
    return hits


@triton.jit
def route_kernel(ids_ptr, ids_stride, owner_ptr, slot_ptr, counts_ptr, counts_stride, num_tokens, top_k, num_experts,
                 not_sent, capacity, span, WORLD: tl.constexpr, FIXED: tl.constexpr, BLOCK_T: tl.constexpr,
                 COUNT_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program p: the send rows of tokens [p * span, (p + 1) * span), for every rank.

    slot[t, d] = start of d's rows + the number of earlier tokens that go to d, or not_sent; counts[d] = tokens that
    go to d (written by program 0). d's rows start at d * capacity (FIXED) or after the rows of the ranks before d.
    Each program first counts, in wide chunks, the tokens before its own (and, for the starts, all of them) that go
    to each rank, then scans its own tokens: programs run side by side, with no pass that walks every token in
    small steps. Every rank's column is counted and scanned together ([tokens, ranks] tiles), so a step makes one
    reduction or scan across the program's warps, not one per rank. (Scans and reductions go through tl.reduce /
    tl.associative_scan with the combiners above: see _kernel_module.)
    """
    ks = tl.arange(0, BLOCK_K)
    ws = tl.arange(0, BLOCK_W)
    first = tl.program_id(0) * span
    last = tl.minimum(first + span, num_tokens)
    before = tl.full((BLOCK_W,), 0, tl.int32)  # per rank: tokens before this program's that go to it
    total = tl.full((BLOCK_W,), 0, tl.int32)  # per rank: all tokens that go to it
    for t0 in range(0, num_tokens, COUNT_T):
        ts = t0 + tl.arange(0, COUNT_T)
        hits = _rank_hits(ids_ptr, ids_stride, owner_ptr, ts, ks, ws, num_tokens, top_k, num_experts, COUNT_T, BLOCK_W,
                          WORLD)
        total += tl.reduce(hits, 0, _add)
        before += tl.reduce(tl.where((ts < first)[:, None], hits, 0), 0, _add)
    if tl.program_id(0) == 0:
        tl.store(counts_ptr + ws * counts_stride, total.to(tl.int64), mask=ws < WORLD)
    if FIXED:
        base = ws * capacity
    else:
        base = tl.associative_scan(total, 0, _add) - total
    for t0 in range(first, last, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        hits = _rank_hits(ids_ptr, ids_stride, owner_ptr, ts, ks, ws, last, top_k, num_experts, BLOCK_T, BLOCK_W, WORLD)
        position = before[None, :] + tl.associative_scan(hits, 0, _add) - hits
        slot = tl.where(hits > 0, base[None, :] + position, not_sent)
        tl.store(slot_ptr + ts.to(tl.int64)[:, None] * WORLD + ws[None, :], slot.to(tl.int64),
                 mask=(ts < last)[:, None] & (ws < WORLD)[None, :])
        before += tl.reduce(hits, 0, _add)


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
def _fp8_bytes(v, HW_FP8: tl.constexpr):
    """float8_e4m3fn bytes of float32 ``v`` clamped to [-448, 448], rounded to nearest even: the hardware conversion
    where the kernel is compiled (HW_FP8), the same bytes by integer arithmetic under the interpreter."""
    v = tl.clamp(v, -448.0, 448.0)
    if HW_FP8:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return _e4m3_bits(v)


@triton.jit
def quantize_rows_kernel(q_ptr, q_stride, s_ptr, s_stride, x_ptr, x_stride, slot_ptr, not_sent, num_tokens, n_cols,
                         token_programs, words_ptr, words_stride, meta_ptr, meta_stride, meta_start, row_words,
                         empty_ptr, counts_ptr, pad_programs, capacity, WORLD: tl.constexpr, TOKENS: tl.constexpr,
                         PER_TOKEN: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr, META: tl.constexpr,
                         FIXED: tl.constexpr, HW_FP8: tl.constexpr, BLOCK: tl.constexpr):
    """Dynamic FP8 of each token's row, written with its scales and small fields straight into its send rows.

    Program (p, c) for p < token_programs reads tokens [p * TOKENS, (p + 1) * TOKENS) once and writes every send
    row slot[t, d] < not_sent of each: the quantized bytes and scales of its columns (PER_TOKEN: the whole row,
    one scale max(amax, 1e-10) / 448, walked twice; else GROUPS groups of GROUP columns, one scale each, the
    tokens' groups loaded as one [TOKENS, GROUPS, GROUP] tile so a program keeps many loads in flight and pays
    its slot loads, address arithmetic and scale stores once for all of them), and, in the programs of column 0,
    the packed small fields (META words, a power of two covering row_words - meta_start), copied as words of the
    send rows (``words_ptr``) from word meta_start. WORLD is a constant, so each token's destinations are
    unrolled. FIXED: programs past the tokens write the empty row, in words, into the rows of each rank's block
    no token fills (_fill_empty_rows). Divisions are correctly rounded, as the experts' own quantizer's, so the
    bytes are the same.
    """
    program = tl.program_id(0)
    column = tl.program_id(1)
    if program < token_programs:
        tokens = program * TOKENS + tl.arange(0, TOKENS)
        has_token = tokens < num_tokens
        rows = tokens.to(tl.int64)
        if PER_TOKEN:
            tcols = tl.arange(0, GROUPS * GROUP)
            amax = tl.full((TOKENS,), 0.0, tl.float32)  # tl.full, not tl.zeros: see _kernel_module
            for c0 in range(0, n_cols, GROUPS * GROUP):
                inside = has_token[:, None] & (c0 + tcols < n_cols)[None, :]
                xt = tl.load(x_ptr + rows[:, None] * x_stride + c0 + tcols[None, :], mask=inside, other=0.0)
                amax = tl.maximum(amax, tl.reduce(tl.abs(xt.to(tl.float32)), 1, _larger))
            token_scale = tl.div_rn(tl.maximum(amax, 1e-10), 448.0)
            for c0 in range(0, n_cols, GROUPS * GROUP):
                inside = has_token[:, None] & (c0 + tcols < n_cols)[None, :]
                xt = tl.load(x_ptr + rows[:, None] * x_stride + c0 + tcols[None, :], mask=inside, other=0.0)
                qt = _fp8_bytes(tl.div_rn(xt.to(tl.float32), token_scale[:, None]), HW_FP8)
                for d in tl.static_range(WORLD):
                    dst_t = tl.load(slot_ptr + rows * WORLD + d, mask=has_token, other=not_sent)
                    tl.store(q_ptr + dst_t[:, None] * q_stride + c0 + tcols[None, :], qt,
                             mask=inside & (dst_t < not_sent)[:, None])
            for d in tl.static_range(WORLD):
                dst_s = tl.load(slot_ptr + rows * WORLD + d, mask=has_token, other=not_sent)
                tl.store(s_ptr + dst_s * s_stride, token_scale, mask=dst_s < not_sent)
        else:
            groups = column * GROUPS + tl.arange(0, GROUPS)
            cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            inside = has_token[:, None, None] & (cols < n_cols)[None, :, :]
            x = tl.load(x_ptr + rows[:, None, None] * x_stride + cols[None, :, :], mask=inside, other=0.0)
            x = x.to(tl.float32)
            scale = tl.div_rn(tl.maximum(tl.reduce(tl.abs(x), 2, _larger), 1e-10), 448.0)
            q = _fp8_bytes(tl.div_rn(x, scale[:, :, None]), HW_FP8)
            has_group = has_token[:, None] & (groups * GROUP < n_cols)[None, :]
            for d in tl.static_range(WORLD):
                dst_g = tl.load(slot_ptr + rows * WORLD + d, mask=has_token, other=not_sent)
                tl.store(q_ptr + dst_g[:, None, None] * q_stride + cols[None, :, :], q,
                         mask=inside & (dst_g < not_sent)[:, None, None])
                tl.store(s_ptr + dst_g[:, None] * s_stride + groups[None, :], scale,
                         mask=has_group & (dst_g < not_sent)[:, None])
        if META > 0:
            if column == 0:
                words = tl.arange(0, META)
                in_meta = has_token[:, None] & (meta_start + words < row_words)[None, :]
                meta = tl.load(meta_ptr + rows[:, None] * meta_stride + words[None, :], mask=in_meta, other=0)
                for d in tl.static_range(WORLD):
                    dst_m = tl.load(slot_ptr + rows * WORLD + d, mask=has_token, other=not_sent)
                    tl.store(words_ptr + dst_m[:, None] * words_stride + meta_start + words[None, :], meta,
                             mask=in_meta & (dst_m < not_sent)[:, None])
    elif FIXED:
        for c0 in range(column * BLOCK, row_words, tl.num_programs(1) * BLOCK):
            _fill_empty_rows(words_ptr, words_stride, empty_ptr, counts_ptr, program - token_programs, pad_programs,
                             capacity, row_words, c0 + tl.arange(0, BLOCK))


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
