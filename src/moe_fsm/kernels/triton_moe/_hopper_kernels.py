"""The Hopper (sm_90) grouped GEMM of the fused-MoE experts: tensor-descriptor loads and a persistent tile loop.

Same math as ``moe_gemm_kernel`` (``_kernels.py``) on sorted row blocks, built the way Hopper moves data:

* Weights come through a host-built tensor descriptor over ``[E * rows, K]``: the copy engine (TMA) fetches
  whole ``[BLOCK_N, BLOCK_K]`` tiles into shared memory, swizzled for wgmma, with no per-thread address
  arithmetic or masks. The w1 GEMM fetches the gate tile and the up tile as two loads and keeps two
  accumulators, so the activation pairs columns without a shuffle; or (``PAIRED``) both tiles as one
  ``[2, BLOCK_N, BLOCK_K]`` box of the ``[E * 2, N, K]`` view, one wgmma twice as wide, split in the epilogue.
* The intermediate lives in sorted-row order (``[padded rows, N]``, row = slot in the sorted list): the w1
  GEMM writes each output tile with one TMA store and the w2 GEMM reads its A tiles through a descriptor
  as well. The w1 GEMM's A rows are a gather (token = pair // top_k), which Hopper's copy engine cannot
  do: they are either pointer loads (``cp.async``) or, with ``MoEConfig.gather_input``, first copied into
  sorted order by ``gather_rows_kernel`` and then loaded through a descriptor like the rest.
* ``PERSISTENT``: one program per SM walks the tiles (row block, N block) in grouped order; the tile count
  comes from the device (``num_padded``), so no program starts for the worst case's padding. With ``FLATTEN``
  Triton fuses the tile loop and the K loop into one software-pipelined loop, so the next tile's first
  loads overlap the last one's epilogue.

Pad rows of a block (sentinel ``num_valid_rows``) read zeros in the w1 GEMM and so leave zeros (or FP8
zeros with the smallest scale) in the intermediate, which the w2 GEMM then reads and masks out on store.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_fsm.kernels.triton_moe._kernels import _activate, _block_scaled, _group_scales, quantize_row_groups


@triton.jit
def _grouped_tile(tile, num_row_blocks, num_pid_n, GROUP_M: tl.constexpr):
    """(row block, N block) of a tile: GROUP_M row blocks share each weight tile while it sits in L2."""
    num_in_group = GROUP_M * num_pid_n
    first_m = (tile // num_in_group) * GROUP_M
    group_rows = min(num_row_blocks - first_m, GROUP_M)
    pid_m = first_m + (tile % num_in_group) % group_rows
    pid_n = (tile % num_in_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _a_tile(a_desc, a_ptrs, row0, k0, row_ok, offs_k, K, A_SORTED: tl.constexpr):
    """One [BLOCK_M, BLOCK_K] tile of A at column k0: a descriptor load of sorted rows, or the gathered rows'
    pointer loads (``cp.async``), pad rows and columns past K read as zeros."""
    if A_SORTED:
        a = a_desc.load([row0, k0])
    else:
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & (offs_k[None, :] < K - k0), other=0.0)
    return a


@triton.jit
def _store_inter(out_ptr, out_desc, val, offs_r, offs_n, col_ok, row0, n0, stride_om, WARP_SPECIALIZE: tl.constexpr):
    """One w1 output tile into the sorted-order intermediate (every row of a row block exists there).

    A TMA store, except after a warp-specialized K loop: Triton 3.6 splits such a tile's rows between two
    consumer warpgroups and then cannot lower a descriptor store of the whole [BLOCK_M, BLOCK_N] tile ("tensor
    descriptor block and tensor types must match" with BLOCK_M 128), so those tiles go through pointers.
    """
    if WARP_SPECIALIZE:
        ptrs = out_ptr + offs_r.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=col_ok[None, :])
    else:
        out_desc.store([row0, n0], val.to(out_desc.dtype))


@triton.jit
def _moe_tile(
    tile,
    num_row_blocks,
    a_ptr,
    a_desc,
    a_scale_ptr,
    w_desc,
    w_scale_ptr,
    out_ptr,
    out_desc,
    out_scale_ptr,
    out_static_scale_ptr,
    row_weight_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    N,
    K,
    w_rows_per_expert,
    num_valid_rows,
    swiglu_limit,
    stride_am,
    stride_om,
    stride_asm,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_osm,
    stride_osn,
    A_ROW_DIV: tl.constexpr,
    A_SORTED: tl.constexpr,
    OUT_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    PAIRED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    WEIGHT_ROWS: tl.constexpr,
    A_SCALE: tl.constexpr,
    W_SCALE: tl.constexpr,
    W_SCALE_SPAN: tl.constexpr,
    OUT_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    pid_m, pid_n = _grouped_tile(tile, num_row_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    # no check of the owner: a tile below num_padded always belongs to a real expert (align_tokens places only
    # valid ids), and a branch around the K loop would keep Triton from flattening a FLATTEN tile loop into one
    # pipelined loop (its loop-nest fusion does not look through scf.if)
    block_owner = tl.load(block_expert_ptr + pid_m)
    expert = block_owner.to(tl.int64)
    row0 = pid_m * BLOCK_M
    offs_r = row0 + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_r).to(tl.int64)
    row_ok = rows < num_valid_rows
    if A_SORTED:
        a_rows = offs_r.to(tl.int64)
    else:
        a_rows = rows // A_ROW_DIV
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    w_row0 = (expert * w_rows_per_expert).to(tl.int32)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    if W_SCALE == 3:
        as_ptrs = a_scale_ptr + a_rows * stride_asm
        ws_base = w_scale_ptr + expert * stride_wse
        last_group = ((2 * N if GATED else N) - 1) // 128

    if PAIRED:
        # gate and up tiles in one [2, BLOCK_N, BLOCK_K] box of the [E * 2, N, K] view: one wgmma twice as wide
        j = tl.arange(0, 2 * BLOCK_N)
        acc2 = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for ki in tl.range(0, tl.cdiv(K, BLOCK_K), warp_specialize=WARP_SPECIALIZE):
            k0 = ki * BLOCK_K
            a = _a_tile(a_desc, a_ptrs, row0, k0, row_ok, offs_k, K, A_SORTED)
            b2 = tl.reshape(w_desc.load([(2 * expert).to(tl.int32), n0, k0]), (2 * BLOCK_N, BLOCK_K)).T
            if W_SCALE == 3:
                a_s = tl.load(as_ptrs + (k0 // 128) * stride_ask, mask=row_ok, other=0.0)
                ws_k = ws_base + (k0 // 128) * stride_wsk
                w_s2 = tl.where(
                    j < BLOCK_N,
                    _group_scales(ws_k, n0, j % BLOCK_N, last_group, stride_wsn, W_SCALE_SPAN),
                    _group_scales(ws_k, N + n0, j % BLOCK_N, last_group, stride_wsn, W_SCALE_SPAN),
                )
                acc2 += _block_scaled(tl.dot(a, b2), a_s, w_s2, False, False)
            else:
                acc2 = tl.dot(a, b2, acc2)
        acc, acc_up = tl.split(tl.permute(tl.reshape(acc2, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in tl.range(0, tl.cdiv(K, BLOCK_K), warp_specialize=WARP_SPECIALIZE):
            k0 = ki * BLOCK_K
            a = _a_tile(a_desc, a_ptrs, row0, k0, row_ok, offs_k, K, A_SORTED)
            b = w_desc.load([w_row0 + n0, k0]).T
            if W_SCALE == 3:
                a_s = tl.load(as_ptrs + (k0 // 128) * stride_ask, mask=row_ok, other=0.0)
                ws_k = ws_base + (k0 // 128) * stride_wsk
                w_s = _group_scales(ws_k, n0, tl.arange(0, BLOCK_N), last_group, stride_wsn, W_SCALE_SPAN)
                acc += _block_scaled(tl.dot(a, b), a_s, w_s, W_SCALE_SPAN == 1, False)
                if GATED:
                    bu = w_desc.load([w_row0 + N + n0, k0]).T
                    w_su = _group_scales(ws_k, N + n0, tl.arange(0, BLOCK_N), last_group, stride_wsn, W_SCALE_SPAN)
                    acc_up += _block_scaled(tl.dot(a, bu), a_s, w_su, W_SCALE_SPAN == 1, False)
            else:
                acc = tl.dot(a, b, acc)
                if GATED:
                    bu = w_desc.load([w_row0 + N + n0, k0]).T
                    acc_up = tl.dot(a, bu, acc_up)

    if A_SCALE == 1:
        a_t = tl.load(a_scale_ptr)
        acc = acc * a_t
        acc_up = acc_up * a_t
    elif A_SCALE == 2:
        a_tok = tl.load(a_scale_ptr + a_rows * stride_asm, mask=row_ok, other=0.0)[:, None]
        acc = acc * a_tok
        acc_up = acc_up * a_tok
    if W_SCALE == 1:
        w_t = tl.load(w_scale_ptr + expert * stride_wse)
        acc = acc * w_t
        acc_up = acc_up * w_t
    elif W_SCALE == 2:
        ws_base = w_scale_ptr + expert * stride_wse
        acc = acc * tl.load(ws_base + offs_n * stride_wsn, mask=col_ok, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(ws_base + (N + offs_n) * stride_wsn, mask=col_ok, other=0.0)[None, :]
    if WEIGHT_ROWS:
        g = tl.load(row_weight_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        acc = acc * g
        acc_up = acc_up * g

    if GATED:
        y = _activate(acc, acc_up, swiglu_limit, ACTIVATION, HAS_LIMIT)
        # sorted-order output: one TMA store per tile (columns past N are clipped by the descriptor)
        if OUT_MODE == 0:
            _store_inter(out_ptr, out_desc, y, offs_r, offs_n, col_ok, row0, n0, stride_om, WARP_SPECIALIZE)
        elif OUT_MODE == 1:
            q = tl.clamp(tl.div_rn(y, tl.load(out_static_scale_ptr)), -448.0, 448.0)
            _store_inter(out_ptr, out_desc, q, offs_r, offs_n, col_ok, row0, n0, stride_om, WARP_SPECIALIZE)
        else:
            GROUPS: tl.constexpr = BLOCK_N // 128
            y = tl.where(col_ok[None, :], y, 0.0)
            y3 = tl.reshape(y, (BLOCK_M, GROUPS, 128))
            scale = tl.div_rn(tl.maximum(tl.max(tl.abs(y3), axis=2), 1e-10), 448.0)
            q = tl.reshape(tl.clamp(tl.div_rn(y3, scale[:, :, None]), -448.0, 448.0), (BLOCK_M, BLOCK_N))
            _store_inter(out_ptr, out_desc, q, offs_r, offs_n, col_ok, row0, n0, stride_om, WARP_SPECIALIZE)
            groups = pid_n * GROUPS + tl.arange(0, GROUPS)
            scale_ptrs = out_scale_ptr + offs_r[:, None] * stride_osm + groups[None, :] * stride_osn
            tl.store(scale_ptrs, scale, mask=groups[None, :] * 128 < N)
    else:
        # w2: rows go back to their (token, slot) pair, or are summed into the token's row
        out_ptrs = out_ptr + (rows // OUT_ROW_DIV)[:, None] * stride_om + offs_n[None, :]
        out_mask = row_ok[:, None] & col_ok[None, :]
        if OUT_MODE == 3:
            tl.atomic_add(out_ptrs, acc, mask=out_mask, sem="relaxed")
        else:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_valid_rows"])
def moe_gemm_tma_kernel(
    a_ptr,
    a_desc,
    a_scale_ptr,
    w_desc,
    w_scale_ptr,
    out_ptr,
    out_desc,
    out_scale_ptr,
    out_static_scale_ptr,
    row_weight_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    N,
    K,
    w_rows_per_expert,
    num_valid_rows,
    swiglu_limit,
    stride_am,
    stride_om,
    stride_asm,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_osm,
    stride_osn,
    A_ROW_DIV: tl.constexpr,
    A_SORTED: tl.constexpr,
    OUT_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    PAIRED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    WEIGHT_ROWS: tl.constexpr,
    A_SCALE: tl.constexpr,
    W_SCALE: tl.constexpr,
    W_SCALE_SPAN: tl.constexpr,
    OUT_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,
    FLATTEN: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """One grouped GEMM over the sorted row blocks in use (``num_padded`` rows), w1 (GATED) or w2.

    w1: ``out[slot, n] = act(a[pair // top_k] @ w1[e, n]^T, a[...] @ w1[e, N + n]^T)`` into the sorted-order
    intermediate (plain, FP8 with a static scale, or FP8 in 1x128 groups). w2: ``inter[slot] @ w2[e]^T``,
    times the row's top-k weight, to the pair's row or added into the token's fp32 row (``OUT_MODE`` 3).
    """
    num_row_blocks = tl.load(num_padded_ptr) // BLOCK_M
    num_tiles = num_row_blocks * tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        first = tl.program_id(0)
        step = NUM_PROGRAMS
    else:
        first = tl.program_id(0)
        step = tl.num_programs(0)
    for tile in tl.range(first, num_tiles, step, flatten=FLATTEN):
        _moe_tile(
            tile, num_row_blocks, a_ptr, a_desc, a_scale_ptr, w_desc, w_scale_ptr, out_ptr, out_desc, out_scale_ptr,
            out_static_scale_ptr, row_weight_ptr, sorted_ids_ptr, block_expert_ptr, N, K, w_rows_per_expert,
            num_valid_rows, swiglu_limit, stride_am, stride_om, stride_asm, stride_ask, stride_wse,
            stride_wsn, stride_wsk, stride_osm, stride_osn, A_ROW_DIV, A_SORTED, OUT_ROW_DIV, GATED, PAIRED, ACTIVATION,
            HAS_LIMIT, WEIGHT_ROWS, A_SCALE, W_SCALE, W_SCALE_SPAN, OUT_MODE, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
            WARP_SPECIALIZE,
        )


@triton.jit(do_not_specialize=["num_valid_rows"])
def gather_rows_kernel(
    src_ptr,
    src_scale_ptr,
    dst_ptr,
    dst_scale_ptr,
    sorted_ids_ptr,
    num_padded_ptr,
    num_valid_rows,
    K,
    num_groups,
    stride_src,
    stride_dst,
    stride_src_scale,
    stride_dst_scale,
    ROW_DIV: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
):
    """dst[slot] = src[pair // ROW_DIV] for each sorted slot in use, zeros for pad slots (scales alike).

    This puts the w1 GEMM's A operand in sorted-row order, so the copy engine can load it: one pass over
    the activations (each token once per top-k slot) buys TMA loads for the GEMM's whole K loop.
    """
    slot = tl.program_id(0)
    if slot < tl.load(num_padded_ptr):
        pair = tl.load(sorted_ids_ptr + slot)
        valid = pair < num_valid_rows
        src_row = tl.where(valid, pair // ROW_DIV, 0).to(tl.int64)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(src_ptr + src_row * stride_src + cols, mask=(cols < K) & valid, other=0.0)
            tl.store(dst_ptr + slot.to(tl.int64) * stride_dst + cols, x, mask=cols < K)
        if HAS_SCALE:
            groups = tl.arange(0, GROUPS_POW2)
            s = tl.load(src_scale_ptr + src_row * stride_src_scale + groups, mask=(groups < num_groups) & valid, other=0.0)
            tl.store(dst_scale_ptr + slot.to(tl.int64) * stride_dst_scale + groups, s, mask=groups < num_groups)


@triton.jit(do_not_specialize=["num_valid_rows"])
def pair_slots_kernel(sorted_ids_ptr, num_padded_ptr, num_valid_rows, slot_of_pair_ptr, BLOCK: tl.constexpr):
    """slot_of_pair[pair] = slot for every sorted slot in use that holds a pair: the inverse of ``sorted_ids``
    (pairs routed to no local expert keep the -1 they were given)."""
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pairs = tl.load(sorted_ids_ptr + slots, mask=slots < tl.load(num_padded_ptr), other=num_valid_rows)
    tl.store(slot_of_pair_ptr + pairs, slots, mask=pairs < num_valid_rows)


@triton.jit
def quantize_into_slots_kernel(
    x_ptr, q_ptr, s_ptr, slot_of_pair_ptr, K, num_groups, stride_xm, stride_qm, stride_sm, TOP_K: tl.constexpr,
    GROUPS: tl.constexpr, GROUP: tl.constexpr,
):
    """Token ``m``'s 1x``GROUP`` FP8 groups (``_kernels.quantize_row_groups``, as the quantization pass), written to the
    sorted slot of each of its ``TOP_K`` pairs that has one: the gathered w1 input of a block-FP8 layer, each
    token read once instead of quantized, written, then read again ``TOP_K`` times by a gather pass."""
    m = tl.program_id(0).to(tl.int64)
    groups, cols, q, scale = quantize_row_groups(x_ptr + m * stride_xm, K, GROUPS, GROUP)
    q = q.to(q_ptr.dtype.element_ty)
    mask = cols < K
    for j in tl.static_range(TOP_K):
        slot = tl.load(slot_of_pair_ptr + m * TOP_K + j).to(tl.int64)
        if slot >= 0:
            tl.store(q_ptr + slot * stride_qm + cols, q, mask=mask)
            tl.store(s_ptr + slot * stride_sm + groups, scale, mask=groups < num_groups)


@triton.jit(do_not_specialize=["num_valid_rows"])
def quantize_real_rows_kernel(
    x_ptr, q_ptr, s_ptr, sorted_ids_ptr, num_padded_ptr, num_valid_rows, K, num_groups, stride_xm, stride_qm,
    stride_sm, GROUPS: tl.constexpr, GROUP: tl.constexpr,
):
    """Sorted row ``m``'s 1x``GROUP`` FP8 groups (``_kernels.quantize_row_groups``, as the quantization pass) where
    it holds a pair: the Gluon w1 GEMM's intermediate, whose pad rows and rows past the ones in use (a third of
    the buffer at 8192 tokens of DeepSeek-V3) no real row ever reads."""
    m = tl.program_id(0)
    if m < tl.load(num_padded_ptr):
        if tl.load(sorted_ids_ptr + m) < num_valid_rows:
            row = m.to(tl.int64)
            groups, cols, q, scale = quantize_row_groups(x_ptr + row * stride_xm, K, GROUPS, GROUP)
            tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
            tl.store(s_ptr + row * stride_sm + groups, scale, mask=groups < num_groups)
