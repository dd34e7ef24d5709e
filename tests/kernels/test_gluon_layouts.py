"""The Gluon block-FP8 kernel's epilogue layouts, checked by Gluon's own bank-conflict model (no GPU needed).

The epilogue stages each tile in shared memory twice over: stored from the wgmma accumulator layout, loaded
back in ``_store_layout``. A layout that puts several rows of one access on the same banks multiplies the
shared-memory time of every tile (the row-major fp32 tile took 4 wavefronts per store where 1 does), so each
tile shape the kernel takes is compiled here for sm_90 and must model zero excess wavefronts both ways.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from moe_fsm.kernels.triton_moe import _gluon_kernels  # noqa: E402


@gluon.jit
def _staging_conflicts(out, BLOCK_M: gl.constexpr, HALF: gl.constexpr, GATED: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Build the epilogue's staged tile as ``_epilogue`` does and assert Gluon's conflict count at compile time."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 2 * HALF, 32]
    )
    acc = gl.zeros([BLOCK_M, 2 * HALF], gl.float32, layout=mma_layout)
    if GATED:
        gate, up = gl.split(gl.permute(gl.reshape(acc, [BLOCK_M, 2, HALF]), [0, 2, 1]))
        tile = (gate * up).to(gl.bfloat16)
    else:
        tile = acc.to(gl.bfloat16)
    WIDTH: gl.constexpr = tile.shape[1]
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, WIDTH], _gluon_kernels._staging_layout(WIDTH, 16))
    store_layout: gl.constexpr = _gluon_kernels._store_layout(WIDTH, 16, NUM_WARPS)
    loaded = gl.zeros([BLOCK_M, WIDTH], gl.bfloat16, layout=store_layout)
    gl.static_assert(gl.bank_conflicts(tile.type, c_smem.type) == 0, "conflicting stores")
    gl.static_assert(gl.bank_conflicts(loaded.type, c_smem.type) == 0, "conflicting loads")
    c_smem.store(tile)
    values = c_smem.load(store_layout)
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
    cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, store_layout))
    gl.store(out + gl.expand_dims(rows, 1) * WIDTH + gl.expand_dims(cols, 0), values)


@pytest.mark.parametrize(
    "block_m,half,gated,num_warps",
    [(128, 64, True, 8), (128, 64, False, 8), (128, 32, True, 8), (128, 32, False, 8), (64, 64, True, 4),
     (64, 64, False, 4)],
)
def test_epilogue_staging_has_no_bank_conflicts(block_m, half, gated, num_warps):
    constants = {"BLOCK_M": block_m, "HALF": half, "GATED": gated, "NUM_WARPS": num_warps}
    signature = {"out": "*bf16", **{name: "constexpr" for name in constants}}
    source = GluonASTSource(_staging_conflicts, signature, constants)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
