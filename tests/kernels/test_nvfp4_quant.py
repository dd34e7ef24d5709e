"""NVFP4: e2m1 rounding and packing, block and global scales, against known values and the vLLM formulas."""

from __future__ import annotations

import pytest
import torch
from torch_moe_cases import nvfp4_qdq, seed_for, single_thread  # noqa: F401

from moe_fsm.kernels import nvfp4

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def rand(*shape: int, seed: object) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed_for(seed)))


@pytest.mark.parametrize(
    "value,expected",
    [
        (0.25, 0.0), (0.2501, 0.5), (0.75, 1.0), (0.7499, 0.5), (1.25, 1.0), (1.2501, 1.5), (1.75, 2.0),
        (2.5, 2.0), (2.5001, 3.0), (3.5, 4.0), (3.4999, 3.0), (5.0, 4.0), (5.0001, 6.0), (6.0, 6.0), (9.0, 6.0),
        (-0.75, -1.0), (-2.5, -2.0), (-5.5, -6.0), (0.1, 0.0),
    ],
)
def test_round_to_e2m1_ties_to_even(value: float, expected: float) -> None:
    assert nvfp4.round_to_e2m1(torch.tensor([value])).item() == expected


def test_every_nibble_decodes_to_its_value() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    expected = MAGNITUDES + [-m for m in MAGNITUDES]
    assert nvfp4.e2m1_values(codes).tolist() == expected


def test_pack_puts_even_elements_in_the_low_nibble() -> None:
    codes = nvfp4.e2m1_codes(torch.tensor([1.0, 6.0, -0.5, 3.0]))
    assert codes.tolist() == [0x2, 0x7, 0x9, 0x5]
    packed = nvfp4.pack(codes)
    assert packed.tolist() == [0x72, 0x59]
    assert torch.equal(nvfp4.unpack(packed), codes)


def test_pack_unpack_roundtrip_is_exact() -> None:
    codes = torch.randint(0, 16, (3, 5, 32), generator=torch.Generator().manual_seed(seed_for("codes")), dtype=torch.uint8)
    packed = nvfp4.pack(codes)
    assert packed.shape == (3, 5, 16) and packed.dtype == torch.uint8
    assert torch.equal(nvfp4.unpack(packed), codes)


def test_quantize_known_block() -> None:
    """amax 6 with global 1: the block scale is exactly 1 and every grid value survives."""
    x = torch.tensor([[6.0, -4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -6.0, 4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0]])
    packed, scale = nvfp4.quantize(x, torch.tensor(1.0))
    assert packed.shape == (1, 8) and scale.shape == (1, 1) and scale.dtype == torch.float8_e4m3fn
    assert scale.float().item() == 1.0
    assert torch.equal(nvfp4.dequantize_activation(packed, scale, torch.tensor(1.0)), x)


def test_zero_block_quantizes_to_zero() -> None:
    packed, scale = nvfp4.quantize(torch.zeros(2, 32), torch.tensor(100.0))
    assert scale.float().abs().max() == 0
    assert nvfp4.dequantize_activation(packed, scale, torch.tensor(100.0)).abs().max() == 0


def test_block_scale_saturates_at_448() -> None:
    packed, scale = nvfp4.quantize(torch.full((1, 16), 1000.0), torch.tensor(10.0))
    assert scale.float().item() == 448.0


def test_fake_quantize_matches_the_reference_formulas() -> None:
    """Same values as the float32 restatement of vLLM's ref_nvfp4_quant_dequant in the test helpers."""
    x = rand(64, 160, seed="qdq") * 3
    g = nvfp4.activation_global_scale(x.abs().max())
    torch.testing.assert_close(nvfp4.fake_quantize(x, g).double(), nvfp4_qdq(x, g), rtol=1e-6, atol=0)


def test_weight_roundtrip_and_global_scale() -> None:
    w = rand(4, 32, 64, seed="w")
    w[1] *= 50
    packed, scale, weight_global = nvfp4.quantize_weight(w)
    assert packed.shape == (4, 32, 32) and scale.shape == (4, 32, 4) and weight_global.shape == (4,)
    torch.testing.assert_close(weight_global, w.abs().amax(dim=(1, 2)) / (448 * 6))
    out = nvfp4.dequantize_weight(packed, scale, weight_global)
    block_amax = w.reshape(4, 32, 4, 16).abs().amax(-1, keepdim=True).expand(4, 32, 4, 16).reshape(w.shape)
    # The worst e2m1 step is 2 (between 4 and 6) of a block scaled to 6, plus e4m3 rounding of the scale.
    assert ((out - w).abs() <= block_amax * (1 / 6) * 1.07).all()
    assert ((out - w).norm() / w.norm()) < 0.12


def test_weight_dequantize_multiplies_block_and_global() -> None:
    codes = nvfp4.e2m1_codes(torch.tensor([[1.0] * 16 + [-6.0] * 16]))
    scale = torch.tensor([[2.0, 0.5]]).to(torch.float8_e4m3fn)
    out = nvfp4.dequantize_weight(nvfp4.pack(codes).unsqueeze(0), scale.unsqueeze(0), torch.tensor([0.25]))
    assert out[0, 0, :16].tolist() == [0.5] * 16 and out[0, 0, 16:].tolist() == [-0.75] * 16
