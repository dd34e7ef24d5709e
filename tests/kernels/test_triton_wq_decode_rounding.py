"""The rounding argument of the weight-quantized kernel's fast INT4 decode, checked exhaustively on the CPU.

``_int4_nibbles_bf16`` / ``_int4_nibbles_scaled_bf16`` (``kernels/triton_wq/_kernels.py``) are inline PTX, which
neither the CPU nor Triton's interpreter runs; ``tests/gpu/test_triton_wq.py::
test_fast_decode_dequant_is_the_plain_path_bit_for_bit`` compares their layer output with the plain path's on a GPU
for the scales and zero points one random draw gives. Here each PTX step is replayed in torch with the rounding its
instruction does (bf16 round-to-nearest-even of the exact result) for every INT4 code, every zero point and every
finite fp16 scale, and the result compared with the plain path's ``bf16(fp32(code - zero) x fp32(scale))``.
"""

from __future__ import annotations

import torch

MAGIC = 0x4300  # bf16 128: a 4-bit value or-ed into its mantissa reads 128 + value


def _bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int16).view(torch.bfloat16).to(torch.float64)


def _rn_bf16(exact: torch.Tensor) -> torch.Tensor:
    """A bf16 instruction's result: the exact value (here at most 24 significant bits, so exact in fp32) rounded
    to the nearest bf16, ties to even."""
    assert torch.equal(exact.to(torch.float32).to(torch.float64), exact)
    return exact.to(torch.float32).to(torch.bfloat16).to(torch.float64)


def _finite_fp16() -> torch.Tensor:
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return every[torch.isfinite(every)].to(torch.float64)


def _fp16_scale_split(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_fp16_scale_split``: hi = s rounded to bf16, lo = (s - hi) rounded to bf16."""
    hi = s.to(torch.float32).to(torch.bfloat16).to(torch.float64)
    lo = (s - hi).to(torch.float32).to(torch.bfloat16).to(torch.float64)
    return hi, lo


def _codes_minus_zeros() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(code, zero point, c) over every pair: c as the PTX forms it, ``sub.bf16x2`` of the or-ed bit patterns."""
    code, zero = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    code, zero = code.reshape(-1), zero.reshape(-1)
    c = _rn_bf16(_bf16_from_bits(code | MAGIC) - _bf16_from_bits(zero | MAGIC))
    return code, zero, c


def test_code_minus_zero_point_is_exact_in_bf16():
    code, zero, c = _codes_minus_zeros()
    assert torch.equal(_bf16_from_bits(zero | MAGIC), 128.0 + zero.to(torch.float64))  # _int4_zero_bf16
    assert torch.equal(c, (code - zero).to(torch.float64))
    symmetric = _rn_bf16(_bf16_from_bits(code | MAGIC) - 136.0)  # the symmetric zero operand, bf16 128 + 8
    assert torch.equal(symmetric, (code - 8).to(torch.float64))


def test_scale_split_is_exact_for_every_fp16_scale():
    s = _finite_fp16()
    hi, lo = _fp16_scale_split(s)
    assert torch.equal(hi + lo, s)


def _scaled_bits_match(c_values: torch.Tensor) -> bool:
    """Whether mul.bf16x2 (c x lo) then fma.rn.bf16x2 (c x hi + p) equals the plain path's bf16(c x s) for every c in
    c_values and every finite fp16 scale s."""
    s = _finite_fp16()[None, :]
    hi, lo = _fp16_scale_split(s)
    c = c_values.to(torch.float64)[:, None]
    p = _rn_bf16(c * lo)
    fast = _rn_bf16(c * hi + p)
    plain = (c.to(torch.float32) * s.to(torch.float32)).to(torch.bfloat16).to(torch.float64)
    return torch.equal(fast, plain)


def test_scaled_decode_rounds_once_as_the_plain_path():
    _, _, c = _codes_minus_zeros()
    assert _scaled_bits_match(torch.unique(c))  # -15 .. 15: zero points 0 .. 15 and the symmetric 8


def test_the_margin_of_the_argument():
    """The low part has at most 2 significant bits (|lo| <= half of hi's last place, a multiple of s's fp16 ulp), so
    ``c x lo`` is exact in bf16 (8 significant bits) up to |c| <= 63; INT4's |code - zero point| <= 15 is well
    inside. The replay has teeth: 7-bit differences are rounded twice for some scales."""
    assert _scaled_bits_match(torch.arange(-63, 64))
    assert not _scaled_bits_match(torch.arange(-127, 128))
