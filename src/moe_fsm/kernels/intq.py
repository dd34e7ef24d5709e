"""Integer quantization: INT4/INT8 weights with group scales (and zero points), INT8 activations.

Weights ``[..., R, C]`` are quantized along C in groups of G columns (G = C for
one scale per output channel) and stored *unsigned* in uint8, the way GPTQ
(``uint4b8``/``uint8b128``) and AWQ/compressed-tensors (``uint4`` with zero
points) store them: the value a stored code stands for is

    w = (code - zero) * scale

with ``zero`` the fixed bias ``2 ** (bits - 1)`` (8 or 128) for symmetric
weights, or a per-group zero point for asymmetric ones. 4-bit codes are packed
two per byte, element ``2i`` in the low nibble. Scales and zero points are
``[..., R, C/G]``; scales are stored in the key's scale dtype (fp16 for WNA16,
bf16 for W4A8-INT8 groups, fp32 otherwise), since that rounding is part of what
a checkpoint holds.

Activation-ordered weights (GPTQ ``desc_act``, compressed-tensors group activation order)
are quantized with their columns visited in another order, so a scale group gathers
columns from all over the row: ``g_idx[c]`` names column c's group, codes stay in
column order, and ``w[r, c] = (code[r, c] - zero[r, g_idx[c]]) * scale[r, g_idx[c]]``.
GPTQ orders columns by its Hessian's diagonal, descending; without calibration data
the squared column norm stands in for it. Every group still holds G columns.

Symmetric weights use GPTQ's grid: ``scale = 2 * amax / (2**bits - 1)``, codes
``clamp(round(w / scale) + zero, 0, 2**bits - 1)``. Asymmetric: ``scale =
(max - min) / (2**bits - 1)``, ``zero = round(-min / scale)``.

INT8 activations follow what vLLM 0.33.0 runs for them, formula for formula:

* per token, symmetric (``per_token_quant_int8``, the fused MoE's per-token path):
  ``absmax = max(amax, 1e-10)``, ``scale = absmax / 127``, ``q = round(x * (127 /
  absmax))`` rounding halves away from zero (libdevice ``round``);
* per tensor, symmetric: ``scale = max(amax / 127, 1e-10)`` (dynamic) or the static
  one, ``q = clamp(rint(x / scale), -128, 127)`` (``scaled_int8_quant`` with a scale:
  a division, ``cvt.rni``: halves to even);
* asymmetric (azp, ``scaled_int8_quant``'s azp kernels): ``scale = (max - min) / 255``,
  ``azp = rint(-128 - min / scale)``, ``q = clamp(rint(x * (1 / scale)) + azp, -128,
  127)``, dequantized as ``(q - azp) * scale``.

W8A8 weights are int8 with ``scale = amax / 127`` per output channel or per tensor.

Every division is a correctly rounded division on every device, as in
``moe_fsm.kernels.fp8``: a divisor that is a Python number is made a 0-d tensor on
the operand's device first (``tensor / 127.0`` on CUDA multiplies by the float32
reciprocal of 127, which is inexact, so scales differed from the CPU's by an ulp), and
``number / tensor`` is never written (PyTorch computes it as ``tensor.reciprocal() *
number``, two roundings). The only products by a quotient are the two vLLM defines
(``127 / absmax`` and ``1 / scale`` above), each quotient itself rounded once.
"""

from __future__ import annotations

from typing import Optional

import torch

_EPS = 1e-10


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def divide(t: torch.Tensor, number: float) -> torch.Tensor:
    """``t / number`` correctly rounded on every device (a 0-d divisor on t's device, never the CPU-scalar path)."""
    return t / t.new_full((), number)


def quotient(number: float, t: torch.Tensor) -> torch.Tensor:
    """``number / t`` rounded once (PyTorch's ``number / t`` is ``t.reciprocal() * number``: two roundings)."""
    return t.new_full((), number) / t


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, halves away from zero (libdevice/C ``round``; torch.round ties to even)."""
    whole = torch.trunc(x)
    return whole + torch.where((x - whole).abs() >= 0.5, torch.sign(x), torch.zeros_like(x))


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    g = w.shape[-1] if group_size == -1 else group_size
    if w.shape[-1] % g:
        raise ValueError(f"group size {g} does not divide the last dimension of {list(w.shape)}")
    return w.reshape(*w.shape[:-1], w.shape[-1] // g, g)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., C]`` 4-bit codes (uint8) to ``[..., C/2]`` bytes, even elements in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def act_order_permutation(w: torch.Tensor) -> torch.Tensor:
    """Column visiting order of activation-ordered quantization, per matrix: [..., C] int64, largest squared norm first."""
    return torch.argsort(-_float(w).pow(2).sum(dim=-2), dim=-1, stable=True)


def act_order_quantize_weight(
    w: torch.Tensor, bits: int, group_size: int, *, zero_point: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Activation-ordered ``quantize_weight``: (codes in column order, scales, zero points or None, g_idx int32 [..., C])."""
    order = act_order_permutation(w)
    visited = torch.gather(w, -1, order.unsqueeze(-2).expand(w.shape))
    codes, scales, zeros = quantize_weight(visited, bits, group_size, zero_point=zero_point, scale_dtype=scale_dtype)
    values = unpack_nibbles(codes) if bits == 4 else codes
    in_column_order = torch.empty_like(values).scatter_(-1, order.unsqueeze(-2).expand(values.shape), values)
    g_idx = torch.empty_like(order).scatter_(-1, order, torch.arange(w.shape[-1], device=w.device).expand(order.shape) // group_size)
    return (pack_nibbles(in_column_order) if bits == 4 else in_column_order), scales, zeros, g_idx.to(torch.int32)


def quantize_weight(
    w: torch.Tensor, bits: int, group_size: int, *, zero_point: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``w`` [..., R, C] -> (codes uint8 [..., R, C * bits / 8], scales [..., R, C/G], zero points uint8 or None)."""
    levels = 2**bits - 1
    groups = _groups(_float(w), group_size)
    if zero_point:
        lo = groups.amin(dim=-1, keepdim=True).clamp(max=0)
        hi = groups.amax(dim=-1, keepdim=True).clamp(min=0)
        scale = divide(hi - lo, levels).clamp(min=_EPS).to(scale_dtype)
        s = scale.to(groups.dtype)
        zero = torch.round(-lo / s).clamp(0, levels)
    else:
        amax = groups.abs().amax(dim=-1, keepdim=True)
        scale = divide(2 * amax, levels).clamp(min=_EPS).to(scale_dtype)
        s = scale.to(groups.dtype)
        zero = torch.full_like(s, 2 ** (bits - 1))
    codes = (torch.round(groups / s) + zero).clamp(0, levels).to(torch.uint8).reshape(w.shape)
    if bits == 4:
        codes = pack_nibbles(codes)
    zeros = zero.squeeze(-1).to(torch.uint8) if zero_point else None
    return codes, scale.squeeze(-1), zeros


def dequantize_weight(
    codes: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], bits: int, dtype: torch.dtype = torch.float32,
    g_idx: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``(code - zero) * scale`` -> [..., R, C] in ``dtype``; with ``g_idx`` [..., C], column c takes group g_idx[c]."""
    values = unpack_nibbles(codes) if bits == 4 else codes
    if g_idx is not None:
        index = g_idx.long().unsqueeze(-2).expand(values.shape)
        zero = torch.gather(zeros, -1, index).to(dtype) if zeros is not None else 2 ** (bits - 1)
        return (values.to(dtype) - zero) * torch.gather(scales, -1, index).to(dtype)
    groups = values.reshape(*values.shape[:-1], scales.shape[-1], -1).to(dtype)
    zero = zeros.to(dtype).unsqueeze(-1) if zeros is not None else 2 ** (bits - 1)
    return ((groups - zero) * scales.to(dtype).unsqueeze(-1)).reshape(values.shape)


def quantize_int8_weight(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8 weights [..., R, C] -> (int8, fp32 scales [..., R] per channel or [...] per tensor)."""
    x = _float(w)
    amax = x.abs().amax(dim=-1) if per_channel else x.abs().amax(dim=(-2, -1))
    scale = divide(amax, 127).clamp(min=_EPS).to(torch.float32)
    s = scale.to(x.dtype).unsqueeze(-1) if per_channel else scale.to(x.dtype)[..., None, None]
    return torch.round(x / s).clamp(-128, 127).to(torch.int8), scale


def dequantize_int8_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    s = scale.to(dtype)
    s = s.unsqueeze(-1) if s.dim() == q.dim() - 1 else s[..., None, None]
    return q.to(dtype) * s


def quantize_int8_activation(
    x: torch.Tensor, *, per_token: bool, symmetric: bool, static_scale: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., K] -> (int8, scale): scale [..., 1] per token or [1] per tensor.

    Asymmetric quantization returns (scale, azp) as a trailing pair so one tensor
    travels with the rows: [..., 2] per token, [2] per tensor. ``static_scale`` (a
    calibrated symmetric per-tensor scale) replaces the dynamic one.
    """
    xf = _float(x)

    def reduce(t: torch.Tensor, op) -> torch.Tensor:
        return op(t, dim=-1, keepdim=True) if per_token else op(t).reshape(1)

    if symmetric and static_scale is None and per_token:
        absmax = reduce(xf.abs(), torch.amax).clamp(min=_EPS)
        q = round_half_away(xf * quotient(127, absmax))
        return q.clamp(-128, 127).to(torch.int8), divide(absmax, 127).to(torch.float32)
    if symmetric:
        scale = static_scale.to(xf.dtype).reshape(1) if static_scale is not None else divide(reduce(xf.abs(), torch.amax), 127).clamp(min=_EPS)
        return torch.round(xf / scale).clamp(-128, 127).to(torch.int8), scale.to(torch.float32)
    lo, hi = reduce(xf, torch.amin), reduce(xf, torch.amax)
    scale = divide(hi - lo, 255).clamp(min=_EPS)
    azp = torch.round(-128 - lo / scale)
    q = (torch.round(xf * quotient(1, scale)) + azp).clamp(-128, 127).to(torch.int8)
    return q, torch.cat((scale, azp), dim=-1).to(torch.float32)


def dequantize_int8_activation(q: torch.Tensor, scale: torch.Tensor, symmetric: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if symmetric:
        return q.to(dtype) * scale.to(dtype)
    return (q.to(dtype) - scale[..., 1:2].to(dtype)) * scale[..., 0:1].to(dtype)
