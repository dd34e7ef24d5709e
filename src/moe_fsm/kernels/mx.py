"""OCP MX formats: 32 elements share one power-of-two E8M0 scale (MXFP4 e2m1, MXFP8 e4m3).

Scales are stored as uint8 biased exponents (``2 ** (s - 127)``), the layout
vLLM's MX checkpoints and kernels use. The quantizers follow vLLM 0.33.0:

* MXFP4 (``downcast_to_mxfp``, also gpt-oss's weight format): the block amax is
  first rounded to one mantissa bit (its fp32 bits plus ``0x200000``, masked to
  the exponent), the scale is ``2 ** (floor(log2(that)) - 2)`` (2 is e2m1's
  largest exponent), and ``x / scale`` rounds to the nearest e2m1 value, ties to
  even, saturating at 6 (vLLM multiplies by ``1 / scale``: the same bits, since the
  reciprocal of a power of two is exact);
* MXFP8 (``_mxfp8_e4m3_quantize_torch``): the scale is ``2 ** ceil(log2(amax /
  448))``, so ``x / scale`` always fits e4m3, and the cast rounds to nearest even.
  ``amax / 448`` is a correctly rounded division on every device (``intq.divide``):
  on CUDA ``tensor / 448.0`` multiplies by the inexact float32 reciprocal, and for an
  amax of ``7 * 2**k`` (bf16 holds such values) the quotient, exactly ``2**(k - 6)``,
  came out an ulp above it and the ceiling one exponent too high.

Values ``[..., K]`` with K a multiple of 32; MXFP4 packs two e2m1 nibbles per
byte, element ``2i`` in the low nibble (as NVFP4 does).
"""

from __future__ import annotations

import torch

from moe_fsm.kernels import nvfp4
from moe_fsm.kernels.intq import divide

BLOCK = 32
E8M0_BIAS = 127
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_E2M1_MAX_EXPONENT = 2
_ROUND_AMAX_TO_ONE_BIT = 0x200000
_EXPONENT_MASK = 0x7F800000


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % BLOCK:
        raise ValueError(f"MX formats need the last dimension divisible by {BLOCK}; got {list(x.shape)}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def scale_values(scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E8M0 biased exponents (uint8) to their float multipliers ``2 ** (s - 127)``."""
    return torch.exp2(scales.to(dtype) - E8M0_BIAS)


def _mxfp4_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Unbiased scale exponent of each block: floor(log2(amax rounded to 1 mantissa bit)) - 2, in [-127, 127]."""
    bits = amax.to(torch.float32).view(torch.int32)
    rounded = ((bits + _ROUND_AMAX_TO_ONE_BIT) & _EXPONENT_MASK).view(torch.float32)
    rounded = torch.where(rounded == 0, torch.full_like(rounded, 2.0**-126), rounded)
    return (torch.floor(torch.log2(rounded)) - _E2M1_MAX_EXPONENT).clamp(-E8M0_BIAS, E8M0_BIAS)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., K] -> (packed e2m1 uint8 [..., K/2], E8M0 scales uint8 [..., K/32])."""
    blocks = _blocks(x.to(torch.float32))
    exponent = _mxfp4_scale_exponent(blocks.abs().amax(dim=-1, keepdim=True))
    codes = nvfp4.e2m1_codes(blocks / torch.exp2(exponent))
    return nvfp4.pack(codes.reshape(x.shape)), (exponent + E8M0_BIAS).to(torch.uint8).squeeze(-1)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``e2m1 * 2 ** (s - 127)``: [..., K/2] bytes and [..., K/32] scales -> [..., K]."""
    values = _blocks(nvfp4.e2m1_values(nvfp4.unpack(packed), dtype))
    return (values * scale_values(scales, dtype).unsqueeze(-1)).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., K] -> (e4m3 [..., K], E8M0 scales uint8 [..., K/32])."""
    blocks = _blocks(x.to(torch.float32))
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    biased = (torch.ceil(torch.log2(divide(amax, FP8_MAX))) + E8M0_BIAS).clamp(0, 2 * E8M0_BIAS)
    q = (blocks / torch.exp2(biased - E8M0_BIAS)).to(FP8_DTYPE)
    return q.reshape(x.shape), biased.to(torch.uint8).squeeze(-1)


def dequantize_mxfp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    values = _blocks(q.to(dtype))
    return (values * scale_values(scales, dtype).unsqueeze(-1)).reshape(q.shape)
