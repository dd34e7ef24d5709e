"""Host side of the Hopper grouped GEMMs (``_hopper_kernels.py``): where they apply, their descriptors, launches.

A config asks for them with ``MoEConfig.hopper``; ``hopper_usable`` then checks what the kernels need of
the call (a Hopper-or-later GPU, Triton's host tensor descriptors, sorted row blocks, 16-byte aligned rows
for the copy engine) and the layer falls back to the pointer-load kernel where any is missing, so a
tuned table written on an H100 still runs anywhere.

Descriptors are built on the host per call: a few Python objects, which Triton packs into the launch
(``CUtensorMap`` by value), so a CUDA graph captures them like any other argument.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.kernels.activations import TRITON_ACTIVATION_CODES as ACTIVATIONS
from moe_fsm.kernels.triton_moe.align import AlignedRouting
from moe_fsm.kernels.triton_moe.config import FP8_GROUP, GemmConfig, MoEConfig, weight_scale_span
from moe_fsm.kernels.triton_moe.quant import FP8_DTYPE



@functools.lru_cache(maxsize=None)
def _importable(module: str, name: str) -> bool:
    """Whether this Triton has ``module.name`` (host tensor descriptors, Gluon's Hopper ops: both are recent)."""
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def _has_tensor_descriptors() -> bool:
    return _importable("triton.tools.tensor_descriptor", "TensorDescriptor")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _is_hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _has_gluon() -> bool:
    return _importable("triton.experimental.gluon.language.nvidia.hopper", "warpgroup_mma_wait") and _importable(
        "triton.experimental.gluon.nvidia.hopper", "TensorDescriptor"
    )


def gluon_kernels_available(device_index: int) -> bool:
    """Whether this device and Triton can run the Gluon block-FP8 kernel (``MoEConfig.gluon``)."""
    return _has_gluon() and tma_kernels_available(device_index)


def tma_kernels_available(device_index: int) -> bool:
    """Whether this device and Triton can run the TMA kernels at all (what a tuner asks before offering them)."""
    return _has_tensor_descriptors() and _is_hopper_or_later(device_index)


def hopper_usable(config: MoEConfig, routing: object, a: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether this call can take the TMA kernels: else the pointer-load kernel runs the same config's tiles."""
    if not config.hopper or not isinstance(routing, AlignedRouting) or a.device.type != "cuda":
        return False
    if not tma_kernels_available(a.device.index or 0):
        return False
    n, k_dim = w2.shape[2], w1.shape[2]
    # the copy engine needs 16-byte aligned bases and row strides: the weights' (a slice of a larger tensor may
    # start anywhere), their K and N, and the intermediate's N (bf16 or fp8); the intermediate and the gathered
    # input are fresh allocations. The input's K is read with unit stride (the w1 GEMM's loads, the gather).
    return (
        a.stride(-1) == 1
        and w1.is_contiguous() and w2.is_contiguous() and w1.data_ptr() % 16 == 0 and w2.data_ptr() % 16 == 0
        and (k_dim * w1.element_size()) % 16 == 0 and (n * w2.element_size()) % 16 == 0 and n % 8 == 0
    )


# output dtypes the Gluon kernel's epilogue stores: 16-bit, so that a 64-column TMA box is the 128 bytes its
# swizzle spans (``_gluon_descriptor``); an FP8 layer asked for another output runs the Triton TMA kernel
GLUON_OUT_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def gluon_usable(
    config: MoEConfig, routing: object, a: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *, block_fp8: bool,
    out_dtype: torch.dtype,
) -> bool:
    """Whether this call takes the Gluon block-FP8 kernel (``MoEConfig.gluon``): else the Triton TMA kernel runs
    the same config's tiles. Beyond the TMA kernels' needs, the intermediate width must be a multiple of the w1
    tile, so that each up box starts on the tile grid and lies in one weight-scale block, and the output must be
    16-bit (``GLUON_OUT_DTYPES``)."""
    return (
        config.gluon and block_fp8 and out_dtype in GLUON_OUT_DTYPES and gluon_kernels_available(a.device.index or 0)
        and hopper_usable(config, routing, a, w1, w2) and w2.shape[2] % config.w1.block_n == 0
    )


def _row_and_shape_args(
    routing: AlignedRouting, n_out: int, k_in: int, w_rows: int, swiglu_limit: Optional[float]
) -> tuple:
    """The launch arguments both grouped-GEMM kernels take in this order: the sorted rows, their experts and the
    count in use, the GEMM widths, the weight rows per expert, the pair count and the swiglu clamp."""
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    return (routing.sorted_ids, routing.block_expert, routing.num_padded, n_out, k_in, w_rows, routing.num_pairs, limit)


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def _launch(
    a: torch.Tensor,
    a_desc,
    a_scale: Optional[torch.Tensor],
    a_mode: int,
    w: torch.Tensor,
    w_scale_info: tuple[int, Optional[torch.Tensor], tuple[int, int, int]],
    out: torch.Tensor,
    out_desc,
    out_scale: Optional[torch.Tensor],
    out_static_scale: Optional[torch.Tensor],
    out_mode: int,
    routing: AlignedRouting,
    row_weights: Optional[torch.Tensor],
    *,
    n_out: int,
    k_in: int,
    gated: bool,
    activation: str,
    swiglu_limit: Optional[float],
    a_row_div: int,
    out_row_div: int,
    config: GemmConfig,
) -> None:
    from moe_fsm.kernels.triton_moe._hopper_kernels import moe_gemm_tma_kernel

    num_experts, w_rows, w_cols = w.shape
    paired = gated and config.paired
    if paired:
        w_desc = _descriptor(w.view(num_experts * 2, w_rows // 2, w_cols), [2, config.block_n, config.block_k])
    else:
        w_desc = _descriptor(w.view(num_experts * w_rows, w_cols), [config.block_n, config.block_k])
    w_mode, w_scale, (sws_e, sws_n, sws_k) = w_scale_info
    dummy = out
    max_tiles = routing.num_row_blocks * -(-n_out // config.block_n)
    # persistent: one program per SM whatever the shape (programs past the tile count exit at once), so
    # NUM_PROGRAMS, a constexpr, is one value per device and not one compile per token count
    num_programs = _sm_count(a.device.index or 0) if config.persistent else 1
    grid = num_programs if config.persistent else max(max_tiles, 1)
    if a_mode == 3:
        as_m, as_k = a_scale.stride(0), a_scale.stride(1)
    elif a_mode == 2:
        as_m, as_k = a_scale.stride(0), 0
    else:
        as_m = as_k = 0
    os_m, os_n = (out_scale.stride(0), out_scale.stride(1)) if out_mode == 2 else (0, 0)
    moe_gemm_tma_kernel[(grid,)](
        a,
        a_desc if a_desc is not None else w_desc,
        dummy if a_scale is None else a_scale,
        w_desc,
        dummy if w_scale is None else w_scale,
        out,
        out_desc if out_desc is not None else w_desc,
        dummy if out_scale is None else out_scale,
        dummy if out_static_scale is None else out_static_scale,
        dummy if row_weights is None else row_weights,
        *_row_and_shape_args(routing, n_out, k_in, w_rows, swiglu_limit),
        a.stride(0),
        out.stride(0),
        as_m,
        as_k,
        sws_e,
        sws_n,
        sws_k,
        os_m,
        os_n,
        A_ROW_DIV=a_row_div,
        A_SORTED=a_desc is not None,
        OUT_ROW_DIV=out_row_div,
        GATED=gated,
        PAIRED=paired,
        ACTIVATION=ACTIVATIONS[activation],
        HAS_LIMIT=swiglu_limit is not None,
        WEIGHT_ROWS=row_weights is not None,
        A_SCALE=a_mode,
        W_SCALE=w_mode,
        W_SCALE_SPAN=weight_scale_span(config.block_n, n_out, gated),
        OUT_MODE=out_mode,
        BLOCK_M=routing.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        PERSISTENT=config.persistent,
        FLATTEN=config.flatten,
        NUM_PROGRAMS=num_programs,
        WARP_SPECIALIZE=config.warp_specialize,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def hopper_w1(
    a: torch.Tensor,
    a_scale: Optional[torch.Tensor],
    a_mode: int,
    w1: torch.Tensor,
    w_scale_info: tuple,
    routing: AlignedRouting,
    *,
    out_mode: int,
    inter_dtype: torch.dtype,
    out_static_scale: Optional[torch.Tensor],
    zero_fill: bool,
    activation: str,
    swiglu_limit: Optional[float],
    row_weights: Optional[torch.Tensor],
    config: GemmConfig,
    gather_input: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """act(a @ w1[e]^T) into the sorted-order intermediate [padded rows, N] (and its 1x128 group scales)."""
    num_experts, two_n, k_dim = w1.shape
    n = two_n // 2
    rows = routing.sorted_ids.numel()
    alloc = torch.zeros if zero_fill else torch.empty
    inter = alloc(rows, n, dtype=inter_dtype, device=a.device)
    out_scale = torch.empty(rows, -(-n // FP8_GROUP), dtype=torch.float32, device=a.device) if out_mode == 2 else None
    a_desc = None
    if gather_input:
        a, a_scale = gather_sorted(a, a_scale, a_mode, routing)
        a_desc = _descriptor(a, [routing.block_m, config.block_k])
    _launch(
        a, a_desc, a_scale, a_mode, w1, w_scale_info, inter, _descriptor(inter, [routing.block_m, config.block_n]),
        out_scale, out_static_scale, out_mode, routing, row_weights, n_out=n, k_in=k_dim, gated=True,
        activation=activation, swiglu_limit=swiglu_limit, a_row_div=routing.top_k, out_row_div=1, config=config,
    )
    return inter, out_scale


def gather_sorted(
    a: torch.Tensor, a_scale: Optional[torch.Tensor], a_mode: int, routing: AlignedRouting
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The w1 GEMM's A rows (and per-row or per-group scales) copied into sorted-slot order, pads zeroed."""
    from moe_fsm.kernels.triton_moe._hopper_kernels import gather_rows_kernel

    rows, k_dim = routing.sorted_ids.numel(), a.shape[1]
    sorted_a = torch.empty(rows, k_dim, dtype=a.dtype, device=a.device)
    has_scale = a_mode in (2, 3)
    if has_scale:
        # per-token scales may come as [M] as well as [M, 1], group scales column-major (as DeepGEMM takes
        # them): the gather reads [M, groups] rows with unit stride
        a_scale = a_scale.reshape(a.shape[0], -1)
        if a_scale.stride(-1) != 1:
            a_scale = a_scale.contiguous()
    sorted_scale = (
        torch.empty(rows, a_scale.shape[1], dtype=a_scale.dtype, device=a.device) if has_scale else a_scale
    )
    groups = a_scale.shape[1] if has_scale else 1
    gather_rows_kernel[(rows,)](
        a, a_scale if has_scale else a, sorted_a, sorted_scale if has_scale else sorted_a, routing.sorted_ids,
        routing.num_padded, routing.num_pairs, k_dim, groups, a.stride(0), sorted_a.stride(0),
        a_scale.stride(0) if has_scale else 0, sorted_scale.stride(0) if has_scale else 0,
        ROW_DIV=routing.top_k, HAS_SCALE=has_scale, BLOCK=min(2048, triton_next_pow2(k_dim)),
        GROUPS_POW2=triton_next_pow2(groups), num_warps=4,
    )
    return sorted_a, sorted_scale


def _require_float_rows(x: torch.Tensor, name: str) -> None:
    """The quantizers below read float [M, K] rows with unit stride along K: refuse anything else by name."""
    if x.dim() != 2 or x.stride(-1) != 1 or not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise KernelInputError(f"{name} takes float [M, K] rows contiguous along K; got {x.dtype} "
                               f"{tuple(x.shape)} with strides {x.stride()}")


def pair_slots(routing: AlignedRouting) -> torch.Tensor:
    """Each (token, slot) pair's row in sorted order (``[num_pairs]`` int32; -1 for a pair no local expert
    takes): the inverse of ``routing.sorted_ids``."""
    from moe_fsm.kernels.triton_moe._hopper_kernels import pair_slots_kernel

    rows = routing.sorted_ids.numel()
    slot_of_pair = torch.full((routing.num_pairs,), -1, dtype=torch.int32, device=routing.sorted_ids.device)
    block = 1024
    pair_slots_kernel[(-(-rows // block),)](routing.sorted_ids, routing.num_padded, routing.num_pairs, slot_of_pair,
                                           BLOCK=block)
    return slot_of_pair


def quantize_sorted(
    x: torch.Tensor, routing: AlignedRouting, slot_of_pair: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-FP8 layer's float w1 input quantized in 1x128 groups straight into sorted-slot order (each pair's
    slot from ``pair_slots``): what ``gather_sorted`` makes of the quantized input, bit for bit, in one pass that
    reads each token once.

    Pad slots are left as the allocator gives them: every GEMM row depends on its own input row alone, and
    nothing reads a pad row's result into a real row's."""
    _require_float_rows(x, "quantize_sorted")  # before the kernel module's import: it needs Triton
    from moe_fsm.kernels.triton_moe._hopper_kernels import quantize_into_slots_kernel

    rows, (num_tokens, k_dim) = routing.sorted_ids.numel(), x.shape
    groups = -(-k_dim // FP8_GROUP)
    q = torch.empty(rows, k_dim, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    groups_per_program = 8
    quantize_into_slots_kernel[(num_tokens, -(-groups // groups_per_program))](
        x, q, scale, slot_of_pair, k_dim, groups, x.stride(0), q.stride(0), scale.stride(0), TOP_K=routing.top_k,
        GROUPS=groups_per_program, GROUP=FP8_GROUP,
    )
    return q, scale


def quantize_real_rows(x: torch.Tensor, routing: AlignedRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted intermediate ``x`` quantized in 1x128 groups, as ``quantize_activation(x, "group")`` does, in the
    rows that hold a pair only: the others (pads, rows past the ones in use) are left as the allocator gives
    them, and the w2 GEMM's results for them are never read."""
    _require_float_rows(x, "quantize_real_rows")  # before the kernel module's import: it needs Triton
    from moe_fsm.kernels.triton_moe._hopper_kernels import quantize_real_rows_kernel

    rows, k_dim = x.shape
    groups = -(-k_dim // FP8_GROUP)
    q = torch.empty(rows, k_dim, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    # a 2048-wide row a program: 157 µs against 186 at half a row (DeepSeek-V3's intermediate, 8192 tokens, H100)
    groups_per_program = 16
    quantize_real_rows_kernel[(rows, -(-groups // groups_per_program))](
        x, q, scale, routing.sorted_ids, routing.num_padded, routing.num_pairs, k_dim, groups, x.stride(0),
        q.stride(0), scale.stride(0), GROUPS=groups_per_program, GROUP=FP8_GROUP,
    )
    return q, scale


def triton_next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def hopper_w2(
    inter: torch.Tensor,
    inter_scale: Optional[torch.Tensor],
    a_mode: int,
    w2: torch.Tensor,
    w_scale_info: tuple,
    routing: AlignedRouting,
    out: torch.Tensor,
    out_mode: int,
    *,
    row_weights: Optional[torch.Tensor],
    config: GemmConfig,
) -> torch.Tensor:
    """inter[slot] @ w2[e]^T (times the top-k weight) to each pair's row of ``out``, or summed per token (mode 3)."""
    num_experts, k_out, n = w2.shape
    _launch(
        inter, _descriptor(inter, [routing.block_m, config.block_k]), inter_scale, a_mode, w2, w_scale_info, out,
        None, None, None, out_mode, routing, row_weights, n_out=k_out, k_in=n, gated=False, activation="silu",
        swiglu_limit=None, a_row_div=1, out_row_div=routing.top_k if out_mode == 3 else 1, config=config,
    )
    return out


def _gluon_descriptor(t: torch.Tensor, block: list[int]):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dtype = gl.float8e4nv if t.dtype == FP8_DTYPE else getattr(gl, GLUON_OUT_DTYPES[t.dtype])
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


def _unroll(num_k_steps: int, config: GemmConfig) -> int:
    """K steps per unrolled group of the Gluon kernel: the largest divisor of the step count up to 8 for 8
    warp-specialized math warps, else 4 (the product of a group's last step is scaled with the tensor cores
    idle; longer groups spill at 64 x 128 tiles past the 232-240 registers the math warps get)."""
    most = 8 if config.warp_specialize and config.num_warps == 8 else 4
    return max(u for u in range(1, most + 1) if num_k_steps % u == 0)


# registers a thread of a warp-specialized Gluon program may hold at launch (its 4 producer-warpgroup warps
# included; the consumers then take the producer's share, setmaxnreg): two programs an SM at 4 consumer
# warps, one at 8
_WS_MAX_REGISTERS = {4: 128, 8: 168}


def gluon_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale_info: tuple,
    out: torch.Tensor,
    routing: AlignedRouting,
    runs: tuple[torch.Tensor, torch.Tensor],
    row_weights: Optional[torch.Tensor],
    *,
    gated: bool,
    n_out: int,
    activation: str,
    swiglu_limit: Optional[float],
    config: GemmConfig,
) -> None:
    """One block-FP8 GEMM through the Gluon kernel over sorted-order input rows ``a`` (the input in sorted order,
    ``quantize_sorted`` or ``gather_sorted``, or the intermediate) and their 1x128 group scales, into ``out`` in
    the same sorted order (the copy engine stores each tile's rows as a block): w1 (``gated``) the intermediate,
    w2 each pair's product (``pair_slots`` finds a pair's row); ``runs`` (``align.expert_runs``) orders the tiles
    expert by expert."""
    from moe_fsm.kernels.triton_moe._gluon_kernels import moe_block_fp8_gemm_kernel

    num_experts, w_rows, k_in = w.shape
    # warpgroups side by side over the tile's columns (the kernel's SPLIT_N): 8 warps on 64-row blocks make two
    split_n = 16 * config.num_warps // routing.block_m
    half = config.block_n // split_n if gated else config.block_n // (2 * split_n)
    _, w_scale, (sws_e, sws_n, sws_k) = w_scale_info
    max_tiles = routing.num_row_blocks * -(-n_out // config.block_n)
    grid = max(min(max_tiles, _sm_count(a.device.index or 0)) if config.persistent else max_tiles, 1)
    moe_block_fp8_gemm_kernel[(grid,)](
        _gluon_descriptor(a, [routing.block_m, FP8_GROUP]),
        _gluon_descriptor(a, [routing.block_m // 2, FP8_GROUP]),
        a_scale,
        _gluon_descriptor(w.view(num_experts * w_rows, k_in), [half, FP8_GROUP]),
        w_scale,
        _gluon_descriptor(out, [routing.block_m, min(config.block_n, 64)]),
        w_scale if row_weights is None else row_weights,
        *_row_and_shape_args(routing, n_out, k_in, w_rows, swiglu_limit),
        *runs,
        a_scale.stride(0),
        a_scale.stride(1),
        sws_e,
        sws_n,
        sws_k,
        GATED=gated,
        ACTIVATION=ACTIVATIONS[activation],
        HAS_LIMIT=swiglu_limit is not None,
        WEIGHT_ROWS=row_weights is not None,
        GROUP_M=config.group_m,
        NUM_STAGES=config.num_stages,
        UNROLL=_unroll(-(-k_in // FP8_GROUP), config),
        WARP_SPECIALIZE=config.warp_specialize,
        PERSISTENT=config.persistent,
        num_warps=config.num_warps,
        **({"maxnreg": _WS_MAX_REGISTERS[config.num_warps]} if config.warp_specialize else {}),
    )
