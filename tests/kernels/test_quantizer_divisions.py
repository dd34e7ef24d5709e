"""The INT8, MX and NVFP4 quantizers divide as the FP8 ones do, bit for bit with vLLM 0.33.0's formulas.

Each expectation is restated here in float64, rounding to float32 after every operation:
a float64 quotient or product of float32 operands rounded to float32 is the correctly
rounded float32 result (53 >= 2 * 24 + 2 bits), so these are the bits an IEEE float32
division or multiplication gives, whatever the device. The formulas are vLLM's where
vLLM defines them (``per_token_quant_int8``, ``scaled_int8_quant``'s kernels,
``_mxfp8_e4m3_quantize_torch``), else a division by the dequantization multiplier.
The CUDA tests check that the same quantizers give the CPU's bits on a GPU, where
``tensor / 127.0`` used to multiply by the rounded float32 reciprocal of 127.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch_moe_cases import seed_for

from moe_fsm.kernels import intq, mx, nvfp4

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def f32(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to float32 once, kept as float64 for the next exact step."""
    return x.to(torch.float32).to(torch.float64)


def half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([math.copysign(math.floor(abs(v) + 0.5), v) for v in x.flatten().tolist()],
                        dtype=torch.float64).reshape(x.shape)


def bf16_rows(rows: int, cols: int, seed: object) -> torch.Tensor:
    """Random bf16 rows over many magnitudes, plus rows whose amax is 7 * 2**k (amax / 448 is a power of two)."""
    gen = torch.Generator().manual_seed(seed_for(seed))
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-4, 4, rows).unsqueeze(1)
    x[: rows // 4, 0] = torch.tensor([7.0 * 2.0**k for k in range(-(rows // 8), rows // 4 - rows // 8)])
    x[: rows // 4, 1:] = x[: rows // 4, 1:].clamp(-1, 1) * x[: rows // 4, :1].abs() / 8
    return x.to(torch.bfloat16)


# INT8 activations ------------------------------------------------------------


def test_per_token_int8_is_vllms_per_token_quant_int8_bit_for_bit() -> None:
    """absmax = max(amax, 1e-10), scale = absmax / 127, q = round-half-away(x * (127 / absmax))."""
    x = bf16_rows(64, 96, "int8-token")
    ties = torch.tensor([[127.0, 2.5, -2.5, 0.5, -1.5, 126.5, 0.0, 64.0]], dtype=torch.bfloat16)
    zeros = torch.zeros(1, 8, dtype=torch.bfloat16)
    for rows in (x, ties, zeros):
        q, scale = intq.quantize_int8_activation(rows, per_token=True, symmetric=True)
        xd = rows.to(torch.float64)
        absmax = xd.abs().amax(dim=-1, keepdim=True).clamp(min=f32(torch.tensor(1e-10, dtype=torch.float64)).item())
        want_q = half_away(f32(xd * f32(127 / absmax))).clamp(-128, 127)
        assert torch.equal(q.to(torch.float64), want_q)
        assert torch.equal(scale.to(torch.float64), f32(absmax / 127))
    q, _ = intq.quantize_int8_activation(ties, per_token=True, symmetric=True)
    assert q.tolist() == [[127, 3, -3, 1, -2, 127, 0, 64]]  # halves go away from zero (libdevice round)


def test_per_tensor_int8_divides_by_a_correctly_rounded_scale() -> None:
    """vLLM's dynamic per-tensor path: scale = max(amax / 127, 1e-10), then scaled_int8_quant: rint(x / scale)."""
    x = bf16_rows(32, 64, "int8-tensor")
    q, scale = intq.quantize_int8_activation(x, per_token=False, symmetric=True)
    xd = x.to(torch.float64)
    s = f32(xd.abs().max() / 127)
    assert torch.equal(scale.to(torch.float64), s.reshape(1))
    assert torch.equal(q.to(torch.float64), torch.round(f32(xd / s)).clamp(-128, 127))


@pytest.mark.parametrize("per_token", [True, False])
def test_asymmetric_int8_is_scaled_int8_quants_azp_kernel_bit_for_bit(per_token: bool) -> None:
    """scale = (max - min) / 255, azp = rint(-128 - min / scale), q = sat(rint(x * (1 / scale)) + azp)."""
    x = (bf16_rows(64, 96, ("azp", per_token)).float() + 0.3).to(torch.bfloat16)
    q, packed = intq.quantize_int8_activation(x, per_token=per_token, symmetric=False)
    xd = x.to(torch.float64)
    lo = xd.amin(dim=-1, keepdim=True) if per_token else xd.min().reshape(1)
    hi = xd.amax(dim=-1, keepdim=True) if per_token else xd.max().reshape(1)
    s = f32((hi - lo) / 255)
    azp = torch.round(f32(-128 - f32(lo / s)))
    want = (torch.round(f32(xd * f32(1 / s))) + azp).clamp(-128, 127)
    assert torch.equal(q.to(torch.float64), want)
    assert torch.equal(packed.to(torch.float64), torch.cat((s, azp), dim=-1))


def test_int8_and_group_weight_scales_are_correctly_rounded_quotients() -> None:
    w = bf16_rows(64, 128, "int-weights").reshape(2, 32, 128)
    wd = w.to(torch.float64)
    _, scale = intq.quantize_int8_weight(w, per_channel=True)
    assert torch.equal(scale.to(torch.float64), f32(wd.abs().amax(dim=-1) / 127))
    codes, scales, _ = intq.quantize_weight(w, 4, 32, zero_point=False, scale_dtype=torch.float32)
    amax = wd.reshape(2, 32, 4, 32).abs().amax(dim=-1)
    assert torch.equal(scales.to(torch.float64), f32(2 * amax / 15))
    s = scales.to(torch.float64).repeat_interleave(32, dim=-1)
    want = (torch.round(f32(wd / s)) + 8).clamp(0, 15)
    assert torch.equal(intq.unpack_nibbles(codes).to(torch.float64), want)


# MX ------------------------------------------------------------------------


def test_mxfp8_scale_of_an_amax_of_seven_times_a_power_of_two() -> None:
    """amax / 448 = 2**(k - 6) exactly: ceil(log2) is k - 6, so the block's largest value becomes 448, not 224."""
    x = bf16_rows(64, 64, "mxfp8")
    q, scales = mx.quantize_mxfp8(x)
    amax = x.to(torch.float64).reshape(64, 2, 32).abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    want = (torch.ceil(torch.log2(f32(amax / 448))) + 127).clamp(0, 254)
    assert torch.equal(scales.to(torch.float64), want)
    sevens = x[:16, 0].to(torch.float64)
    assert torch.equal(q[:16, 0].to(torch.float64), 448 * torch.sign(sevens))


def test_mxfp4_divides_by_its_power_of_two_scale() -> None:
    x = bf16_rows(32, 64, "mxfp4")
    packed, scales = mx.quantize_mxfp4(x)
    step = torch.exp2(scales.to(torch.float64) - 127).repeat_interleave(32, dim=-1)
    want = nvfp4.round_to_e2m1((x.to(torch.float64) / step).clamp(-6, 6))
    assert torch.equal(nvfp4.e2m1_values(nvfp4.unpack(packed), torch.float64), want)


# NVFP4 ---------------------------------------------------------------------


def test_nvfp4_weights_divide_by_the_dequantization_multipliers() -> None:
    w = bf16_rows(64, 64, "nvfp4-w").reshape(4, 16, 64)
    packed, block, wg = nvfp4.quantize_weight(w)
    wd = w.to(torch.float64)
    amax_w = wd.abs().amax(dim=(-2, -1))
    assert torch.equal(wg.to(torch.float64), f32(amax_w / 2688))
    g = wg.to(torch.float64)[:, None, None, None]
    blocks = wd.reshape(4, 16, 4, 16)
    want_block = f32(f32(blocks.abs().amax(dim=-1, keepdim=True) / 6) / g).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(block.view(torch.uint8), want_block.squeeze(-1).view(torch.uint8))
    step = f32(want_block.to(torch.float64) * g)
    want = nvfp4.round_to_e2m1(torch.where(step == 0, 0.0, f32(blocks / step)).clamp(-6, 6)).reshape(4, 16, 64)
    assert torch.equal(nvfp4.e2m1_values(nvfp4.unpack(packed), torch.float64), want)


def test_nvfp4_activations_keep_vllms_triton_formula() -> None:
    """s = e4m3(g * (amax * (1/6))), q = e2m1(x * (g / s)): _nvfp4_quant_dequant_kernel's steps."""
    x = bf16_rows(32, 64, "nvfp4-a")
    g = nvfp4.activation_global_scale(x.float().abs().max())
    packed, block = nvfp4.quantize(x, g)
    gd, xd = g.to(torch.float64), x.to(torch.float64).reshape(32, 4, 16)
    s = f32(gd * f32(xd.abs().amax(dim=-1, keepdim=True) * f32(torch.tensor(1 / 6, dtype=torch.float64))))
    s = s.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(block.view(torch.uint8), s.squeeze(-1).view(torch.uint8))
    inverse = torch.where(s.to(torch.float64) == 0, 0.0, f32(gd / s.to(torch.float64)))
    want = nvfp4.round_to_e2m1(f32(xd * inverse).clamp(-6, 6)).reshape(32, 64)
    assert torch.equal(nvfp4.e2m1_values(nvfp4.unpack(packed), torch.float64), want)


def test_nvfp4_activation_global_scale_is_one_rounded_quotient() -> None:
    """2688 / amax rounded once; PyTorch's ``2688 / t`` is ``t.reciprocal() * 2688`` and is off for some amax."""
    amax = torch.rand(100_000, generator=torch.Generator().manual_seed(seed_for("nvfp4-g"))) * 50 + 1e-3
    assert torch.equal(nvfp4.activation_global_scale(amax).to(torch.float64), f32(2688 / amax.to(torch.float64)))


# The same bits on a GPU ----------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu()
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn,) else t


QUANTIZERS = {
    "int8-token": lambda x: intq.quantize_int8_activation(x, per_token=True, symmetric=True),
    "int8-tensor": lambda x: intq.quantize_int8_activation(x, per_token=False, symmetric=True),
    "int8-azp": lambda x: intq.quantize_int8_activation(x, per_token=True, symmetric=False),
    "int8-weight": lambda x: intq.quantize_int8_weight(x.reshape(4, -1, x.shape[-1]), per_channel=True),
    "int4-g32": lambda x: intq.quantize_weight(x, 4, 32, zero_point=True, scale_dtype=torch.float16)[:2],
    "mxfp8": mx.quantize_mxfp8,
    "mxfp4": mx.quantize_mxfp4,
    "nvfp4-weight": lambda x: nvfp4.quantize_weight(x.reshape(4, -1, x.shape[-1])),
    "nvfp4-global": lambda x: (nvfp4.activation_global_scale(x.float().abs().amax(dim=-1)),),
}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_cuda_gives_the_cpus_bits(name: str) -> None:
    x = bf16_rows(256, 128, ("cuda", name))
    on_cpu = QUANTIZERS[name](x)
    on_gpu = QUANTIZERS[name](x.cuda())
    for got, want in zip(on_gpu, on_cpu):
        assert got.is_cuda
        assert torch.equal(_bits(got), _bits(want)), name
