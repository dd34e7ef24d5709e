"""The block-FP8 grouped GEMM of the fused-MoE experts in Gluon: each K step's product is promoted while the next
one runs on the tensor cores.

Block-scaled FP8 (1x128 activation groups, 128x128 weight blocks) cannot accumulate in the tensor core: each
128-wide K step's product must be multiplied by its row and column scales before it joins the fp32 sum.
Triton's ``tl.dot`` then waits for every product (``wgmma.wait_group 0``) and the tensor cores idle while the
warps scale it, about a third of each step (``docs/perf/hopper.md``). Gluon exposes the asynchronous wgmma
itself, so this kernel keeps one product in flight: it issues step k's wgmma, then waits only for step k-1's
(``warpgroup_mma_wait(1)``) and scales that one while step k runs. The shared-memory slot step k-1 read is then
free, and the next TMA load goes into it: the same warps produce and consume, so no other barrier is needed.

One tile is ``[BLOCK_M, 2 * HALF]``, two ``[HALF, BLOCK_K]`` weight boxes side by side in shared memory and
multiplied as one wgmma: for w1 (``GATED``) the gate rows ``n0`` and the up rows ``N + n0`` of the expert, for w2
two neighbouring column blocks. ``HALF`` divides 128, so each box lies in one weight-scale block and its scale is
one scalar per K step. The input rows are in sorted-slot order (the gathered input for w1, the intermediate
for w2), loaded by TMA like the weights. The epilogue goes through shared memory: w1 writes
``act(gate, up)`` into the sorted intermediate, w2 writes each row to its (token, slot) pair, times its top-k
weight where asked.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# registers of the producer warp (the least a warp can be given): the consumers get the rest of the budget
PRODUCER_REGS = gl.constexpr(24)


@gluon.constexpr_function
def _store_layout(width, num_warps):
    """A blocked layout for [rows, width] epilogue tiles: 8 contiguous elements a thread, rows across warps."""
    cols = min(width // 8, 32)
    return gl.BlockedLayout([1, 8], [32 // cols, cols], [num_warps, 1], [1, 0])


@gluon.jit
def _load_step(loads, ring, step, pred, NUM_STAGES: gl.constexpr):
    """TMA loads of K step ``step`` into its ring slot (none where ``pred`` is false): the A tile and both
    weight boxes, all counted on the slot's ready barrier."""
    a_desc, w_desc, row0, w_lo, w_hi, num_k = loads
    a_smem, b_smem, ready, empty = ring
    HALF: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    slot = step % NUM_STAGES
    bar = ready.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes, pred=pred)
    k0 = step * BLOCK_K
    tma.async_copy_global_to_shared(a_desc, [row0, k0], bar, a_smem.index(slot), pred=pred)
    b = b_smem.index(slot)
    tma.async_copy_global_to_shared(w_desc, [w_lo, k0], bar, b.slice(0, HALF), pred=pred)
    tma.async_copy_global_to_shared(w_desc, [w_hi, k0], bar, b.slice(HALF, HALF), pred=pred)


@gluon.jit
def _producer(loads, ring, NUM_STAGES: gl.constexpr):
    """The copy-engine warp of a warp-specialized program: every K step's loads, each into a slot the consumers
    have released (``empty``; a fresh barrier reads as released once)."""
    num_k = loads[5]
    empty = ring[3]
    for ki in range(num_k):
        mbarrier.wait(empty.index(ki % NUM_STAGES), ((ki // NUM_STAGES) & 1) ^ 1)
        _load_step(loads, ring, ki, True, NUM_STAGES)


@gluon.jit
def _release(loads, ring, step, NUM_STAGES: gl.constexpr, WARP_SPECIALIZE: gl.constexpr):
    """K step ``step``'s wgmma is done: hand its slot to the producer warp, or (one role for all warps) load
    step ``step + NUM_STAGES`` into it now."""
    if WARP_SPECIALIZE:
        mbarrier.arrive(ring[3].index(step % NUM_STAGES), count=1)
    else:
        _load_step(loads, ring, step + NUM_STAGES, step + NUM_STAGES < loads[5], NUM_STAGES)


@gluon.jit
def _step_scales(scales, ki):
    """K step ``ki``'s scales: the rows' (``[BLOCK_M]``) and the two weight boxes' (scalars)."""
    a_scale_ptrs, ws_lo_ptr, ws_hi_ptr, stride_ask, stride_wsk, lo_cols = scales
    a_s = gl.load(a_scale_ptrs + ki * stride_ask)
    return a_s, gl.load(ws_lo_ptr + ki * stride_wsk), gl.load(ws_hi_ptr + ki * stride_wsk)


@gluon.jit
def _add_scaled(acc, product, step_scales, scales):
    """``acc + product * row scale * box scale``, the scales multiplied first: a few products per thread (its
    two rows times the two boxes), then one FMA per element."""
    a_s, w_lo, w_hi = step_scales
    w_s = gl.where(scales[5], w_lo, w_hi)
    return acc + product * (gl.expand_dims(a_s, 1) * gl.expand_dims(w_s, 0))


@gluon.jit
def _issue_step(ring, ki, registers, scales, NUM_STAGES: gl.constexpr):
    """Wait for K step ``ki``'s tiles and issue its wgmma over ``registers`` (``use_acc=False``: their values
    are ignored); returns the product in flight and its scales."""
    a_smem, b_smem, ready, empty = ring
    slot = ki % NUM_STAGES
    mbarrier.wait(ready.index(slot), (ki // NUM_STAGES) & 1)
    product = warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), registers, use_acc=False,
                            is_async=True)
    return product, _step_scales(scales, ki)


@gluon.jit
def _step_group(loads, ring, scales, first, acc, free_a, free_b, COUNT: gl.constexpr, NUM_STAGES: gl.constexpr,
                WARP_SPECIALIZE: gl.constexpr):
    """K steps ``first .. first + COUNT - 1``, each product scaled into ``acc`` while the next one runs.

    Step j's wgmma is issued before step j - 1's is waited for (``warpgroup_mma_wait(1)``), so the warps scale
    one product while the tensor cores compute the next; each waited step's ring slot is released at once. The
    products take turns between two register sets (``free_a``, ``free_b``: their last products already added),
    and the group is unrolled (``COUNT`` is a constexpr) with nothing in flight at its end: a product still in
    flight must never be copied (a loop-carried one would be, at the back edge), or ptxas serializes every
    wgmma of the kernel. Returns the new sum and the two register sets, free again."""
    flight, flight_scales = _issue_step(ring, first, free_a, scales, NUM_STAGES)
    spare = free_b
    for j in gl.static_range(1, COUNT):
        # a wait with nothing to wait for (one product in flight), to pin the last scaling before this wgmma:
        # LLVM otherwise sinks every scaling of the group past its last wgmma, which keeps all the products alive
        acc = warpgroup_mma_wait(1, deps=(acc,))
        issued, issued_scales = _issue_step(ring, first + j, spare, scales, NUM_STAGES)
        spare = warpgroup_mma_wait(1, deps=(flight,))
        acc = _add_scaled(acc, spare, flight_scales, scales)
        _release(loads, ring, first + j - 1, NUM_STAGES, WARP_SPECIALIZE)
        flight = issued
        flight_scales = issued_scales
    done = warpgroup_mma_wait(0, deps=(flight,))
    acc = _add_scaled(acc, done, flight_scales, scales)
    _release(loads, ring, first + COUNT - 1, NUM_STAGES, WARP_SPECIALIZE)
    return acc, done, spare


@gluon.jit
def _k_loop(loads, ring, scales, acc, UNROLL: gl.constexpr, NUM_STAGES: gl.constexpr,
            WARP_SPECIALIZE: gl.constexpr):
    """The whole K loop of one tile into ``acc`` (zeros): groups of ``UNROLL`` steps, then the steps left one
    by one (nothing is in flight across a group's end, see ``_step_group``)."""
    num_k = loads[5]
    free_a = gl.zeros_like(acc)
    free_b = gl.zeros_like(acc)
    num_groups = num_k // UNROLL
    for group in range(num_groups):
        acc, free_a, free_b = _step_group(loads, ring, scales, group * UNROLL, acc, free_a, free_b, UNROLL,
                                          NUM_STAGES, WARP_SPECIALIZE)
    for ki in range(num_groups * UNROLL, num_k):
        acc, free_a, free_b = _step_group(loads, ring, scales, ki, acc, free_a, free_b, 1, NUM_STAGES,
                                          WARP_SPECIALIZE)
    return acc


@gluon.jit
def _consumer(loads, ring, scales, acc, UNROLL: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The default partition of a warp-specialized program: the K loop, its sum as the tuple of results that
    ``gl.warp_specialize`` hands back."""
    return (_k_loop(loads, ring, scales, acc, UNROLL, NUM_STAGES, True),)


@gluon.jit
def _activate(gate, up, swiglu_limit, ACTIVATION: gl.constexpr, HAS_LIMIT: gl.constexpr):
    """The gated activation (codes as ``_kernels.ACT_*``): silu, exact gelu, or swigluoai with its clamp."""
    if HAS_LIMIT:
        gate = gl.minimum(gate, swiglu_limit)
        up = gl.minimum(gl.maximum(up, -swiglu_limit), swiglu_limit)
    if ACTIVATION == 0:
        y = gate / (1.0 + gl.exp(-gate)) * up
    elif ACTIVATION == 1:
        y = 0.5 * gate * (1.0 + gl.erf(gate * 0.7071067811865476)) * up
    else:
        y = (up + 1.0) * (gate / (1.0 + gl.exp(-1.702 * gate)))
    return y


@gluon.jit(do_not_specialize=["num_valid_rows"])
def moe_block_fp8_gemm_kernel(
    a_desc,
    a_scale_ptr,
    w_desc,
    w_scale_ptr,
    out_ptr,
    row_weight_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    N,
    K,
    w_rows_per_expert,
    num_valid_rows,
    swiglu_limit,
    stride_asm,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_om,
    GATED: gl.constexpr,
    ACTIVATION: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    WEIGHT_ROWS: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    UNROLL: gl.constexpr,
    WARP_SPECIALIZE: gl.constexpr,
    num_warps: gl.constexpr,
):
    """One block-FP8 grouped GEMM over the sorted row blocks in use: w1 (``GATED``) into the sorted bf16
    intermediate, or w2 to each pair's row. One program a tile, tiles in grouped order (``GROUP_M`` row blocks
    share each weight tile while it sits in L2); programs past ``num_padded``'s tiles exit at once."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    HALF: gl.constexpr = w_desc.block_type.shape[0]
    TILE_N: gl.constexpr = HALF if GATED else 2 * HALF
    gl.static_assert(BLOCK_K == 128, "one K step is one 128-wide scale group")
    gl.static_assert(128 % HALF == 0, "a weight box must lie in one 128-row scale block")

    num_row_blocks = gl.load(num_padded_ptr) // BLOCK_M
    num_pid_n = gl.cdiv(N, TILE_N)
    tile = gl.program_id(0)
    if tile < num_row_blocks * num_pid_n:
        num_in_group = GROUP_M * num_pid_n
        first_m = (tile // num_in_group) * GROUP_M
        group_rows = gl.minimum(num_row_blocks - first_m, GROUP_M)
        pid_m = first_m + (tile % num_in_group) % group_rows
        pid_n = (tile % num_in_group) // group_rows

        expert = gl.load(block_expert_ptr + pid_m).to(gl.int64)
        row0 = pid_m * BLOCK_M
        n0 = pid_n * TILE_N
        w_row0 = (expert * w_rows_per_expert).to(gl.int32)
        if GATED:
            lo_row = n0
            hi_row = N + n0
        else:
            lo_row = n0
            hi_row = n0 + HALF
        # a box past the last scale block (a ragged N) reads the expert's next rows: their columns are masked
        # on store, and their scale index is clamped to a real block
        last_group = (w_rows_per_expert - 1) // 128
        ws_base = w_scale_ptr + expert * stride_wse
        ws_lo_ptr = ws_base + gl.minimum(lo_row // 128, last_group) * stride_wsn
        ws_hi_ptr = ws_base + gl.minimum(hi_row // 128, last_group) * stride_wsn

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 2 * HALF, 32]
        )
        a_rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        a_scale_ptrs = a_scale_ptr + a_rows.to(gl.int64) * stride_asm
        lo_cols = gl.arange(0, 2 * HALF, layout=gl.SliceLayout(0, mma_layout)) < HALF

        a_smem = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_smem = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, 2 * HALF, BLOCK_K], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        ring = (a_smem, b_smem, ready, empty)
        loads = (a_desc, w_desc, row0, w_row0 + lo_row, w_row0 + hi_row, gl.cdiv(K, BLOCK_K))
        scales = (a_scale_ptrs, ws_lo_ptr, ws_hi_ptr, stride_ask, stride_wsk, lo_cols)
        acc = gl.zeros([BLOCK_M, 2 * HALF], gl.float32, layout=mma_layout)
        if WARP_SPECIALIZE:
            # one producer warp issues the copy-engine loads; the num_warps consumer warps run the wgmmas and
            # the scaling, and never wait for each other (a single-role program synchronizes all its warps at
            # every refill of a slot)
            acc = gl.warp_specialize([
                (_consumer, (loads, ring, scales, acc, UNROLL, NUM_STAGES)),
                (_producer, (loads, ring, NUM_STAGES)),
            ], [1], [PRODUCER_REGS])[0]
        else:
            for s in gl.static_range(NUM_STAGES):
                _load_step(loads, ring, s, s < loads[5], NUM_STAGES)
            acc = _k_loop(loads, ring, scales, acc, UNROLL, NUM_STAGES, WARP_SPECIALIZE)
        for s in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))

        # epilogue through shared memory (which may overlap the ring: every warpgroup's last wgmma must be done
        # first), the two halves coming back in a store-friendly layout
        gl.thread_barrier()
        c_smem = gl.allocate_shared_memory(
            gl.float32, [BLOCK_M, 2 * HALF], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        )
        c_smem.store(acc)
        gl.thread_barrier()
        store_layout: gl.constexpr = _store_layout(HALF, num_warps)
        lo = c_smem.slice(0, HALF, 1).load(store_layout)
        hi = c_smem.slice(HALF, HALF, 1).load(store_layout)
        offs_r = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
        offs_c = gl.arange(0, HALF, layout=gl.SliceLayout(0, store_layout))
        rows = gl.load(sorted_ids_ptr + offs_r).to(gl.int64)
        row_ok = rows < num_valid_rows
        if WEIGHT_ROWS:
            g = gl.expand_dims(gl.load(row_weight_ptr + rows, mask=row_ok, other=0.0).to(gl.float32), 1)
            lo = lo * g
            hi = hi * g
        if GATED:
            y = _activate(lo, hi, swiglu_limit, ACTIVATION, HAS_LIMIT)
            cols = n0 + offs_c
            ptrs = out_ptr + gl.expand_dims(offs_r.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
            gl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(cols < N, 0))
        else:
            row_ptrs = out_ptr + gl.expand_dims(rows * stride_om, 1)
            cols = n0 + offs_c
            gl.store(row_ptrs + gl.expand_dims(cols, 0), lo.to(out_ptr.dtype.element_ty),
                     mask=gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < N, 0))
            cols = cols + HALF
            gl.store(row_ptrs + gl.expand_dims(cols, 0), hi.to(out_ptr.dtype.element_ty),
                     mask=gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < N, 0))
