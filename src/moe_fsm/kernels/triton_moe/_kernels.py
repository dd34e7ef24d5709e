"""The Triton kernels of the fused-MoE experts (imported only where Triton is).

Four kernels make one MoE layer:

* ``align_count_kernel`` / ``align_scatter_kernel``: the alignment step. Each
  (token, slot) pair gets its rank inside its expert from an atomic counter, then
  its slot in a list sorted by expert in which every expert's rows are padded to
  BLOCK_M, so that one program of a GEMM sees one expert only. Buffers are sized
  for the worst case on the host, so nothing waits on the device.
* ``moe_gemm_kernel``: one grouped GEMM over the sorted rows; for w1 it loads the
  gate and the up rows of a column tile together (one [BLOCK_K, 2*BLOCK_N] operand,
  one tensor-core stream) and writes act(gate) * up, optionally quantized to FP8
  in 1x128 groups; for w2 it scales rows by their top-k weight and either writes
  one row per (token, slot) pair or adds it straight into the token's fp32 output
  row (``OUT_ATOMIC_SUM``: the top-k sum folded into w2, which saves writing and
  re-reading a [M * top_k, K] tensor at large batches). ``SWAP_AB`` computes the
  transposed product w @ a^T so that a thin row block (BLOCK_M 16 or 32) sits in
  the tensor-core instruction's N slot, where Hopper's wgmma accepts small sizes,
  and the weight tile in its M slot, which must be 64 rows.
* ``topk_sum_kernel``: the top-k reduction, skipping slots another rank owns.
* ``w2_token_sum_kernel``: the w2 GEMM and the top-k sum in one launch for a few unsorted tokens, one program
  per (token, output tile) summing the token's slots in registers (``config.sums_slots_in_w2`` says where).
* ``group_quant_kernel`` / ``row_quant_kernel`` (with ``tensor_amax_kernel``, or ``small_tensor_quant_kernel``
  for a decode call's small tensors): FP8 activation quantization. Scales and scaled values are
  correctly rounded divisions (``tl.div_rn``): Triton's ``/`` on float32 is an approximate division, which on
  16-bit inputs sitting exactly on an e4m3 midpoint decides the rounding by the ulp it misses, so these kernels
  and ``moe_fsm.kernels.fp8`` (CPU or CUDA) quantize bit for bit alike.

Every kernel here takes a last constexpr ``PDL`` (``_runtime.launch`` sets it): where it is true the kernel
was started as a programmatic dependent launch, and each program waits for the previous kernel before its
first read (``_wait_for_previous_kernel``).

Pointer offsets that can pass 2**31 elements (an expert's offset in a 256-expert
weight tensor, say) are computed in int64. Counts that vary with the batch (rows,
pairs, row blocks) are not specialized on, so one compiled kernel serves every
token count. The GEMM widths N and K are: Triton then knows when they are
multiples of 16, so the column masks of the epilogue (``offs_n < N``) stay
constant over 16-element runs and its stores go out 16 bytes wide instead of
one element at a time, which at large batches (hundreds of MB of output) is the
difference between streaming the output and crawling through it.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

FP8_MAX = 448.0
SCALE_EPS = 1e-10

# constexpr codes shared with the launchers (fused.py)
ACT_SILU, ACT_GELU, ACT_SWIGLUOAI = 0, 1, 2
A_SCALE_NONE, A_SCALE_TENSOR, A_SCALE_TOKEN, A_SCALE_GROUP = 0, 1, 2, 3
W_SCALE_NONE, W_SCALE_TENSOR, W_SCALE_CHANNEL, W_SCALE_BLOCK = 0, 1, 2, 3
OUT_PLAIN, OUT_FP8_TENSOR, OUT_FP8_GROUP, OUT_ATOMIC_SUM = 0, 1, 2, 3


@triton.jit
def _wait_for_previous_kernel(PDL: tl.constexpr):
    """Under programmatic dependent launch: wait until the previous kernel has finished and its writes are
    visible. A kernel that does not call ``_let_next_kernel_start`` lets the next one start as its last
    program exits, before its writes are flushed."""
    if PDL:
        gdc_wait()


@triton.jit
def _let_next_kernel_start(PDL: tl.constexpr):
    """Under programmatic dependent launch: let the next kernel's programs be placed on the SMs now, to wait
    there for this one to finish. Called after the wait, so a kernel that starts early still sees every
    kernel before this one finished. The alignment, the top-k sum, the GEMMs with decode tiles
    (``SWAP_AB``) and the w2 GEMM that sums the top-k slots do; the quantizers and the prefill GEMMs do not. Measured on an H200
    (``docs/perf/decode.md``): with the quantizers doing it, the Mixtral-8x7B FP8 per-tensor layer at 8
    tokens ran 5-15% slower than without PDL; with the prefill GEMMs doing it, Mixtral-8x7B bf16 at 128
    tokens ran 1.5% slower. The causes were not found."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _activate(gate, up, swiglu_limit, ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """The gated activation of the w1 epilogue (codes ``ACT_*``): silu, exact gelu, or gpt-oss's swigluoai with
    its clamp (``HAS_LIMIT``)."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
    if ACTIVATION == 0:
        y = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == 1:
        y = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    else:
        y = (up + 1.0) * (gate * tl.sigmoid(1.702 * gate))
    return y


@triton.jit
def _group_scales(ws_k_ptr, c0, local_cols, last_group, stride_wsn, SPAN: tl.constexpr):
    """Block-FP8 weight scales of the columns ``c0 + local_cols`` at one K step: one uniform load per 128-row
    scale group the tile touches (``SPAN`` of them, ``config.weight_scale_span``), a scalar when it is one.

    A load per column would put the scales in a layout of their own, which Triton converts to the
    accumulator's through shared memory with block-wide barriers at every K step; uniform loads and a select
    on the column index (an ``arange``, rebuilt in any layout for free) need neither.
    """
    g0 = c0 // 128
    rel = (c0 % 128 + local_cols) // 128
    s = tl.load(ws_k_ptr + g0 * stride_wsn)
    for i in tl.static_range(1, SPAN):
        s = tl.where(rel >= i, tl.load(ws_k_ptr + tl.minimum(g0 + i, last_group) * stride_wsn), s)
    return s


@triton.jit
def _block_scaled(product, a_s, w_s, W_SCALAR: tl.constexpr, SWAP_AB: tl.constexpr):
    """One K step's product times its row scales ``a_s`` and weight scales ``w_s`` (per column, or one scalar
    for the tile: then one multiply per element instead of two)."""
    if W_SCALAR:
        if SWAP_AB:
            return product * (a_s * w_s)[None, :]
        else:
            return product * (a_s * w_s)[:, None]
    else:
        if SWAP_AB:
            return product * w_s[:, None] * a_s[None, :]
        else:
            return product * a_s[:, None] * w_s[None, :]


@triton.jit(do_not_specialize=["num_pairs", "max_padded", "num_experts"])
def align_count_kernel(
    topk_ids_ptr, counts_ptr, rank_ptr, sorted_ids_ptr, num_pairs, max_padded, num_experts, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rank each local pair inside its expert and fill the sorted list with the pad sentinel."""
    _wait_for_previous_kernel(PDL)
    _let_next_kernel_start(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(sorted_ids_ptr + offs, tl.zeros((BLOCK,), tl.int32) + num_pairs, mask=offs < max_padded)
    in_range = offs < num_pairs
    expert = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    local = in_range & (expert >= 0) & (expert < num_experts)
    rank = tl.atomic_add(counts_ptr + expert, tl.full((BLOCK,), 1, tl.int32), mask=local)
    tl.store(rank_ptr + offs, rank, mask=local)


@triton.jit(do_not_specialize=["num_pairs", "num_experts", "num_row_blocks"])
def align_scatter_kernel(
    topk_ids_ptr,
    counts_ptr,
    rank_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    num_experts,
    num_row_blocks,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Place each pair at its expert's padded start plus its rank; map row blocks to experts.

    Every program recomputes the padded prefix sum over the (at most a few hundred)
    expert counts: cheaper than a third launch, and no program waits on another.
    """
    _wait_for_previous_kernel(PDL)
    _let_next_kernel_start(PDL)
    pid = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    if pid == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))

    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_pairs
    expert = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    local = in_range & (expert >= 0) & (expert < num_experts)
    rank = tl.load(rank_ptr + offs, mask=local, other=0)
    start = tl.gather(starts, tl.where(local, expert, 0), 0)
    tl.store(sorted_ids_ptr + start + rank, offs, mask=local)

    blocks = pid * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    first_row = blocks * BLOCK_M
    # the owner of a block is the number of experts whose padded range ends at or before it
    owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
    owner = tl.where(owner < num_experts, owner, -1)
    tl.store(block_expert_ptr + blocks, owner, mask=blocks < num_row_blocks)


@triton.jit(do_not_specialize=["num_row_blocks"])
def expert_runs_kernel(block_expert_ptr, num_padded_ptr, run_first_ptr, run_count_ptr, num_row_blocks,
                       BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                       PDL: tl.constexpr):
    """For each row block in use, the first row block of its expert and how many that expert has.

    Row blocks are sorted by expert, so both are two binary searches of ``block_expert`` (``SEARCH_STEPS`` =
    the bits of the block count): where the expert's run starts and where the next one does.
    """
    _wait_for_previous_kernel(PDL)
    _let_next_kernel_start(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_use = tl.load(num_padded_ptr) // BLOCK_M
    valid = offs < in_use
    expert = tl.load(block_expert_ptr + offs, mask=valid, other=0)
    first = tl.zeros((BLOCK,), tl.int32)
    first_hi = tl.zeros((BLOCK,), tl.int32) + in_use
    end = tl.zeros((BLOCK,), tl.int32)
    end_hi = tl.zeros((BLOCK,), tl.int32) + in_use
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (first + first_hi) // 2
        before = tl.load(block_expert_ptr + mid, mask=valid & (first < first_hi), other=0) < expert
        first = tl.where((first < first_hi) & before, mid + 1, first)
        first_hi = tl.where((first < first_hi) & ~before, mid, first_hi)
        mid = (end + end_hi) // 2
        at_or_before = tl.load(block_expert_ptr + mid, mask=valid & (end < end_hi), other=0) <= expert
        end = tl.where((end < end_hi) & at_or_before, mid + 1, end)
        end_hi = tl.where((end < end_hi) & ~at_or_before, mid, end_hi)
    tl.store(run_first_ptr + offs, first, mask=offs < num_row_blocks)
    tl.store(run_count_ptr + offs, end - first, mask=offs < num_row_blocks)


@triton.jit(do_not_specialize=["num_pairs", "num_experts", "max_padded", "num_row_blocks"])
def align_small_kernel(
    topk_ids_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    num_experts,
    max_padded,
    num_row_blocks,
    BLOCK_M: tl.constexpr,
    P_POW2: tl.constexpr,
    E_POW2: tl.constexpr,
    FILL: tl.constexpr,
    BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """The whole alignment of a decode batch (a few hundred pairs) in one program and one launch.

    The general path takes three launches (zeroed counters, atomic ranks, scatter), which at 8-32 tokens cost
    more than the sorting itself. Here the pairs are sorted in registers by (expert, pair): the i-th of them
    goes to its expert's padded start plus i less the pairs of lower experts (pairs of one expert in pair
    order). The pad sentinel is stored over every slot first; a block-wide barrier orders those stores before
    the pairs' own.
    """
    _wait_for_previous_kernel(PDL)
    _let_next_kernel_start(PDL)
    pairs = tl.arange(0, P_POW2)
    expert = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
    local = (pairs < num_pairs) & (expert >= 0) & (expert < num_experts)
    counts = tl.histogram(tl.where(local, expert, 0), E_POW2, mask=local)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    # per expert: padded start less the pairs of lower experts, so slot = that + the pair's sorted position
    offset = ends - padded - (tl.cumsum(counts, 0) - counts)
    key = tl.sort(tl.where(local, expert * P_POW2 + pairs, E_POW2 * P_POW2))
    placed = key < E_POW2 * P_POW2
    slot = tl.gather(offset, tl.where(placed, key // P_POW2, 0), 0) + pairs
    for s0 in range(0, max_padded, FILL):
        slots = s0 + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + slots, tl.zeros((FILL,), tl.int32) + num_pairs, mask=slots < max_padded)
    tl.debug_barrier()
    tl.store(sorted_ids_ptr + slot, key % P_POW2, mask=placed)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    for b0 in range(0, num_row_blocks, BLOCKS):
        blocks = b0 + tl.arange(0, BLOCKS)
        # the owner of a block is the number of experts whose padded range ends at or before it
        owner = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(owner < num_experts, owner, -1), mask=blocks < num_row_blocks)


@triton.jit(do_not_specialize=["num_valid_rows", "num_row_blocks", "num_experts"])
def moe_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    out_scale_ptr,
    out_static_scale_ptr,
    row_weight_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    expert_num_tokens_ptr,
    N,
    K,
    num_valid_rows,
    num_row_blocks,
    num_experts,
    swiglu_limit,
    stride_ae,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_oe,
    stride_om,
    stride_on,
    stride_ase,
    stride_asm,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_ose,
    stride_osm,
    stride_osn,
    A_ROW_DIV: tl.constexpr,
    BATCHED: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    WEIGHT_ROWS: tl.constexpr,
    A_SCALE: tl.constexpr,
    W_SCALE: tl.constexpr,
    OUT_MODE: tl.constexpr,
    EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    OUT_ROW_DIV: tl.constexpr,
    W_SCALE_SPAN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[rows, n-tile] = epilogue(a[rows] @ w[expert, cols]^T) for one row block of one expert.

    N is this GEMM's output width (the intermediate size for w1, hidden for w2). For
    w1 (GATED) the tile reads weight rows n..n+BLOCK_N (gate) and N+n.. (up).
    Standard: rows come from the sorted list (pad rows hold ``num_valid_rows``) and
    the A row is ``pair // A_ROW_DIV``; with PAIR_BLOCKS there is no sorted list:
    row block b holds pair b alone and ``block_expert_ptr`` is topk_ids itself.
    Batched: program axis 1 is the expert and rows are ``0..expert_num_tokens[e]``.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    first_m = (pid // num_in_group) * GROUP_M
    group_rows = min(num_row_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_rows
    pid_n = (pid % num_in_group) // group_rows

    _wait_for_previous_kernel(PDL)
    if SWAP_AB:  # decode tiles (``_let_next_kernel_start``)
        _let_next_kernel_start(PDL)

    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if BATCHED:
        expert = tl.program_id(1).to(tl.int64)
        n_rows = tl.load(expert_num_tokens_ptr + expert)
        if pid_m * BLOCK_M >= n_rows:
            return
        row_ok = offs_r < n_rows
        rows = offs_r.to(tl.int64)
        a_rows = rows
        a_base = a_ptr + expert * stride_ae
        as_base = a_scale_ptr + expert * stride_ase
        out_base = out_ptr + expert * stride_oe
        os_base = out_scale_ptr + expert * stride_ose
    else:
        if PAIR_BLOCKS:
            # one block per (token, slot) pair, its expert read straight from topk_ids
            expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
            if (expert < 0) | (expert >= num_experts):
                return
            rows = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_valid_rows).to(tl.int64)
        else:
            if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
                return
            rows = tl.load(sorted_ids_ptr + offs_r).to(tl.int64)
            expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        row_ok = rows < num_valid_rows
        a_rows = rows // A_ROW_DIV
        a_base = a_ptr
        as_base = a_scale_ptr
        out_base = out_ptr
        os_base = out_scale_ptr

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    if GATED:
        j = tl.arange(0, 2 * BLOCK_N)
        # gate rows first, then the matching up rows; wrapped into range, masked on store
        w_rows = ((pid_n * BLOCK_N + j % BLOCK_N) % N + (j // BLOCK_N) * N).to(tl.int64)
    else:
        w_rows = (offs_n % N).to(tl.int64)

    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    if SWAP_AB:
        a_ptrs = a_base + a_rows[None, :] * stride_am + offs_k[:, None] * stride_ak
        w_ptrs = w_base + w_rows[:, None] * stride_wn + offs_k[None, :] * stride_wk
    else:
        a_ptrs = a_base + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        w_ptrs = w_base + w_rows[None, :] * stride_wn + offs_k[:, None] * stride_wk
    if W_SCALE == 3:
        as_ptrs = as_base + a_rows * stride_asm
        ws_base = w_scale_ptr + expert * stride_wse
        n0 = pid_n * BLOCK_N
        last_group = ((2 * N if GATED else N) - 1) // 128

    if GATED:
        W_COLS: tl.constexpr = 2 * BLOCK_N
    else:
        W_COLS: tl.constexpr = BLOCK_N
    if SWAP_AB:
        acc = tl.zeros((W_COLS, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, W_COLS), dtype=tl.float32)
    for ki in range(0, tl.cdiv(K, BLOCK_K)):
        if SWAP_AB:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[None, :], other=0.0)
                b = tl.load(w_ptrs)
            else:
                k_left = K - ki * BLOCK_K
                a = tl.load(a_ptrs, mask=row_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
                b = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        else:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(w_ptrs)
            else:
                k_left = K - ki * BLOCK_K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
                b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if W_SCALE == 3:
            k_group = (ki * BLOCK_K) // 128
            a_s = tl.load(as_ptrs + k_group * stride_ask, mask=row_ok, other=0.0)
            ws_k = ws_base + k_group * stride_wsk
            if GATED:
                # gate columns, then up columns: one scale vector over the 2 * BLOCK_N weight rows
                w_s = tl.where(
                    j < BLOCK_N,
                    _group_scales(ws_k, n0, j % BLOCK_N, last_group, stride_wsn, W_SCALE_SPAN),
                    _group_scales(ws_k, N + n0, j % BLOCK_N, last_group, stride_wsn, W_SCALE_SPAN),
                )
                if SWAP_AB:
                    acc += _block_scaled(tl.dot(b, a), a_s, w_s, False, True)
                else:
                    acc += _block_scaled(tl.dot(a, b), a_s, w_s, False, False)
            else:
                w_s = _group_scales(ws_k, n0, tl.arange(0, BLOCK_N), last_group, stride_wsn, W_SCALE_SPAN)
                if SWAP_AB:
                    acc += _block_scaled(tl.dot(b, a), a_s, w_s, W_SCALE_SPAN == 1, True)
                else:
                    acc += _block_scaled(tl.dot(a, b), a_s, w_s, W_SCALE_SPAN == 1, False)
        else:
            if SWAP_AB:
                acc = tl.dot(b, a, acc)
            else:
                acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if SWAP_AB:
        acc = tl.trans(acc)

    if A_SCALE == 1:
        acc = acc * tl.load(a_scale_ptr)
    elif A_SCALE == 2:
        acc = acc * tl.load(as_base + a_rows * stride_asm, mask=row_ok, other=0.0)[:, None]
    if W_SCALE == 1:
        acc = acc * tl.load(w_scale_ptr + expert * stride_wse)
    elif W_SCALE == 2:
        acc = acc * tl.load(w_scale_ptr + expert * stride_wse + w_rows * stride_wsn)[None, :]
    if WEIGHT_ROWS:
        acc = acc * tl.load(row_weight_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]

    if GATED:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        y = _activate(gate, up, swiglu_limit, ACTIVATION, HAS_LIMIT)
    else:
        y = acc

    out_ptrs = out_base + (rows // OUT_ROW_DIV)[:, None] * stride_om + offs_n[None, :] * stride_on
    out_mask = row_ok[:, None] & col_ok[None, :]
    if OUT_MODE == 3:
        tl.atomic_add(out_ptrs, y, mask=out_mask, sem="relaxed")
    elif OUT_MODE == 0:
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
    elif OUT_MODE == 1:
        q = tl.clamp(tl.div_rn(y, tl.load(out_static_scale_ptr)), -448.0, 448.0)
        tl.store(out_ptrs, q.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        GROUPS: tl.constexpr = BLOCK_N // 128
        y = tl.where(col_ok[None, :], y, 0.0)
        y3 = tl.reshape(y, (BLOCK_M, GROUPS, 128))
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(y3), axis=2), 1e-10), 448.0)
        q = tl.reshape(tl.clamp(tl.div_rn(y3, scale[:, :, None]), -448.0, 448.0), (BLOCK_M, BLOCK_N))
        tl.store(out_ptrs, q.to(out_ptr.dtype.element_ty), mask=out_mask)
        groups = pid_n * GROUPS + tl.arange(0, GROUPS)
        scale_ptrs = os_base + rows[:, None] * stride_osm + groups[None, :] * stride_osn
        tl.store(scale_ptrs, scale, mask=row_ok[:, None] & (groups[None, :] * 128 < N))


@triton.jit(do_not_specialize=["num_experts"])
def topk_sum_kernel(
    y_ptr, topk_ids_ptr, row_of_pair_ptr, out_ptr, K, num_experts, stride_ym, stride_om, TOP_K: tl.constexpr,
    TOPK_POW2: tl.constexpr, BLOCK: tl.constexpr, ROWS_BY_PAIR: tl.constexpr, PDL: tl.constexpr,
):
    """out[m] = sum over local slots j of pair (m, j)'s row of y: row m * TOP_K + j, or with ``ROWS_BY_PAIR``
    the row ``row_of_pair`` gives it (rows of slots owned elsewhere were never written)."""
    _wait_for_previous_kernel(PDL)
    _let_next_kernel_start(PDL)
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slots = tl.arange(0, TOPK_POW2)
    expert = tl.load(topk_ids_ptr + m * TOP_K + slots, mask=slots < TOP_K, other=-1)
    ok = (slots < TOP_K) & (expert >= 0) & (expert < num_experts)
    rows = m * TOP_K + slots
    if ROWS_BY_PAIR:
        rows = tl.load(row_of_pair_ptr + rows, mask=ok, other=0).to(tl.int64)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs[None, :]
    y = tl.load(y_ptrs, mask=ok[:, None] & (offs[None, :] < K), other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, tl.sum(y, axis=0).to(out_ptr.dtype.element_ty), mask=offs < K)


@triton.jit(do_not_specialize=["num_experts"])
def w2_token_sum_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    row_weight_ptr,
    topk_ids_ptr,
    N,
    K,
    num_experts,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_asm,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    TOP_K: tl.constexpr,
    WEIGHT_ROWS: tl.constexpr,
    A_SCALE: tl.constexpr,
    W_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_SCALE_SPAN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """The w2 GEMM and the top-k sum in one launch, for few tokens: out[m, n-tile] = sum over token m's local
    slots j of g[m, j] * (a[m * TOP_K + j] @ w[e_j, n-tile]^T), summed in fp32 registers, written once.

    One program owns a (token, output tile) and walks that token's slots and each slot's K steps as one
    software-pipelined loop, so the next slot's weight tiles load while this one's multiply. Where each pair has
    a row block of its own (``PairBlocks``) the w2 GEMM reads each pair's expert slice alone anyway; this form
    saves the separate top-k sum launch and the [M * TOP_K, N] rows it would read, with no atomics: the sum
    runs in slot order, so the output does not depend on scheduling. ``N`` is the output width (hidden), ``K``
    the reduction (intermediate); the product is swap-AB (the weight tile in the tensor-core instruction's M
    slot, the pair's row as column 0 of a BLOCK_M-wide operand whose other columns read as zeros). A slot whose
    expert is outside [0, num_experts) (another rank's) loads nothing and adds nothing; a token with none
    gets zeros. Scales: the pair's activation scale (per tensor, per row, or per 1x128 group) and the
    weight's (per tensor, per channel, or per 128x128 block) multiply each K step's product.
    """
    _wait_for_previous_kernel(PDL)
    _let_next_kernel_start(PDL)
    pid_n = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    column = tl.arange(0, BLOCK_M)
    k_steps = tl.cdiv(K, BLOCK_K)
    if W_SCALE == 3:
        n0 = pid_n * BLOCK_N
        last_group = (N - 1) // 128

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for it in range(0, TOP_K * k_steps):
        slot = it // k_steps
        ki = it - slot * k_steps
        pair = token * TOP_K + slot
        expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
        local = (expert >= 0) & (expert < num_experts)
        expert = tl.where(local, expert, 0)
        # masks as bounds (columns of a, weight rows) that are 0 for a slot of another rank: nothing loads, and
        # both masks stay constant along K, so the loads keep their 16-byte width
        a_ok = column[None, :] < tl.where(local, 1, 0)
        w_ok = offs_n[:, None] < tl.where(local, N, 0)
        k0 = ki * BLOCK_K
        a_ptrs = a_ptr + pair * stride_am + (k0 + offs_k)[:, None] * stride_ak + column[None, :] * 0
        w_ptrs = w_ptr + expert * stride_we + w_rows[:, None] * stride_wn + (k0 + offs_k)[None, :] * stride_wk
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_ok, other=0.0)
            b = tl.load(w_ptrs, mask=w_ok, other=0.0)
        else:
            a = tl.load(a_ptrs, mask=a_ok & ((k0 + offs_k)[:, None] < K), other=0.0)
            b = tl.load(w_ptrs, mask=w_ok & ((k0 + offs_k)[None, :] < K), other=0.0)
        # the slot's scalar factor: its router weight and the per-tensor / per-row scales
        factor = tl.where(local, 1.0, 0.0)
        if WEIGHT_ROWS:
            factor = factor * tl.load(row_weight_ptr + pair).to(tl.float32)
        if A_SCALE == 1:
            factor = factor * tl.load(a_scale_ptr)
        elif A_SCALE == 2:
            factor = factor * tl.load(a_scale_ptr + pair * stride_asm)
        if W_SCALE == 1:
            factor = factor * tl.load(w_scale_ptr + expert * stride_wse)
        product = tl.dot(b, a)
        if W_SCALE == 2:
            w_s = tl.load(w_scale_ptr + expert * stride_wse + w_rows * stride_wsn)
            acc += product * (w_s * factor)[:, None]
        elif W_SCALE == 3:
            k_group = k0 // 128
            a_s = tl.load(a_scale_ptr + pair * stride_asm + k_group * stride_ask) * factor
            w_s = _group_scales(w_scale_ptr + expert * stride_wse + k_group * stride_wsk, n0, tl.arange(0, BLOCK_N),
                                last_group, stride_wsn, W_SCALE_SPAN)
            if W_SCALE_SPAN == 1:
                acc += product * (w_s * a_s)
            else:
                acc += product * (w_s * a_s)[:, None]
        else:
            acc += product * factor
    # only column 0 holds a pair's product (the others multiplied zeros)
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + token * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def group_quant_kernel(
    x_ptr, q_ptr, s_ptr, K, num_groups, stride_xm, stride_qm, stride_sm, GROUPS: tl.constexpr, GROUP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Dynamic per-token, per-GROUP-columns FP8: scale = max(amax, eps) / 448."""
    _wait_for_previous_kernel(PDL)
    m = tl.program_id(0).to(tl.int64)
    groups, cols, q, scale = quantize_row_groups(x_ptr + m * stride_xm, K, GROUPS, GROUP)
    tl.store(q_ptr + m * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
    tl.store(s_ptr + m * stride_sm + groups, scale, mask=groups < num_groups)


@triton.jit
def quantize_row_groups(row_ptr, K, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """This program's ``GROUPS`` 1x``GROUP`` groups of one row (program axis 1 picks them) in FP8 range: (group
    indices, columns, quantized values still fp32, per-group scales ``max(amax, 1e-10) / 448``). Columns past
    ``K`` read as zeros."""
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(row_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10), 448.0)
    return groups, cols, tl.clamp(tl.div_rn(x, scale[:, None]), -448.0, 448.0), scale


@triton.jit
def row_quant_kernel(
    x_ptr, q_ptr, s_ptr, scale_in_ptr, K, stride_xm, stride_qm, SCALE_FROM: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """FP8 rows with a dynamic per-row scale (SCALE_FROM 0: one program per whole row), one given scale (1), or
    the scale of the tensor's absolute maximum found before in ``scale_in_ptr`` (2; program (0, 0) stores the
    scale in ``s_ptr``). Given and found scales split a row over a second grid axis of BLOCK-column pieces:
    the correctly rounded divisions, not the bytes, bound a small tensor's quantization."""
    _wait_for_previous_kernel(PDL)
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + m * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    if SCALE_FROM == 0:
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10), 448.0)
        tl.store(s_ptr + m, scale)
    elif SCALE_FROM == 1:
        scale = tl.load(scale_in_ptr)
    else:
        scale = tl.div_rn(tl.maximum(tl.load(scale_in_ptr), 1e-10), 448.0)
        if (m == 0) & (tl.program_id(1) == 0):
            tl.store(s_ptr, scale)
    q = tl.clamp(tl.div_rn(x, scale), -448.0, 448.0)
    tl.store(q_ptr + m * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def tensor_amax_kernel(x_ptr, amax_ptr, K, stride_xm, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row's absolute maximum, folded into ``amax_ptr[0]`` (zeroed before) by an atomic max: max is exact,
    so the order the rows arrive in changes nothing."""
    _wait_for_previous_kernel(PDL)
    m = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + m * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0), sem="relaxed")


@triton.jit
def small_tensor_quant_kernel(
    x_ptr, q_ptr, s_ptr, amax_ptr, num_rows, K, stride_xm, stride_qm,
    QUANTIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """A small tensor (a decode call's input or intermediate) in one program and one load, the whole [ROWS,
    BLOCK] tile in registers: its absolute maximum into ``amax_ptr``, and with QUANTIZE the scale and the FP8
    values too, in one launch where the general path takes three."""
    _wait_for_previous_kernel(PDL)
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    if QUANTIZE:
        scale = tl.div_rn(tl.maximum(amax, 1e-10), 448.0)
        tl.store(s_ptr, scale)
        q = tl.clamp(tl.div_rn(x, scale), -448.0, 448.0)
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(amax_ptr, amax)
