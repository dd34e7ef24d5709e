"""The unscaled (bf16, fp16) grouped GEMM of the fused-MoE experts in Gluon: two math warpgroups take turns on
the tensor cores, each on a tile of its own, so one tile's epilogue runs while the other's K loop does.

Why ping-pong: with one tile per program, the tensor cores idle while the program writes its tile out. On the
Qwen3-30B-A3B w2 GEMM (K = 768, twelve 64-wide K steps a tile) that epilogue is a large share of the tile's time,
and the Triton TMA kernel reaches about 500 TFLOP/s there (``docs/perf/hopper.md``). An unscaled product
accumulates in the tensor core itself (no per-step scaling, unlike ``_gluon_kernels.py``), so one warpgroup's
registers hold a whole ``[BLOCK_M, 2 * HALF]`` fp32 sum (128 x 128: 128 registers a thread), and the
program can afford two of them: CUTLASS's "ping-pong" warp-specialized schedule.

* **Partitions.** A producer warp (``_gluon_kernels.producer``) loads every K step of the program's tiles, in
  tile order, into one ring of ``NUM_STAGES`` slots. Math warpgroup ``c`` takes the program's tiles ``c``,
  ``c + 2``, ...: their K steps are that ring's steps ``i * num_k ..`` for the program's ``i``-th tile.
* **Turns.** Warpgroup ``c`` starts a tile's K loop only once the other has issued its whole previous tile
  (an mbarrier each, ``turns``). That orders the two on the tensor cores, and it keeps each ring slot's ready
  barrier at most one phase ahead of its waiter, which a parity wait needs.
* **Epilogue.** The sum, times the row's top-k weight where asked, is rounded to the output dtype and staged
  in the warpgroup's own shared-memory tile, then written as ``_gluon_kernels.write_halves`` does: w1 (the gate
  and up halves rounded to the output dtype before the activation, as vLLM's separate activation kernel reads
  them) into the sorted intermediate, w2 each row to its (token, slot) pair.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from moe_fsm.kernels.triton_moe._gluon_kernels import (
    PRODUCER_REGS,
    epilogue_layout,
    producer,
    tile_origin,
    tile_range,
    write_halves,
)

# registers a math warpgroup's thread holds: a 128 x 128 fp32 sum is 128 of them
MATH_REGS = gl.constexpr(232)


@gluon.jit
def _k_loop(ring, base, num_k, acc, NUM_STAGES: gl.constexpr):
    """One tile's K loop into ``acc``, its first step the ring's ``base``-th: one wgmma in flight while the next
    is issued; each slot goes back to the producer once the wgmma reading it is done."""
    a_smem, b_smem, ready, empty = ring
    for ki in range(num_k):
        step = base + ki
        slot = step % NUM_STAGES
        mbarrier.wait(ready.index(slot), (step // NUM_STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((step - 1) % NUM_STAGES), count=1, pred=ki > 0)
    return acc


@gluon.jit
def _math_group(a_desc, weights, runs, outputs, ring, turns, stage, tiles, ME: gl.constexpr, GATED: gl.constexpr,
                ACTIVATION: gl.constexpr, HAS_LIMIT: gl.constexpr, WEIGHT_ROWS: gl.constexpr, GROUP_M: gl.constexpr,
                NUM_STAGES: gl.constexpr):
    """Math warpgroup ``ME`` (0 or 1): every other tile of the program, its K loop in turn with the other
    warpgroup, then its epilogue while the other one's K loop runs."""
    w_desc = weights[0]
    N = weights[3]
    num_k = tiles[2]
    empty = ring[3]
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    HALF: gl.constexpr = w_desc.block_type.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, 2 * HALF, 16]
    )
    out_layout: gl.constexpr = epilogue_layout(HALF, gl.num_warps())
    out_ptr, row_weight_ptr, sorted_ids_ptr, num_valid_rows, swiglu_limit, stride_om = outputs
    my_turn = turns.index(ME)
    other_turn = turns.index(1 - ME)
    first, last, stride = tile_range(tiles, True)
    base = ME * num_k
    turn = 0
    for tile in range(first + ME * stride, last, 2 * stride):
        row0, n0, expert, w_lo, w_hi = tile_origin(tile, tiles, weights, runs, GATED, GROUP_M, BLOCK_M, HALF)
        # warpgroup 0's first tile goes at once (a fresh barrier reads as completed for parity 1)
        mbarrier.wait(my_turn, (turn & 1) ^ (1 - ME))
        acc = _k_loop(ring, base, num_k, gl.zeros([BLOCK_M, 2 * HALF], gl.float32, layout=mma_layout), NUM_STAGES)
        mbarrier.arrive(other_turn, count=1)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((base + num_k - 1) % NUM_STAGES), count=1)
        base += 2 * num_k
        turn += 1
        if WEIGHT_ROWS:
            offs_r = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
            rows = gl.load(sorted_ids_ptr + offs_r).to(gl.int64)
            g = gl.load(row_weight_ptr + rows, mask=rows < num_valid_rows, other=0.0).to(gl.float32)
            acc = acc * gl.expand_dims(g, 1)
        gl.thread_barrier()  # this warpgroup's last tile is read out of the staging tile
        stage.store(acc.to(out_ptr.dtype.element_ty))
        gl.thread_barrier()
        lo = stage.slice(0, HALF, 1).load(out_layout)
        hi = stage.slice(HALF, HALF, 1).load(out_layout)
        write_halves(lo, hi, outputs, row0, n0, N, GATED, ACTIVATION, HAS_LIMIT, False)


@gluon.jit
def _math_group_1(a_desc, weights, runs, outputs, ring, turns, stages, tiles, GATED: gl.constexpr,
                  ACTIVATION: gl.constexpr, HAS_LIMIT: gl.constexpr, WEIGHT_ROWS: gl.constexpr,
                  GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The second math warpgroup, a worker partition (a partition's function takes no per-partition constant)."""
    _math_group(a_desc, weights, runs, outputs, ring, turns, stages[1], tiles, 1, GATED, ACTIVATION,
                HAS_LIMIT, WEIGHT_ROWS, GROUP_M, NUM_STAGES)


@gluon.jit
def _math_group_0(a_desc, weights, runs, outputs, ring, turns, stages, tiles, GATED: gl.constexpr,
                  ACTIVATION: gl.constexpr, HAS_LIMIT: gl.constexpr, WEIGHT_ROWS: gl.constexpr,
                  GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The first math warpgroup, the default partition."""
    _math_group(a_desc, weights, runs, outputs, ring, turns, stages[0], tiles, 0, GATED, ACTIVATION,
                HAS_LIMIT, WEIGHT_ROWS, GROUP_M, NUM_STAGES)


@gluon.jit(do_not_specialize=["num_valid_rows"])
def moe_gemm_pingpong_kernel(
    a_desc,
    w_desc,
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
    run_first_ptr,
    run_count_ptr,
    stride_om,
    GATED: gl.constexpr,
    ACTIVATION: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    WEIGHT_ROWS: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """One unscaled grouped GEMM over the sorted row blocks in use, one persistent program per SM: w1
    (``GATED``) into the sorted intermediate, or w2 to each pair's row. ``num_warps`` (4) is one math
    warpgroup; the program runs two of them plus the producer warp."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    HALF: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(num_warps == 4, "one math warpgroup per tile")

    num_row_blocks = gl.load(num_padded_ptr) // BLOCK_M
    tiles = (num_row_blocks, gl.cdiv(N, HALF if GATED else 2 * HALF), gl.cdiv(K, BLOCK_K))
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, 2 * HALF, BLOCK_K], w_desc.layout)
    # swizzled like a wgmma operand: the sum's rows land on distinct banks (a plain row-major tile, its rows
    # 256 bytes apart, puts eight of them on the same banks)
    staging_layout: gl.constexpr = gl.NVMMASharedLayout(128, 16)
    stages = (gl.allocate_shared_memory(out_ptr.dtype.element_ty, [BLOCK_M, 2 * HALF], staging_layout),
              gl.allocate_shared_memory(out_ptr.dtype.element_ty, [BLOCK_M, 2 * HALF], staging_layout))
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for s in gl.static_range(2):
        mbarrier.init(turns.index(s), count=1)
    ring = (a_smem, b_smem, ready, empty)
    # the weight tuple ``tile_origin`` reads (no scales here: their slots hold placeholders)
    weights = (w_desc, out_ptr, block_expert_ptr, N, w_rows_per_expert, 0, 0, 0)
    outputs = (out_ptr, row_weight_ptr, sorted_ids_ptr, num_valid_rows, swiglu_limit, stride_om)
    runs = (run_first_ptr, run_count_ptr)
    # each partition's arguments written out in place: a tuple built beforehand would carry the constexprs as
    # run-time values
    gl.warp_specialize([
        (_math_group_0, (a_desc, weights, runs, outputs, ring, turns, stages, tiles, GATED, ACTIVATION, HAS_LIMIT,
                         WEIGHT_ROWS, GROUP_M, NUM_STAGES)),
        (_math_group_1, (a_desc, weights, runs, outputs, ring, turns, stages, tiles, GATED, ACTIVATION, HAS_LIMIT,
                         WEIGHT_ROWS, GROUP_M, NUM_STAGES)),
        (producer, (a_desc, weights, runs, ring, tiles, GATED, GROUP_M, NUM_STAGES, True)),
    ], [4, 1], [MATH_REGS, PRODUCER_REGS])
    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    for s in gl.static_range(2):
        mbarrier.invalidate(turns.index(s))
