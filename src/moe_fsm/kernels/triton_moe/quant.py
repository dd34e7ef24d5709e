"""FP8 (e4m3fn) activation quantization on the GPU, in the layouts the GEMMs read.

``group``: dynamic, one scale per token per 128 columns ([.., ceil(K/128)]), the
DeepSeek-V3 layout that pairs with 128x128 weight blocks. ``token``: one scale
per row ([.., 1], so row-wise scales travel with their rows as in
``moe_fsm.kernels.fp8``). ``tensor``: one scale ([1]), given (static) or taken from the
tensor's absolute maximum (dynamic). Scales are ``max(amax, 1e-10) / 448`` and
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
                dict(PER_ROW=True, BLOCK=block), warps,
            )
        return q.reshape(x.shape), scale.reshape(*lead, 1)

    if static_scale is not None:
        if static_scale.numel() != 1:
            raise KernelInputError(f"a per-tensor activation scale has one element, got shape {tuple(static_scale.shape)}")
        scale = static_scale.to(torch.float32).reshape(1)
    else:
        amax = rows.abs().amax() if rows.numel() else torch.zeros((), device=x.device)
        amax = amax.to(torch.float32)  # divided by a 0-d tensor: `/ 448.0` would multiply by fl32(1/448) on CUDA
        scale = (amax / amax.new_full((), FP8_MAX)).clamp(min=1e-10).reshape(1)
    if num_rows:
        launch(
            k.row_quant_kernel, (num_rows,), (rows, q, scale, scale, k_dim, rows.stride(0), q.stride(0)),
            dict(PER_ROW=False, BLOCK=block), warps,
        )
    return q.reshape(x.shape), scale
