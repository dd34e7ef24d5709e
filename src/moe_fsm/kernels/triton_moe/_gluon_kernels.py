"""The block-FP8 grouped GEMM of the fused-MoE experts in Gluon: each K step's product is scaled while the next
one runs on the tensor cores, and a producer warp feeds the copy engine.

Block-scaled FP8 (1x128 activation groups, 128x128 weight blocks) cannot accumulate in the tensor core: each
128-wide K step's product must be multiplied by its row and column scales before it joins the fp32 sum.
Triton's ``tl.dot`` then waits for every product (``wgmma.wait_group 0``) and the tensor cores idle while the
warps scale it (``docs/perf/hopper.md``). Gluon exposes the asynchronous wgmma itself, so this kernel keeps one
product in flight: it issues step k's wgmma, then waits only for step k-1's (``warpgroup_mma_wait(1)``) and
scales that one while step k runs (``_step_group``).

* **Tiles.** A tile is ``[BLOCK_M, 2 * HALF]``: two ``[HALF, BLOCK_K]`` weight boxes side by side in shared
  memory, multiplied as one wgmma; for w1 (``GATED``) the gate rows ``n0`` and the up rows ``N + n0`` of the
  expert, for w2 two neighbouring column blocks. ``HALF`` divides 128, so each box lies in one weight-scale
  block and its scale is one scalar per K step. The input rows are in sorted-slot order (for w1 the input
  quantized or gathered into it, for w2 the intermediate), loaded by TMA like the weights; a row block whose
  second half is pads (an expert's last) loads only its first half of A rows. The epilogue computes in
  registers, puts the rounded tile in shared memory and has the copy engine store it while the math warps go
  on (``_epilogue``): the outputs are in sorted order too, w1's ``act(gate, up)`` (the intermediate, quantized
  in 1x128 groups after the GEMM, as vLLM does) and w2's products times their top-k weight where asked (the
  top-k sum finds each pair's row by its slot).
* **Two warpgroups side by side** (``SPLIT_N = 2``: 8 math warps on 64-row blocks): each warpgroup multiplies
  the block's one A tile by a ``[2 * HALF, BLOCK_K]`` weight tile of its own (w1: gate and up boxes of the next
  ``HALF`` columns; w2: the next two column blocks), so a 64-row block, half the pad rows of a 128-row one where
  experts get 100-300 rows, still gives the tensor cores two warpgroups' work per program
  (``docs/perf/hopper.md``: one warpgroup alone ran a tile about 1.7 times as long as two sharing it).
* **Warp specialization** (``WARP_SPECIALIZE``, Gluon's explicit partitions): one producer warp issues every
  load into a ring of ``NUM_STAGES`` slots and the ``num_warps`` math warps hand each slot back through an
  mbarrier when its wgmma is done. Without it the math warps load too, refilling each slot as it frees.
* **Persistence** (``PERSISTENT``, with a producer): one program per SM walks its tiles; the producer runs
  ahead across them, so a tile's first loads overlap the last one's epilogue.
* **Tile order**: expert by expert (``_tile_origin``, from ``align.expert_runs``), so each expert's weight tiles
  are read from memory once. A tile's metadata is loaded before it is needed: the next tile's origin while the
  current one runs, whether its second half is pads a tile ahead too (the producer), each row's top-k weight
  before its K loop (``_row_weights``).

Quantizing the intermediate in the w1 epilogue was built twice and measured (``docs/perf/hopper.md``): it saves
the 230 µs quantization pass, but a divide per value slowed w1 by 1.5-2 ms on the DeepSeek-V3 layer at 8192
tokens, and with a division free of divides the order that keeps a 128-column group in one program cost w1
nearly what the pass costs; so the quantization stays a pass of its own.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# registers of the producer warp (the least a warp can be given): the consumers get the rest of the budget
PRODUCER_REGS = gl.constexpr(24)


@gluon.jit
def _tile_origin(tile, tiles, weights, runs, GATED: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr,
                 HALF: gl.constexpr, SPLIT_N: gl.constexpr):
    """Where tile ``tile`` starts: (first sorted row, first output column, first rows of its first two weight
    boxes in the ``[E * rows, K]`` weight view; with ``SPLIT_N = 2`` the second warpgroup's two boxes follow them
    at ``_box_step``). A tile past the last (a prefetch beyond the program's share) reads
    nothing out of bounds: it comes back as row block 0's.

    Tiles go expert by expert: the tiles of an expert's row blocks are the row-major tile numbers of those blocks
    (``runs``: each block's run of its expert), walked in groups of up to ``GROUP_M`` row blocks that take each
    weight tile in turn. An expert's weight tiles are then read from memory once, by its row blocks one after
    the other, while its input rows stay in L2; groups cut across experts (row blocks numbered straight through)
    read the weights of an expert split between two groups twice.
    """
    num_row_blocks, num_pid_n, num_k = tiles
    w_desc, w_scale_ptr, block_expert_ptr, N, w_rows_per_expert, stride_wse, stride_wsn, stride_wsk = weights
    run_first_ptr, run_count_ptr = runs
    exists = tile < num_row_blocks * num_pid_n
    block = tile // num_pid_n
    run_first = gl.load(run_first_ptr + block, mask=exists, other=0)
    run_count = gl.load(run_count_ptr + block, mask=exists, other=1)
    local = tile - run_first * num_pid_n
    num_in_group = GROUP_M * num_pid_n
    first_m = run_first + (local // num_in_group) * GROUP_M
    group_rows = gl.minimum(run_first + run_count - first_m, GROUP_M)
    pid_m = gl.where(exists, first_m + (local % num_in_group) % group_rows, 0)
    pid_n = (local % num_in_group) // group_rows
    expert = gl.load(block_expert_ptr + pid_m).to(gl.int64)
    w_row0 = (expert * w_rows_per_expert).to(gl.int32)
    if GATED:
        n0 = pid_n * HALF * SPLIT_N
        hi_row = N + n0
    else:
        n0 = pid_n * 2 * HALF * SPLIT_N
        hi_row = n0 + HALF
    return pid_m * BLOCK_M, n0, expert, w_row0 + n0, w_row0 + hi_row


@gluon.jit
def _tile_range(tiles, PERSISTENT: gl.constexpr):
    """The tiles this program runs: every ``num_programs``-th from its id (``PERSISTENT``), else its id's own."""
    num_tiles = tiles[0] * tiles[1]
    first = gl.program_id(0)
    if PERSISTENT:
        last = num_tiles
    else:
        last = gl.minimum(first + 1, num_tiles)
    return first, last, gl.num_programs(0)


@gluon.jit
def _box_step(GATED: gl.constexpr, HALF: gl.constexpr):
    """Weight rows from a warpgroup's boxes to the next warpgroup's (``SPLIT_N = 2``): w1's gate and up boxes each
    move on by ``HALF`` columns, w2's two column blocks by both of them."""
    return HALF if GATED else 2 * HALF


@gluon.jit
def _upper_half_pads(sorted_ids_ptr, row0, num_valid_rows, BLOCK_M: gl.constexpr):
    """Whether the row block at ``row0`` holds pad rows only past its first half: an expert's last block with at
    most ``BLOCK_M // 2`` rows (pad rows end an expert's last block)."""
    return gl.load(sorted_ids_ptr + row0 + BLOCK_M // 2) >= num_valid_rows


@gluon.jit
def _load_step(loads, ring, step, ki, pred, NUM_STAGES: gl.constexpr):
    """TMA loads of K step ``ki`` into the ring slot of the program's ``step``-th step (none where ``pred`` is
    false): the A tile and the ``2 * SPLIT_N`` weight boxes (pair ``j`` at ``box_step * j`` rows), all counted
    on the slot's ready barrier. A tile whose second half is pads (``half_a``) loads its first half of A rows only
    (``a_half_desc``): the math warps still multiply all of the slot's rows, and the rows not loaded hold an
    earlier step's, whose products are pad rows' (never stored by w2, and w1's pad rows are never read into a
    real one)."""
    a_desc, a_half_desc, w_desc, row0, w_lo, w_hi, half_a, box_step = loads
    a_smem, b_smem, ready, empty = ring
    HALF: gl.constexpr = w_desc.block_type.shape[0]
    SPLIT_N: gl.constexpr = b_smem.shape[1] // (2 * HALF)
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    slot = step % NUM_STAGES
    bar = ready.index(slot)
    w_bytes: gl.constexpr = 2 * SPLIT_N * w_desc.block_type.nbytes
    mbarrier.expect(bar, a_desc.block_type.nbytes + w_bytes, pred=pred and not half_a)
    mbarrier.expect(bar, a_half_desc.block_type.nbytes + w_bytes, pred=pred and half_a)
    k0 = ki * BLOCK_K
    tma.async_copy_global_to_shared(a_desc, [row0, k0], bar, a_smem.index(slot), pred=pred and not half_a)
    tma.async_copy_global_to_shared(a_half_desc, [row0, k0], bar,
                                    a_smem.index(slot).slice(0, a_half_desc.block_type.shape[0]),
                                    pred=pred and half_a)
    b = b_smem.index(slot)
    for j in gl.static_range(SPLIT_N):
        tma.async_copy_global_to_shared(w_desc, [w_lo + j * box_step, k0], bar, b.slice(2 * j * HALF, HALF), pred=pred)
        tma.async_copy_global_to_shared(w_desc, [w_hi + j * box_step, k0], bar, b.slice((2 * j + 1) * HALF, HALF),
                                        pred=pred)


@gluon.jit
def _producer(a_desc, a_half_desc, weights, runs, row_ids, ring, tiles, GATED: gl.constexpr, GROUP_M: gl.constexpr,
              NUM_STAGES: gl.constexpr, PERSISTENT: gl.constexpr, SPLIT_N: gl.constexpr):
    """The copy-engine warp of a warp-specialized program: every K step of its tiles, each into a slot the
    consumers have released (``empty``; a fresh barrier reads as released once). It runs ahead across tiles,
    so the next tile's first loads overlap the consumers' last steps and epilogue."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    HALF: gl.constexpr = weights[0].block_type.shape[0]
    num_k = tiles[2]
    empty = ring[3]
    first, last, stride = _tile_range(tiles, PERSISTENT)
    sorted_ids_ptr, num_valid_rows = row_ids
    step = 0
    upcoming = _tile_origin(first, tiles, weights, runs, GATED, GROUP_M, BLOCK_M, HALF, SPLIT_N)
    upcoming_half = _upper_half_pads(sorted_ids_ptr, upcoming[0], num_valid_rows, BLOCK_M)
    for tile in range(first, last, stride):
        row0, n0, expert, w_lo, w_hi = upcoming
        half_a = upcoming_half
        # the next tile's origin is loaded now and used an iteration later: no load latency between two tiles
        upcoming = _tile_origin(tile + stride, tiles, weights, runs, GATED, GROUP_M, BLOCK_M, HALF, SPLIT_N)
        upcoming_half = _upper_half_pads(sorted_ids_ptr, upcoming[0], num_valid_rows, BLOCK_M)
        loads = (a_desc, a_half_desc, weights[0], row0, w_lo, w_hi, half_a, _box_step(GATED, HALF))
        for ki in range(num_k):
            mbarrier.wait(empty.index(step % NUM_STAGES), ((step // NUM_STAGES) & 1) ^ 1)
            _load_step(loads, ring, step, ki, True, NUM_STAGES)
            step += 1


@gluon.jit
def _release(loads, ring, step, ki, num_k, NUM_STAGES: gl.constexpr, WARP_SPECIALIZE: gl.constexpr):
    """The wgmma of K step ``ki`` (the program's ``step``-th) is done: hand its slot to the producer warp, or
    (one role for all warps, one tile a program) load K step ``ki + NUM_STAGES`` into it now."""
    if WARP_SPECIALIZE:
        mbarrier.arrive(ring[3].index(step % NUM_STAGES), count=1)
    else:
        _load_step(loads, ring, step + NUM_STAGES, ki + NUM_STAGES, ki + NUM_STAGES < num_k, NUM_STAGES)


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
def _issue_step(ring, step, ki, registers, scales, NUM_STAGES: gl.constexpr):
    """Wait for K step ``ki``'s tiles (the program's ``step``-th) and issue its wgmma over ``registers``
    (``use_acc=False``: their values are ignored); returns the product in flight and its scales."""
    a_smem, b_smem, ready, empty = ring
    slot = step % NUM_STAGES
    mbarrier.wait(ready.index(slot), (step // NUM_STAGES) & 1)
    product = warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), registers, use_acc=False,
                            is_async=True)
    return product, _step_scales(scales, ki)


@gluon.jit
def _step_group(loads, ring, scales, base, first, num_k, acc, free_a, free_b, COUNT: gl.constexpr,
                NUM_STAGES: gl.constexpr, WARP_SPECIALIZE: gl.constexpr):
    """K steps ``first .. first + COUNT - 1`` of a tile whose first step is the program's ``base``-th, each
    product scaled into ``acc`` while the next one runs.

    Step j's wgmma is issued before step j - 1's is waited for (``warpgroup_mma_wait(1)``), so the warps scale
    one product while the tensor cores compute the next; each waited step's ring slot is released at once. The
    products take turns between two register sets (``free_a``, ``free_b``: their last products already added),
    and the group is unrolled (``COUNT`` is a constexpr) with nothing in flight at its end: a product still in
    flight must never be copied (a loop-carried one would be, at the back edge), or ptxas serializes every
    wgmma of the kernel. Returns the new sum and the two register sets, free again."""
    flight, flight_scales = _issue_step(ring, base + first, first, free_a, scales, NUM_STAGES)
    spare = free_b
    for j in gl.static_range(1, COUNT):
        # a wait with nothing to wait for (one product in flight), to pin the last scaling before this wgmma:
        # LLVM otherwise sinks every scaling of the group past its last wgmma, which keeps all the products alive
        acc = warpgroup_mma_wait(1, deps=(acc,))
        issued, issued_scales = _issue_step(ring, base + first + j, first + j, spare, scales, NUM_STAGES)
        spare = warpgroup_mma_wait(1, deps=(flight,))
        acc = _add_scaled(acc, spare, flight_scales, scales)
        _release(loads, ring, base + first + j - 1, first + j - 1, num_k, NUM_STAGES, WARP_SPECIALIZE)
        flight = issued
        flight_scales = issued_scales
    done = warpgroup_mma_wait(0, deps=(flight,))
    acc = _add_scaled(acc, done, flight_scales, scales)
    _release(loads, ring, base + first + COUNT - 1, first + COUNT - 1, num_k, NUM_STAGES, WARP_SPECIALIZE)
    return acc, done, spare


@gluon.jit
def _k_loop(loads, ring, scales, base, num_k, acc, UNROLL: gl.constexpr, NUM_STAGES: gl.constexpr,
            WARP_SPECIALIZE: gl.constexpr):
    """One tile's K loop into ``acc`` (zeros): groups of ``UNROLL`` steps, then the steps left one by one
    (nothing is in flight across a group's end, see ``_step_group``)."""
    free_a = gl.zeros_like(acc)
    free_b = gl.zeros_like(acc)
    num_groups = num_k // UNROLL
    for group in range(num_groups):
        acc, free_a, free_b = _step_group(loads, ring, scales, base, group * UNROLL, num_k, acc, free_a, free_b,
                                          UNROLL, NUM_STAGES, WARP_SPECIALIZE)
    for ki in range(num_groups * UNROLL, num_k):
        acc, free_a, free_b = _step_group(loads, ring, scales, base, ki, num_k, acc, free_a, free_b, 1, NUM_STAGES,
                                          WARP_SPECIALIZE)
    return acc


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


@gluon.jit
def _row_weights(outputs, row0, acc_layout: gl.constexpr, BLOCK_M: gl.constexpr, WEIGHT_ROWS: gl.constexpr):
    """Each row's top-k weight (in the wgmma layout; ones without ``WEIGHT_ROWS``), loaded before the tile's K
    loop so that no load latency sits between its last wgmma and its epilogue."""
    out_desc, row_weight_ptr, sorted_ids_ptr, num_valid_rows, swiglu_limit = outputs
    if WEIGHT_ROWS:
        weight_rows = gl.load(sorted_ids_ptr + row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout)))
        g = gl.load(row_weight_ptr + weight_rows, mask=weight_rows < num_valid_rows, other=0.0).to(gl.float32)
    else:
        g = gl.full([BLOCK_M], 1.0, gl.float32, layout=gl.SliceLayout(1, acc_layout))
    return g


@gluon.jit
def _column_halves(tile):
    """A ``[rows, 2 * H]`` tile of the wgmma layout as its columns ``0 .. H - 1`` and ``H ..``, each thread keeping
    its own values (no data exchange): w1's gate and up products, or w2's two output boxes."""
    return gl.split(gl.permute(gl.reshape(tile, [tile.shape[0], 2, tile.shape[1] // 2]), [0, 2, 1]))


@gluon.jit
def _gated_pairs(acc, SPLIT_N: gl.constexpr):
    """A two-warpgroup w1 tile (columns: gate, up of warpgroup 0, then gate, up of warpgroup 1, ``HALF`` each) as
    its gate and up values, ``[rows, SPLIT_N, HALF]`` each; the split is along a register dimension of the wgmma
    layout, so each thread keeps its own values."""
    HALF: gl.constexpr = acc.shape[1] // (2 * SPLIT_N)
    return gl.split(gl.permute(gl.reshape(acc, [acc.shape[0], SPLIT_N, 2, HALF]), [0, 1, 3, 2]))


@gluon.jit
def _staged_box(c_smem, box, BOX: gl.constexpr, SPLIT_N: gl.constexpr):
    """The epilogue's ``box``-th staged box of ``BOX`` columns. One warpgroup stages a tile as separate boxes (its
    columns split in registers); two side by side stage it as one ``[rows, width]`` buffer, whose 64-column boxes
    lie one after another in the 128-byte swizzled layout, since the warpgroup's bit of a column cannot be split
    off in registers."""
    if SPLIT_N > 1:
        view = c_smem.slice(box * BOX, BOX, dim=1)
    else:
        view = c_smem.index(box)
    return view


@gluon.jit
def _epilogue(acc, outputs, c_smem, row_weights, row0, n0, GATED: gl.constexpr, ACTIVATION: gl.constexpr,
              HAS_LIMIT: gl.constexpr, WEIGHT_ROWS: gl.constexpr, SPLIT_N: gl.constexpr):
    """One tile's sum out, times each row's top-k weight where asked: w1 writes ``act(gate, up)`` into the sorted
    intermediate, w2 its rows in sorted order too (the top-k sum finds each pair's row by its slot). Everything
    up to the output dtype happens in the wgmma layout; the rounded tile goes to shared memory (``c_smem``, one
    box per 64 columns) and the copy engine stores it while the math warps go on to the next tile. The previous
    tile's store must have read ``c_smem`` first: it has had this tile's whole K loop to do so."""
    out_desc, row_weight_ptr, sorted_ids_ptr, num_valid_rows, swiglu_limit = outputs
    if WEIGHT_ROWS:
        acc = acc * gl.expand_dims(row_weights, 1)
    if GATED and SPLIT_N > 1:
        gate, up = _gated_pairs(acc, SPLIT_N)
        activated = _activate(gate, up, swiglu_limit, ACTIVATION, HAS_LIMIT)
        tile = gl.reshape(activated, [acc.shape[0], acc.shape[1] // 2]).to(out_desc.dtype)
    elif GATED:
        gate, up = _column_halves(acc)
        tile = _activate(gate, up, swiglu_limit, ACTIVATION, HAS_LIMIT).to(out_desc.dtype)
    else:
        tile = acc.to(out_desc.dtype)
    BOX: gl.constexpr = out_desc.block_type.shape[1]
    tma.store_wait(0)
    gl.thread_barrier()  # the last tile's store has read c_smem, and (one role for all warps) every wgmma is done
    if SPLIT_N > 1:
        c_smem.store(tile)
    elif tile.shape[1] == BOX:
        c_smem.index(0).store(tile)
    else:
        lo, hi = _column_halves(tile)
        c_smem.index(0).store(lo)
        c_smem.index(1).store(hi)
    fence_async_shared()
    gl.thread_barrier()
    for box in gl.static_range(tile.shape[1] // BOX):
        tma.async_copy_shared_to_global(out_desc, [row0, n0 + box * BOX], _staged_box(c_smem, box, BOX, SPLIT_N))


@gluon.jit
def _consumer(a_desc, a_half_desc, a_scales, weights, runs, outputs, ring, tiles, GATED: gl.constexpr,
              ACTIVATION: gl.constexpr, HAS_LIMIT: gl.constexpr, WEIGHT_ROWS: gl.constexpr, GROUP_M: gl.constexpr,
              NUM_STAGES: gl.constexpr, UNROLL: gl.constexpr, WARP_SPECIALIZE: gl.constexpr,
              PERSISTENT: gl.constexpr, SPLIT_N: gl.constexpr):
    """The math warps: each of the program's tiles, its K loop then its epilogue. Without a producer warp they
    also issue the loads: the tile's first ``NUM_STAGES`` steps here, each later one as a slot frees."""
    a_scale_ptr, stride_asm, stride_ask = a_scales
    w_desc, w_scale_ptr, block_expert_ptr, N, w_rows_per_expert, stride_wse, stride_wsn, stride_wsk = weights
    out_desc, row_weight_ptr, sorted_ids_ptr, num_valid_rows, swiglu_limit = outputs
    num_k = tiles[2]
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    HALF: gl.constexpr = w_desc.block_type.shape[0]
    WIDTH: gl.constexpr = 2 * HALF * SPLIT_N
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps() // SPLIT_N, SPLIT_N], instr_shape=[16, 2 * HALF, 32]
    )
    # the columns whose weight scale is the "lo" one: w1's gate boxes (every other box), w2's first half
    columns = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, mma_layout))
    if GATED:
        lo_cols = (columns // HALF) % 2 == 0
    else:
        lo_cols = columns < HALF * SPLIT_N
    BOX: gl.constexpr = out_desc.block_type.shape[1]
    OUT_WIDTH: gl.constexpr = WIDTH // 2 if GATED else WIDTH
    if SPLIT_N > 1:
        c_smem = gl.allocate_shared_memory(out_desc.dtype, [BLOCK_M, OUT_WIDTH], out_desc.layout)
    else:
        c_smem = gl.allocate_shared_memory(out_desc.dtype, [OUT_WIDTH // BOX, BLOCK_M, BOX], out_desc.layout)
    # a box past the last scale block (a ragged N) reads the expert's next rows: their columns are masked on
    # store, and their scale index is clamped to a real block
    last_group = (w_rows_per_expert - 1) // 128
    first, last, stride = _tile_range(tiles, PERSISTENT)
    base = 0
    # the next tile's origin is loaded while this one runs: no load latency between two tiles
    upcoming = _tile_origin(first, tiles, weights, runs, GATED, GROUP_M, BLOCK_M, HALF, SPLIT_N)
    for tile in range(first, last, stride):
        row0, n0, expert, w_lo, w_hi = upcoming
        upcoming = _tile_origin(tile + stride, tiles, weights, runs, GATED, GROUP_M, BLOCK_M, HALF, SPLIT_N)
        loads = (a_desc, a_half_desc, w_desc, row0, w_lo, w_hi, False, _box_step(GATED, HALF))
        if not WARP_SPECIALIZE:
            for s in gl.static_range(NUM_STAGES):
                _load_step(loads, ring, base + s, s, s < num_k, NUM_STAGES)
        w_row0 = expert * w_rows_per_expert
        ws_base = w_scale_ptr + expert * stride_wse
        # w2's "hi" columns start half a tile in: with two warpgroups the second one's boxes, else the upper box
        hi_first = w_hi - w_row0 if GATED else w_lo - w_row0 + HALF * SPLIT_N
        a_rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        scales = (
            a_scale_ptr + a_rows.to(gl.int64) * stride_asm,
            ws_base + gl.minimum((w_lo - w_row0) // 128, last_group) * stride_wsn,
            ws_base + gl.minimum(hi_first // 128, last_group) * stride_wsn,
            stride_ask,
            stride_wsk,
            lo_cols,
        )
        row_weights = _row_weights(outputs, row0, mma_layout, BLOCK_M, WEIGHT_ROWS)
        acc = _k_loop(loads, ring, scales, base, num_k, gl.zeros([BLOCK_M, WIDTH], gl.float32, layout=mma_layout),
                      UNROLL, NUM_STAGES, WARP_SPECIALIZE)
        base += num_k
        _epilogue(acc, outputs, c_smem, row_weights, row0, n0, GATED, ACTIVATION, HAS_LIMIT, WEIGHT_ROWS, SPLIT_N)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["num_valid_rows"])
def moe_block_fp8_gemm_kernel(
    a_desc,
    a_half_desc,
    a_scale_ptr,
    w_desc,
    w_scale_ptr,
    out_desc,
    row_weight_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    N,
    K,
    w_rows_per_expert,
    num_valid_rows,
    swiglu_limit,
    run_first_ptr,
    run_count_ptr,
    stride_asm,
    stride_ask,
    stride_wse,
    stride_wsn,
    stride_wsk,
    GATED: gl.constexpr,
    ACTIVATION: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    WEIGHT_ROWS: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    UNROLL: gl.constexpr,
    WARP_SPECIALIZE: gl.constexpr,
    PERSISTENT: gl.constexpr,
    num_warps: gl.constexpr,
):
    """One block-FP8 grouped GEMM over the sorted row blocks in use: w1 (``GATED``) into the sorted intermediate,
    or w2 to each pair's row. One program a tile (programs past ``num_padded``'s tiles exit at once), or with
    ``PERSISTENT`` every ``num_programs``-th tile; with ``WARP_SPECIALIZE`` a producer warp issues the loads
    (``_producer``) while ``num_warps`` math warps run the wgmmas, the scaling and the epilogues."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    HALF: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(BLOCK_K == 128, "one K step is one 128-wide scale group")
    gl.static_assert(128 % HALF == 0, "a weight box must lie in one 128-row scale block")
    gl.static_assert(WARP_SPECIALIZE or not PERSISTENT, "a persistent program needs the producer warp")
    # warpgroups side by side over the tile's columns: one 64-row wgmma per warpgroup, so 64-row blocks in 8 math
    # warps run two weight tiles on one A tile
    SPLIT_N: gl.constexpr = 16 * num_warps // BLOCK_M
    gl.static_assert(SPLIT_N == 1 or SPLIT_N == 2, "block_m = 16 x num_warps, or 8 x num_warps (two warpgroups)")

    num_row_blocks = gl.load(num_padded_ptr) // BLOCK_M
    tiles = (num_row_blocks, gl.cdiv(N, HALF * SPLIT_N if GATED else 2 * HALF * SPLIT_N), gl.cdiv(K, BLOCK_K))
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, 2 * HALF * SPLIT_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    ring = (a_smem, b_smem, ready, empty)
    a_scales = (a_scale_ptr, stride_asm, stride_ask)
    weights = (w_desc, w_scale_ptr, block_expert_ptr, N, w_rows_per_expert, stride_wse, stride_wsn, stride_wsk)
    outputs = (out_desc, row_weight_ptr, sorted_ids_ptr, num_valid_rows, swiglu_limit)
    runs = (run_first_ptr, run_count_ptr)
    if WARP_SPECIALIZE:
        gl.warp_specialize([
            (_consumer, (a_desc, a_half_desc, a_scales, weights, runs, outputs, ring, tiles, GATED, ACTIVATION, HAS_LIMIT,
                         WEIGHT_ROWS, GROUP_M, NUM_STAGES, UNROLL, WARP_SPECIALIZE, PERSISTENT, SPLIT_N)),
            (_producer, (a_desc, a_half_desc, weights, runs, (sorted_ids_ptr, num_valid_rows), ring, tiles, GATED,
                         GROUP_M, NUM_STAGES, PERSISTENT, SPLIT_N)),
        ], [1], [PRODUCER_REGS])
    else:
        _consumer(a_desc, a_half_desc, a_scales, weights, runs, outputs, ring, tiles, GATED, ACTIVATION, HAS_LIMIT, WEIGHT_ROWS,
                  GROUP_M, NUM_STAGES, UNROLL, WARP_SPECIALIZE, PERSISTENT, SPLIT_N)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
