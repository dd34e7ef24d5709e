"""The Gluon block-FP8 kernel's epilogue staging, checked by Gluon's own bank-conflict model (no GPU needed).

The epilogue stores each rounded tile from the wgmma accumulator layout into shared memory, one box of 64
columns at a time in the copy engine's swizzled layout, for the copy engine to store. A layout that puts
several rows of one access on the same banks multiplies the shared-memory time of every tile (a row-major fp32
tile took 4 wavefronts per store where 1 does), so each tile shape the kernel takes is compiled here for sm_90
and must model zero excess wavefronts.
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
def _staging_conflicts(BLOCK_M: gl.constexpr, HALF: gl.constexpr, GATED: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Build the epilogue's staged boxes as ``_epilogue`` does and assert Gluon's conflict count at compile time."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 2 * HALF, 32]
    )
    acc = gl.zeros([BLOCK_M, 2 * HALF], gl.float32, layout=mma_layout)
    if GATED:
        gate, up = _gluon_kernels._column_halves(acc)
        tile = (gate * up).to(gl.bfloat16)
    else:
        tile = acc.to(gl.bfloat16)
    BOX: gl.constexpr = min(tile.shape[1], 64)
    box_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BOX], gl.bfloat16)
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [tile.shape[1] // BOX, BLOCK_M, BOX], box_layout)
    if tile.shape[1] == BOX:
        gl.static_assert(gl.bank_conflicts(tile.type, c_smem.index(0).type) == 0, "conflicting stores")
        c_smem.index(0).store(tile)
    else:
        lo, hi = _gluon_kernels._column_halves(tile)
        gl.static_assert(gl.bank_conflicts(lo.type, c_smem.index(0).type) == 0, "conflicting stores")
        c_smem.index(0).store(lo)
        c_smem.index(1).store(hi)


@gluon.jit
def _paired_staging_conflicts(HALF: gl.constexpr, GATED: gl.constexpr):
    """The same for 64-row blocks in two warpgroups side by side (``SPLIT_N = 2``): the tile staged whole into one
    ``[rows, width]`` buffer, each 64-column box of which the copy engine stores as a column slice."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 2 * HALF, 32]
    )
    acc = gl.zeros([64, 4 * HALF], gl.float32, layout=mma_layout)
    if GATED:
        gate, up = _gluon_kernels._gated_pairs(acc, 2)
        tile = gl.reshape(gate * up, [64, 2 * HALF]).to(gl.bfloat16)
    else:
        tile = acc.to(gl.bfloat16)
    box_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [64, tile.shape[1]], box_layout)
    gl.static_assert(gl.bank_conflicts(tile.type, c_smem.type) == 0, "conflicting stores")
    c_smem.store(tile)


@pytest.mark.parametrize("half,gated", [(64, True), (64, False), (32, True), (32, False)])
def test_two_warpgroup_epilogue_staging_has_no_bank_conflicts(half, gated):
    constants = {"HALF": half, "GATED": gated}
    source = GluonASTSource(_paired_staging_conflicts, {name: "constexpr" for name in constants}, constants)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})


@pytest.mark.parametrize(
    "block_m,half,gated,num_warps",
    [(128, 64, True, 8), (128, 64, False, 8), (128, 32, True, 8), (128, 32, False, 8), (64, 64, True, 4),
     (64, 64, False, 4)],
)
def test_epilogue_staging_has_no_bank_conflicts(block_m, half, gated, num_warps):
    constants = {"BLOCK_M": block_m, "HALF": half, "GATED": gated, "NUM_WARPS": num_warps}
    signature = {name: "constexpr" for name in constants}
    source = GluonASTSource(_staging_conflicts, signature, constants)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
