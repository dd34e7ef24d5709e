"""NVFP4: e2m1 values packed two per byte, an e4m3 scale per 16 elements, an fp32 global scale.

Follows vLLM's reference emulation (``ref_nvfp4_quant`` / ``dequantize_to_dtype``):

* a value nibble is ``sign << 3 | code``, code 0..7 for magnitudes
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}; element ``2i`` goes in the LOW nibble of byte ``i``;
* activations, with a *quantization multiplier* ``g`` (``a*_global_scale``): per block
  ``s = e4m3(clamp(g * (amax * (1/6)), +-448))``, ``q = round_to_e2m1(clamp(x * (g / s), +-6))``
  (``s == 0`` quantizes the block to 0), the formula of vLLM's Triton quantize-dequantize
  kernel (``_nvfp4_quant_dequant_kernel``), kept bit for bit;
* weights, which vLLM only loads, divide by what dequantization multiplies by, as the FP8
  quantizers do: ``s = e4m3(clamp(amax / 6 / weight_global, +-448))`` and
  ``q = round_to_e2m1(clamp(x / (s * weight_global), +-6))``, every division correctly
  rounded (no rounded reciprocal ``1 / weight_global``);
* rounding to e2m1 is to nearest, ties to the even code: 0.25 -> 0, 0.75 -> 1,
  1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4, above 5 -> 6;
* activations dequantize as ``q * (s / g)``; weights as ``q * (s * weight_global)``,
  where ``weight_global = amax / (448 * 6)`` is what checkpoints store as
  ``weight_scale_2`` and ExpertScales carries as ``w*_global_scale``.

Tensors are ``[..., K]`` with K a multiple of 16; packed values ``[..., K/2]`` uint8,
block scales ``[..., K/16]`` float8_e4m3fn. A global scale broadcasts against the
leading dims (a 0-d tensor, or ``[E, 1]`` for ``[E, R, K]`` weights).
"""

from __future__ import annotations

import torch

from moe_fsm.kernels.intq import divide, quotient

BLOCK = 16
E2M1_MAX = 6.0
SCALE_MAX = 448.0
SCALE_DTYPE = torch.float8_e4m3fn
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes, and whether a tie there rounds up
# (to the even code) or down.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)
_SIGN_BIT = 0x8


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nibbles (sign bit | magnitude code) of ``x`` rounded to the nearest e2m1 value, as uint8."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, up in zip(_MIDPOINTS, _TIE_ROUNDS_UP):
        code += (mag >= midpoint if up else mag > midpoint).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float value of each nibble."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=dtype, device=codes.device)
    magnitude = table[(codes & 0x7).long()]
    return torch.where((codes & _SIGN_BIT) != 0, -magnitude, magnitude)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    return e2m1_values(e2m1_codes(x), _float(x).dtype)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` nibbles to ``[..., K/2]`` bytes, even elements in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` bytes to ``[..., K]`` nibbles."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _trailing(scale: torch.Tensor, dims: int, dtype: torch.dtype) -> torch.Tensor:
    """A global scale given for the leading dims, with ``dims`` trailing dims added to broadcast."""
    scale = scale.to(dtype)
    return scale.reshape(*scale.shape, *([1] * dims)) if scale.dim() else scale


def quantize(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., K] with quantization multiplier ``global_scale`` -> (packed uint8, e4m3 block scales)."""
    blocks = _blocks(_float(x))
    g = _trailing(global_scale, 2, blocks.dtype)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = (g * (amax * (1.0 / E2M1_MAX))).clamp(-SCALE_MAX, SCALE_MAX).to(SCALE_DTYPE)
    s = scale.to(blocks.dtype)
    inverse = torch.where(s == 0, torch.zeros_like(s), g / s)
    codes = e2m1_codes((blocks * inverse).clamp(-E2M1_MAX, E2M1_MAX))
    return pack(codes.reshape(x.shape)), scale.squeeze(-1)


def _dequantize(packed: torch.Tensor, block_factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    values = _blocks(e2m1_values(unpack(packed), dtype))
    return (values * block_factor.unsqueeze(-1)).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_activation(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q * (s / g)`` with ``g`` the quantization multiplier the activation was quantized with."""
    return _dequantize(packed, block_scale.to(dtype) / _trailing(global_scale, 1, dtype), dtype)


def fake_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Quantize then dequantize (the emulation backend's QDQ), in x's compute precision."""
    packed, scale = quantize(x, global_scale)
    return dequantize_activation(packed, scale, global_scale, _float(x).dtype)


def weight_global_scale(w: torch.Tensor) -> torch.Tensor:
    """Per-matrix dequantization multiplier ``amax / (448 * 6)`` (``weight_scale_2``), fp32 [...]."""
    amax = _float(w).abs().amax(dim=(-2, -1)).clamp(min=1e-10)
    return divide(amax, SCALE_MAX * E2M1_MAX).to(torch.float32)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` [..., R, C] -> (packed [..., R, C/2], e4m3 block scales [..., R, C/16], weight_global [...]).

    Divides by the dequantization multipliers (module docstring): the block scale is the block's
    amax / 6 over ``weight_global``, and each value is divided by ``s * weight_global`` rounded as
    ``dequantize_weight`` rounds it.
    """
    weight_global = weight_global_scale(w)
    blocks = _blocks(_float(w))
    wg = _trailing(weight_global, 3, blocks.dtype)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = (divide(amax, E2M1_MAX) / wg).clamp(-SCALE_MAX, SCALE_MAX).to(SCALE_DTYPE)
    step = scale.to(blocks.dtype) * wg
    scaled = torch.where(step == 0, torch.zeros_like(blocks), blocks / step)
    codes = e2m1_codes(scaled.clamp(-E2M1_MAX, E2M1_MAX))
    return pack(codes.reshape(w.shape)), scale.squeeze(-1), weight_global


def dequantize_weight(
    packed: torch.Tensor, block_scale: torch.Tensor, weight_global: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q * (s * weight_global)``, the order vLLM's ``dequantize_to_dtype`` multiplies in."""
    return _dequantize(packed, block_scale.to(dtype) * _trailing(weight_global, 2, dtype), dtype)


def activation_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The quantization multiplier that maps a calibrated amax onto 448 * 6 (``1 / input_scale``)."""
    return quotient(SCALE_MAX * E2M1_MAX, _float(amax).clamp(min=1e-10)).to(torch.float32)
