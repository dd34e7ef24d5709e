"""FP8 (e4m3fn) activation quantization on the GPU, in the layouts the GEMMs read.

``group``: dynamic, one scale per token per 128 columns ([.., ceil(K/128)]), the
DeepSeek-V3 layout that pairs with 128x128 weight blocks. ``token``: one scale
per row ([.., 1], so row-wise scales travel with their rows as in
``moe_fsm.kernels.fp8``). ``tensor``: one scale ([1]), given (static) or taken from the
tensor's absolute maximum (dynamic, on the device: no host read, so it can be captured in a CUDA graph).
Scales are ``max(amax, 1e-10) / 448`` and
values are clamped to +-448 before the cast, as vLLM's quantizers do; both divisions are
correctly rounded, so the result equals ``moe_fsm.kernels.fp8``'s bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.kernels.triton_moe._runtime import kernels, launch, require_device

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
GRANULARITIES = ("tensor", "token", "group")
# Dynamic per-tensor sizes, in elements with rows and columns each rounded up to a power of two: up to
# FUSED_TENSOR one program finds the maximum and quantizes (a decode call's input, 1-2 tokens of 4096); up to
# SMALL_TENSOR one program finds the maximum from registers (up to 8 tokens of 4096, or one token's Mixtral-8x7B
# intermediate, 2 x 14336) and the quantization's divisions spread over many.
FUSED_TENSOR = 8192
SMALL_TENSOR = 32768
QUANT_COLUMNS = 1024


def quantize_activation(
    x: torch.Tensor, granularity: str, static_scale: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., K] to FP8; returns (values like x, fp32 scales in the granularity's layout)."""
    require_device(x, static_scale)
    if granularity not in GRANULARITIES:
        raise KernelInputError(f"FP8 activation granularity {granularity!r} is not one of {list(GRANULARITIES)}")
    if not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise KernelInputError(f"quantize_activation takes a float tensor to quantize, got {x.dtype}")
    lead, k_dim = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k_dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    q = torch.empty(rows.shape, dtype=FP8_DTYPE, device=x.device)
    k = kernels()
    if granularity == "group":
        if static_scale is not None:
            raise KernelInputError("1x128 group activation scales are dynamic only; pass static_scale=None")
        num_groups = -(-k_dim // GROUP)
        scale = torch.empty(num_rows, num_groups, dtype=torch.float32, device=x.device)
        groups_per_program = 8
        if num_rows:
            launch(
                k.group_quant_kernel, (num_rows, -(-num_groups // groups_per_program)),
                (rows, q, scale, k_dim, num_groups, rows.stride(0), q.stride(0), scale.stride(0)),
                dict(GROUPS=groups_per_program, GROUP=GROUP),
            )
        return q.reshape(x.shape), scale.reshape(*lead, num_groups)

    block = max(16, 1 << (k_dim - 1).bit_length())
    warps = 4 if block <= 4096 else (8 if block <= 8192 else 16)
    if granularity == "token":
        if static_scale is not None:
            if static_scale.numel() not in (1, num_rows):
                raise KernelInputError(
                    f"a static per-token scale has one value or one per row ({num_rows}); got shape {tuple(static_scale.shape)}"
                )
            scale = static_scale.to(torch.float32).reshape(-1, 1).expand(num_rows, 1).contiguous()
            q = (rows.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            return q.reshape(x.shape), scale.reshape(*lead, 1)
        scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
        if num_rows:
            launch(
                k.row_quant_kernel, (num_rows,), (rows, q, scale, scale, k_dim, rows.stride(0), q.stride(0)),
                dict(SCALE_FROM=0, BLOCK=block), warps,
            )
        return q.reshape(x.shape), scale.reshape(*lead, 1)

    if static_scale is not None:
        if static_scale.numel() != 1:
            raise KernelInputError(f"a per-tensor activation scale has one element, got shape {tuple(static_scale.shape)}")
        scale = static_scale.to(torch.float32).reshape(1)
        if num_rows:
            piece = min(block, QUANT_COLUMNS)
            launch(
                k.row_quant_kernel, (num_rows, -(-k_dim // piece)),
                (rows, q, scale, scale, k_dim, rows.stride(0), q.stride(0)), dict(SCALE_FROM=1, BLOCK=piece), 4,
            )
        return q.reshape(x.shape), scale
    return q.reshape(x.shape), _dynamic_tensor_quant(rows, q, block, warps)


def _dynamic_tensor_quant(rows: torch.Tensor, q: torch.Tensor, block: int, warps: int) -> torch.Tensor:
    """Quantize ``rows`` into ``q`` with the scale of their absolute maximum; returns the scale ([1]).

    On the device either way, in as few launches as the size allows: the maximum (one program from registers
    for a small tensor, else an atomic max over rows into a zeroed slot), then the quantization over
    (row, ``QUANT_COLUMNS``-piece) programs; a tiny tensor does both in one program.
    """
    num_rows, k_dim = rows.shape
    scale = torch.empty(1, dtype=torch.float32, device=rows.device)
    k = kernels()
    rows_pow2 = 1 << max(num_rows - 1, 0).bit_length()
    if num_rows == 0:  # nothing to read: the fused program stores the scale of a zero maximum
        block = 16
    padded = rows_pow2 * block
    if padded <= SMALL_TENSOR:
        amax = torch.empty(1, dtype=torch.float32, device=rows.device)
        launch(
            k.small_tensor_quant_kernel, (1,),
            (rows, q, scale, amax, num_rows, k_dim, rows.stride(0), q.stride(0)),
            dict(QUANTIZE=padded <= FUSED_TENSOR, ROWS=rows_pow2, BLOCK=block), 16 if padded > 8192 else 8,
        )
        if padded <= FUSED_TENSOR:
            return scale
    else:
        amax = torch.zeros(1, dtype=torch.float32, device=rows.device)
        launch(k.tensor_amax_kernel, (num_rows,), (rows, amax, k_dim, rows.stride(0)), dict(BLOCK=min(block, 4096)), warps)
    piece = min(block, QUANT_COLUMNS)
    launch(
        k.row_quant_kernel, (num_rows, -(-k_dim // piece)), (rows, q, scale, amax, k_dim, rows.stride(0), q.stride(0)),
        dict(SCALE_FROM=2, BLOCK=piece), 4,
    )
    return scale
