"""FP8 e4m3fn quantization as vLLM's kernels do it, for weights and activations.

Every quantizer divides by its scale, saturates to +-448 and casts with
round-to-nearest-even (what ``scaled_fp8_quant`` and ``per_token_group_quant_fp8``
do); a dynamic scale is ``max(amax, 1e-10) / 448``. Dequantizing multiplies back.

Shapes. Activations are ``[..., K]``: per-tensor scales are ``[1]``, per-token
scales ``[..., 1]`` and per-1x128-group scales ``[..., ceil(K/128)]``, so the
row-wise ones are 2-D for ``[M, K]`` and travel with their rows. Weights are
``[..., R, C]`` (``[E, R, C]`` for a stack of experts): per-tensor scales are
``[...]``, per-channel ``[..., R]`` and 128x128 blocks ``[..., ceil(R/128),
ceil(C/128)]``; R and C need not be multiples of 128 (the last block is partial).

Arithmetic runs in float32, or float64 for float64 inputs so that tests can
emulate the same steps at higher precision.
"""

from __future__ import annotations

from typing import Optional

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
DYNAMIC_SCALE_EPS = 1e-10
GROUP_SIZE = 128
BLOCK_SIZE = 128


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def dynamic_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale that maps ``amax`` onto the fp8 maximum, floored so zero rows stay finite.

    A true division on every device. ``tensor / 448.0`` on CUDA multiplies by the float32 reciprocal of the
    Python number (PyTorch's CPU-scalar shortcut, "may lose one bit of precision"), and 1/448 is inexact: the
    scale then differs from the CPU's by an ulp, which moves 16-bit inputs that sit exactly on an e4m3
    midpoint (0.2-0.3% of the elements of random bf16 rows, since x * 448 / amax has few bits) off the tie,
    so they stopped rounding to even on CUDA only. Dividing by a 0-d tensor on the same device takes the
    division kernel everywhere.
    """
    return amax.clamp(min=DYNAMIC_SCALE_EPS) / amax.new_full((), FP8_MAX)


def cast_to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturate then round to nearest even: fp8 has no infinities to overflow into."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """amax over the whole tensor as a 0-d tensor; 0 for an empty one (zero tokens)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=compute_dtype(x), device=x.device)
    return x.abs().amax().to(compute_dtype(x))


def expand_groups(scale: torch.Tensor, size: int, group: int, dim: int) -> torch.Tensor:
    """Repeat each per-group scale over its ``group`` elements along ``dim``, cut to ``size``."""
    return scale.repeat_interleave(group, dim=dim).narrow(dim, 0, size)


def _divide_and_cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return cast_to_fp8(x.to(compute_dtype(x)) / scale.to(compute_dtype(x)))


# Activations ----------------------------------------------------------------


def quantize_per_tensor(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for every element: the given static one, or the tensor's amax / 448."""
    if scale is None:
        scale = dynamic_scale(abs_max(x))
    scale = scale.reshape(1).to(compute_dtype(x))
    return _divide_and_cast(x, scale), scale


def quantize_per_token(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row: the given static one(s), or each row's amax / 448."""
    rows = (*x.shape[:-1], 1)
    if scale is None:
        scale = dynamic_scale(x.abs().amax(dim=-1, keepdim=True).to(compute_dtype(x)))
    elif scale.numel() == 1:
        scale = scale.to(compute_dtype(x)).reshape([1] * x.dim()).expand(rows).contiguous()
    else:
        scale = scale.to(compute_dtype(x)).reshape(rows)
    return _divide_and_cast(x, scale), scale


def quantize_per_group(x: torch.Tensor, group: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """One dynamic scale per row per ``group`` consecutive columns (the last group may be short)."""
    k = x.shape[-1]
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.to(compute_dtype(x)), (0, groups * group - k))
    amax = padded.reshape(*x.shape[:-1], groups, group).abs().amax(dim=-1)
    scale = dynamic_scale(amax)
    return _divide_and_cast(x, expand_groups(scale, k, group, -1)), scale


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Undo any activation quantizer above: the scale's last dim says which (1 column, or groups)."""
    k = q.shape[-1]
    if scale.dim() >= 2 and scale.shape[-1] > 1:
        scale = expand_groups(scale, k, GROUP_SIZE, -1)
    return q.to(dtype) * scale.to(dtype)


# Weights --------------------------------------------------------------------


def quantize_weight_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per matrix (per expert for ``[E, R, C]``)."""
    scale = dynamic_scale(w.abs().amax(dim=(-2, -1)).to(compute_dtype(w)))
    return _divide_and_cast(w, scale[..., None, None]), scale.to(torch.float32)


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per output row."""
    scale = dynamic_scale(w.abs().amax(dim=-1).to(compute_dtype(w)))
    return _divide_and_cast(w, scale[..., None]), scale.to(torch.float32)


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``[..., ceil(R/128), ceil(C/128)]`` block scales to one scale per element ``[..., R, C]``."""
    return expand_groups(expand_groups(scale, rows, BLOCK_SIZE, -2), cols, BLOCK_SIZE, -1)


def _with_block_scale(op, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``op(x, s)`` where s is each element's 128x128 tile scale.

    Whole tiles take the scale by broadcasting over a tiled view: no per-element copy of the scales, which
    made quantizing and dequantizing a 256-expert layer take seconds on a CPU. Partial edge tiles expand it.
    """
    rows, cols = x.shape[-2:]
    if rows % BLOCK_SIZE or cols % BLOCK_SIZE:
        return op(x, expand_block_scale(scale, rows, cols))
    tiles = x.reshape(*x.shape[:-2], rows // BLOCK_SIZE, BLOCK_SIZE, cols // BLOCK_SIZE, BLOCK_SIZE)
    return op(tiles, scale[..., :, None, :, None]).reshape(x.shape)


def quantize_weight_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per 128x128 tile; partial edge tiles take the amax of what they hold."""
    rows, cols = w.shape[-2:]
    rb, cb = -(-rows // BLOCK_SIZE), -(-cols // BLOCK_SIZE)
    padded = torch.nn.functional.pad(w.to(compute_dtype(w)), (0, cb * BLOCK_SIZE - cols, 0, rb * BLOCK_SIZE - rows))
    tiles = padded.reshape(*w.shape[:-2], rb, BLOCK_SIZE, cb, BLOCK_SIZE)
    scale = dynamic_scale(tiles.abs().amax(dim=(-3, -1)))
    return _with_block_scale(_divide_and_cast, w, scale), scale.to(torch.float32)


def dequantize_weight_per_tensor(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype)[..., None, None]


def dequantize_weight_per_channel(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype)[..., None]


def dequantize_weight_block(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _with_block_scale(torch.mul, q.to(dtype), scale.to(dtype))
