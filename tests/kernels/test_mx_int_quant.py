"""MX (E8M0 per 32) and integer (group scales, zero points, INT8 activations) quantizers.

Each quantizer is checked against a float64 restatement of its rule written here
from vLLM 0.33.0's code (``downcast_to_mxfp``, ``_mxfp8_e4m3_quantize_torch``,
``scaled_int8_quant``) and GPTQ's grid, plus hand-worked values.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.kernels import intq, mx
from moe_fsm.modular.interfaces import ExpertScales
from moe_fsm.modular.validation import check_weight_scales
from moe_fsm.quantize.weights import dequantize_weights, quantize_weights

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _round_e2m1(v: float) -> float:
    """Nearest e2m1 magnitude, ties to the even code, saturating at 6."""
    mag = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1[i] - mag), i % 2))
    return math.copysign(E2M1[best], v) if best else 0.0


def _mxfp4_block(values: list[float]) -> tuple[list[float], int]:
    amax = max(abs(v) for v in values)
    if amax == 0:
        return [0.0] * len(values), 0
    exponent = math.floor(math.log2(amax))
    if amax / 2**exponent >= 1.75:  # the amax rounds to one mantissa bit first
        exponent += 1
    exponent = max(-127, min(127, exponent - 2))
    return [_round_e2m1(v / 2**exponent) * 2**exponent for v in values], exponent + 127


def test_mxfp4_matches_the_float64_rule():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=gen) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x[0, :32] = 0.0
    x[1, 5] = 7.0 * 2.0**-3  # amax at the 1.75 rounding edge
    packed, scales = mx.quantize_mxfp4(x.to(torch.bfloat16))
    assert packed.dtype == torch.uint8 and packed.shape == (6, 48) and scales.shape == (6, 3)
    out = mx.dequantize_mxfp4(packed, scales, torch.float64)
    xb = x.to(torch.bfloat16).to(torch.float64)
    for r in range(6):
        for b in range(3):
            want, biased = _mxfp4_block(xb[r, 32 * b : 32 * b + 32].tolist())
            assert int(scales[r, b]) == biased, (r, b)
            assert out[r, 32 * b : 32 * b + 32].tolist() == want, (r, b)


def test_mxfp4_hand_values_and_packing():
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([6.0, -3.0, 0.75, 0.25, 2.5, -5.0])  # amax 6 -> scale 2^0 (exponent 129 - 2)
    packed, scales = mx.quantize_mxfp4(x)
    assert int(scales[0, 0]) == 127
    # codes: 6 -> 7, -3 -> 8|5, 0.75 -> 2 (tie to even: 1.0), 0.25 -> 0 (tie to even), 2.5 -> 4 (2.0), -5 -> 8|6 (4.0)
    assert packed[0, :3].tolist() == [7 | (13 << 4), 2 | (0 << 4), 4 | (14 << 4)]


def test_mxfp8_matches_the_float64_rule():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=gen) * torch.tensor([1e-4, 1.0, 300.0, 1e5]).unsqueeze(1)
    q, scales = mx.quantize_mxfp8(x)
    assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8 and scales.shape == (4, 2)
    for r in range(4):
        for b in range(2):
            block = x[r, 32 * b : 32 * b + 32].to(torch.float64)
            exponent = math.ceil(math.log2(float(block.abs().max()) / 448.0))
            assert int(scales[r, b]) == exponent + 127
            want = (block / 2**exponent).to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64) * 2**exponent
            assert torch.equal(mx.dequantize_mxfp8(q, scales, torch.float64)[r, 32 * b : 32 * b + 32], want)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("zero_point", [False, True])
def test_group_weights_round_trip_within_half_a_step(bits, group, zero_point):
    gen = torch.Generator().manual_seed(bits * 1000 + group + zero_point)
    w = torch.randn(3, 8, 256, generator=gen) + (0.7 if zero_point else 0.0)
    codes, scales, zeros = intq.quantize_weight(w, bits, group, zero_point=zero_point, scale_dtype=torch.float16)
    g = 256 if group == -1 else group
    assert codes.dtype == torch.uint8 and codes.shape == (3, 8, 256 * bits // 8)
    assert scales.dtype == torch.float16 and scales.shape == (3, 8, 256 // g)
    assert (zeros is not None) == zero_point
    back = intq.dequantize_weight(codes, scales, zeros, bits, torch.float64)
    step = scales.to(torch.float64).repeat_interleave(g, dim=-1)
    # half a step, plus the fp16 rounding of the scale times the largest code
    assert bool(((back - w.to(torch.float64)).abs() <= 0.5 * step + 2**-10 * step * 2**bits).all())
    values = intq.unpack_nibbles(codes) if bits == 4 else codes
    assert int(values.max()) <= 2**bits - 1


def test_int4_codes_follow_gptq_layout():
    w = torch.tensor([[[-6.2, 7.5, 0.4, 1.0] + [0.0] * 28]])  # amax 7.5: scale 2 * 7.5 / 15 = 1
    codes, scales, zeros = intq.quantize_weight(w, 4, 32, zero_point=False, scale_dtype=torch.float32)
    assert zeros is None and float(scales[0, 0, 0]) == 1.0
    nibbles = intq.unpack_nibbles(codes)[0, 0, :4].tolist()
    assert nibbles == [2, 15, 8, 9]  # round(w / s) + 8 (7.5 rounds to even 8, then clamps to 15)
    assert codes[0, 0, 0].item() == 2 | (15 << 4)  # element 0 in the low nibble


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int8_activations_follow_scaled_int8_quant(per_token, symmetric):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 64, generator=gen) * 3 + (0.0 if symmetric else 2.0)
    q, scale = intq.quantize_int8_activation(x, per_token=per_token, symmetric=symmetric)
    assert q.dtype == torch.int8 and scale.shape == ((5, 1 if symmetric else 2) if per_token else (1 if symmetric else 2,))
    xd = x.to(torch.float64)
    lo = xd.amin(dim=-1, keepdim=True) if per_token else xd.min()
    hi = xd.amax(dim=-1, keepdim=True) if per_token else xd.max()
    if symmetric:
        s = torch.maximum(hi.abs(), lo.abs()) / 127
        want = torch.round(xd / s).clamp(-128, 127) * s
    else:
        s = (hi - lo) / 255
        azp = torch.round(-128 - lo / s)
        want = ((torch.round(xd / s) + azp).clamp(-128, 127) - azp) * s
    got = intq.dequantize_int8_activation(q, scale, symmetric, torch.float64)
    assert float((got - want).abs().max()) <= 1e-5 * float(xd.abs().max())


SCHEMES = [
    QuantScheme.mxfp4(), QuantScheme.mxfp8(), QuantScheme.int8(), QuantScheme.int8("tensor", "tensor"),
    QuantScheme.int_wna16(), QuantScheme.int_wna16(4, 32, True, "compressed-tensors"), QuantScheme.int_wna16(8, -1),
    QuantScheme.int_wna16(8, 64, True, "compressed-tensors"), QuantScheme.w4a8(), QuantScheme.w4a8_int8(64),
    QuantScheme.w4a8_int8(-1),
]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.describe())
def test_weight_table_quantizes_and_validates(scheme):
    layer = MoELayer(quant=scheme, num_experts=3, hidden_size=256, intermediate_size=128)
    gen = torch.Generator().manual_seed(3)
    w1 = torch.randn(3, 256, 256, generator=gen) / 16
    w2 = torch.randn(3, 256, 128, generator=gen) / 11
    w1q, w2q, scales = quantize_weights(w1, w2, scheme)
    check_weight_scales(scales, layer, 3)
    d1, d2 = dequantize_weights(w1q, w2q, scales, scheme, torch.float64)
    # every format keeps the weights within its resolution (e2m1 is the coarsest: ~1/4 relative RMS)
    for dense, w in ((d1, w1), (d2, w2)):
        rel = float((dense - w.double()).norm() / w.double().norm())
        assert rel < (0.2 if scheme.family.value == "mxfp4" else 0.12), rel


@pytest.mark.parametrize("bits,group,zero_point", [(4, 32, False), (4, 128, True), (8, 64, False)])
def test_activation_ordered_weights_gather_each_columns_group(bits, group, zero_point):
    """GPTQ desc_act: columns quantized in descending squared-norm order; g_idx names each column's group."""
    gen = torch.Generator().manual_seed(bits * 100 + group)
    w = torch.randn(2, 8, 256, generator=gen) * torch.rand(256, generator=gen) + (0.4 if zero_point else 0.0)
    codes, scales, zeros, g_idx = intq.act_order_quantize_weight(w, bits, group, zero_point=zero_point,
                                                                 scale_dtype=torch.float16)
    assert g_idx.dtype == torch.int32 and g_idx.shape == (2, 256)
    assert all(torch.bincount(g_idx[e].long()).tolist() == [group] * (256 // group) for e in range(2))
    order = intq.act_order_permutation(w)
    norms = w.double().pow(2).sum(dim=-2)
    assert bool((torch.gather(norms, -1, order).diff(dim=-1) <= 0).all())  # largest first
    # the same codes as quantizing the visited order in plain groups, put back in column order
    plain, plain_scales, plain_zeros = intq.quantize_weight(torch.gather(w, -1, order.unsqueeze(1).expand(w.shape)),
                                                            bits, group, zero_point=zero_point, scale_dtype=torch.float16)
    assert torch.equal(scales, plain_scales) and (zeros is None or torch.equal(zeros, plain_zeros))
    back = intq.dequantize_weight(codes, scales, zeros, bits, torch.float64, g_idx)
    plain_back = intq.dequantize_weight(plain, plain_scales, plain_zeros, bits, torch.float64)
    assert torch.equal(torch.gather(back, -1, order.unsqueeze(1).expand(w.shape)), plain_back)


def test_activation_ordered_schemes_quantize_validate_and_dequantize():
    scheme = QuantScheme.int_wna16(4, 32, act_order=True)
    layer = MoELayer(quant=scheme, num_experts=3, hidden_size=256, intermediate_size=128)
    gen = torch.Generator().manual_seed(5)
    w1, w2 = torch.randn(3, 256, 256, generator=gen) / 16, torch.randn(3, 256, 128, generator=gen) / 11
    w1q, w2q, scales = quantize_weights(w1, w2, scheme)
    assert scales.w1_g_idx.shape == (3, 256) and scales.w2_g_idx.shape == (3, 128)
    check_weight_scales(scales, layer, 3)
    d1, d2 = dequantize_weights(w1q, w2q, scales, scheme, torch.float64)
    for dense, w in ((d1, w1), (d2, w2)):
        assert float((dense - w.double()).norm() / w.double().norm()) < 0.12
    from moe_fsm.errors import KernelInputError

    with pytest.raises(KernelInputError, match="w2_g_idx is missing"):
        check_weight_scales(ExpertScales(**{**vars(scales), "w2_g_idx": None}), layer, 3)
