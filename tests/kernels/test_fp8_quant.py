"""FP8 e4m3fn quantizers: known values, scale layouts, round-trip bounds, edge shapes."""

from __future__ import annotations

import pytest
import torch
from torch_moe_cases import seed_for, single_thread  # noqa: F401

from moe_fsm.kernels import fp8


def rand(*shape: int, seed: object) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed_for(seed)))


def roundtrip_bound(x: torch.Tensor, scale_per_element: torch.Tensor) -> torch.Tensor:
    """Half an e4m3 step: 2^-4 of the value for normals, 2^-10 of the scale in the subnormal range."""
    return torch.maximum(x.abs() * 2.0**-4, scale_per_element * 2.0**-10) * (1 + 1e-6)


def test_cast_saturates_and_rounds_half_to_even() -> None:
    x = torch.tensor([500.0, -1000.0, 448.0, 1.0625, 1.1875, 0.0, -0.0])
    assert fp8.cast_to_fp8(x).float().tolist() == [448.0, -448.0, 448.0, 1.0, 1.25, 0.0, 0.0]


def test_dynamic_per_tensor_maps_amax_to_448() -> None:
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    q, scale = fp8.quantize_per_tensor(x)
    assert scale.shape == (1,) and scale.item() == pytest.approx(4.0 / 448)
    assert q.float().abs().max().item() == 448.0
    torch.testing.assert_close(fp8.dequantize_activation(q, scale), x, rtol=2**-4, atol=0)


def test_static_per_tensor_uses_given_scale_and_saturates() -> None:
    x = torch.tensor([[1.0, 100.0]])
    q, scale = fp8.quantize_per_tensor(x, torch.tensor(0.1))
    assert scale.tolist() == [pytest.approx(0.1)]
    assert q.float().tolist() == [[10.0, 448.0]]


def test_per_token_scales_each_row() -> None:
    x = rand(5, 40, seed="token")
    x[2] = 0.0
    q, scale = fp8.quantize_per_token(x)
    assert scale.shape == (5, 1)
    torch.testing.assert_close(scale.squeeze(1), x.abs().amax(1).clamp(min=1e-10) / 448)
    assert q[2].float().abs().max() == 0 and torch.isfinite(scale).all()
    out = fp8.dequantize_activation(q, scale)
    assert ((out - x).abs() <= roundtrip_bound(x, scale.expand_as(x))).all()


@pytest.mark.parametrize("static", [torch.tensor([0.02]), torch.tensor(0.02), torch.full((5,), 0.02)])
def test_static_per_token_scales_become_rows(static: torch.Tensor) -> None:
    q, scale = fp8.quantize_per_token(rand(5, 8, seed="static-token"), static)
    assert scale.shape == (5, 1) and torch.allclose(scale, torch.full((5, 1), 0.02))


@pytest.mark.parametrize("k", [128, 300, 64])
def test_per_group_matches_a_loop_over_groups(k: int) -> None:
    x = rand(6, k, seed=("group", k))
    q, scale = fp8.quantize_per_group(x)
    groups = -(-k // 128)
    assert scale.shape == (6, groups)
    for g in range(groups):
        chunk = x[:, g * 128 : (g + 1) * 128]
        expected_scale = chunk.abs().amax(1).clamp(min=1e-10) / 448
        torch.testing.assert_close(scale[:, g], expected_scale)
        expected_q = (chunk / expected_scale[:, None]).clamp(-448, 448).to(fp8.FP8_DTYPE)
        assert torch.equal(q[:, g * 128 : (g + 1) * 128].float(), expected_q.float())
    out = fp8.dequantize_activation(q, scale)
    assert ((out - x).abs() <= roundtrip_bound(x, fp8.expand_groups(scale, k, 128, -1))).all()


def test_empty_activation_quantizes_without_error() -> None:
    for quantize in (fp8.quantize_per_tensor, fp8.quantize_per_token, fp8.quantize_per_group):
        q, scale = quantize(torch.empty(0, 256))
        assert q.shape == (0, 256) and torch.isfinite(scale).all()


@pytest.mark.parametrize("rows,cols", [(256, 128), (200, 300), (96, 160)])
def test_weight_scales_layouts_and_roundtrip(rows: int, cols: int) -> None:
    w = rand(3, rows, cols, seed=("weights", rows, cols))
    cases = {
        "tensor": (fp8.quantize_weight_per_tensor, fp8.dequantize_weight_per_tensor, (3,)),
        "channel": (fp8.quantize_weight_per_channel, fp8.dequantize_weight_per_channel, (3, rows)),
        "block": (fp8.quantize_weight_block, fp8.dequantize_weight_block, (3, -(-rows // 128), -(-cols // 128))),
    }
    for name, (quantize, dequantize, scale_shape) in cases.items():
        q, scale = quantize(w)
        assert q.dtype == fp8.FP8_DTYPE and q.shape == w.shape, name
        assert scale.dtype == torch.float32 and tuple(scale.shape) == scale_shape, name
        per_element = dequantize(torch.ones_like(q, dtype=torch.float32).to(fp8.FP8_DTYPE), scale)
        assert ((dequantize(q, scale) - w).abs() <= roundtrip_bound(w, per_element)).all(), name


def test_block_scales_cover_partial_edge_tiles() -> None:
    w = rand(1, 200, 300, seed="blocks")
    w[0, 150:, 260:] *= 10
    _, scale = fp8.quantize_weight_block(w)
    for rb in range(2):
        for cb in range(3):
            tile = w[0, rb * 128 : (rb + 1) * 128, cb * 128 : (cb + 1) * 128]
            assert scale[0, rb, cb].item() == pytest.approx(tile.abs().max().item() / 448, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(256, 384), (200, 300)])
def test_block_scales_of_whole_tiles_broadcast_to_the_same_bits_as_per_element_scales(rows, cols, dtype) -> None:
    """The whole-tile path (issue 39: the per-element copy of the scales took seconds per DeepSeek-V3 layer)."""
    w = (rand(3, rows, cols, seed=("tiles", rows, cols)) * 7).to(dtype)
    q, scale = fp8.quantize_weight_block(w)
    per_element = fp8.expand_block_scale(scale, rows, cols)
    assert torch.equal(q.view(torch.uint8), fp8._divide_and_cast(w, per_element).view(torch.uint8))
    assert torch.equal(fp8.dequantize_weight_block(q, scale), q.to(torch.float32) * per_element)


def test_weight_quantization_of_fp8_values_is_exact() -> None:
    """Values already on the e4m3 grid times a power of two come back unchanged."""
    grid = torch.tensor([448.0, -448.0, 1.0, -0.5, 0.875, 2.0**-9, 0.0, 3.5])
    w = (grid.repeat(16) * 2.0**-5).reshape(1, 8, 16)
    q, scale = fp8.quantize_weight_per_tensor(w)
    assert torch.equal(fp8.dequantize_weight_per_tensor(q, scale), w)


def test_dynamic_scales_are_correctly_rounded_quotients() -> None:
    """amax / 448 rounded once (a true division, as on CUDA since issue 24: not amax * fl(1/448))."""
    amax = torch.rand(100_000, generator=torch.Generator().manual_seed(seed_for("amax"))) * 100
    assert torch.equal(fp8.dynamic_scale(amax), (amax.double() / 448).float())  # float64 then float32: rounded once
    # 7 * 2^k / 448 = 2^(k-6) exactly; the reciprocal product is off by an ulp for many such amax values
    sevens = torch.tensor([7.0 * 2.0**k for k in range(-20, 20)])
    assert torch.equal(fp8.dynamic_scale(sevens), torch.tensor([2.0 ** (k - 6) for k in range(-20, 20)]))


def test_bf16_rows_on_an_e4m3_midpoint_round_to_even() -> None:
    """x * 448 / amax lands exactly halfway between two e4m3 values for bf16 data: the tie must go to even."""
    x = torch.tensor([[7.0, 1.0625 / 64, 1.1875 / 64, -3.125 / 64]], dtype=torch.bfloat16)  # amax 7: scale 2^-6
    q, scale = fp8.quantize_per_token(x)
    assert scale.item() == 2.0**-6
    assert q.float().tolist() == [[448.0, 1.0, 1.25, -3.0]]  # 1.0625 -> 1.0, 1.1875 -> 1.25, -3.125 -> -3.0
