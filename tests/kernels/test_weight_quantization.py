"""quantize_weights / dequantize_weights / calibration for every weight key."""

from __future__ import annotations

import pytest
import torch
from torch_moe_cases import ALL_FP8, NVFP4_WEIGHT_ONLY, seed_for, single_thread  # noqa: F401

from moe_fsm.errors import KernelInputError
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.kernels import fp8
from moe_fsm.quantize.weights import (
    WEIGHT_FORMATS,
    calibrate_activation_scales,
    dequantize_weights,
    quantize_experts,
    quantize_weights,
)

E, K, N = 3, 160, 96


def experts(seed: object) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed_for(seed))
    return torch.randn(E, 2 * N, K, generator=gen), torch.randn(E, K, N, generator=gen)


@pytest.mark.parametrize("scheme", ALL_FP8[::5] + [QuantScheme.nvfp4()], ids=lambda s: str(s.weight))
def test_layouts_follow_the_table(scheme: QuantScheme) -> None:
    w1, w2 = experts(scheme)
    w1q, w2q, scales = quantize_weights(w1, w2, scheme)
    fmt = WEIGHT_FORMATS[scheme.weight]
    assert w1q.dtype == fmt.storage_dtype and w1q.shape == (E, *fmt.stored_shape(2 * N, K))
    assert w2q.shape == (E, *fmt.stored_shape(K, N))
    assert scales.w1_scale.shape == (E, *fmt.scale_shape(2 * N, K)) and scales.w1_scale.dtype == fmt.scale_dtype
    assert scales.w2_scale.shape == (E, *fmt.scale_shape(K, N))
    assert (scales.w1_global_scale is not None) == fmt.has_global_scale
    d1, d2 = dequantize_weights(w1q, w2q, scales, scheme)
    bound = 0.12 if fmt.packing > 1 else 0.04
    assert (d1 - w1).norm() / w1.norm() < bound and (d2 - w2).norm() / w2.norm() < bound


def test_unquantized_passes_through() -> None:
    w1, w2 = experts("plain")
    w1q, w2q, scales = quantize_weights(w1, w2, QuantScheme.unquantized())
    assert w1q is w1 and w2q is w2 and scales.w1_scale is None
    d1, _ = dequantize_weights(w1q, w2q, scales, QuantScheme.unquantized(), torch.float64)
    assert d1.dtype == torch.float64 and torch.equal(d1, w1.double())


def test_static_fp8_calibration_is_amax_over_448() -> None:
    layer = MoELayer(quant=QuantScheme.fp8("tensor", "tensor", True), num_experts=E, top_k=2, hidden_size=K, intermediate_size=N)
    w1, w2 = experts("calibrate")
    sample = torch.randn(8, K, generator=torch.Generator().manual_seed(seed_for("sample")))
    w1q, w2q, scales = quantize_experts(w1, w2, layer, sample)
    assert scales.a1_scale.shape == (1,) and scales.a1_scale.item() == pytest.approx(sample.abs().max().item() / 448)
    d1, _ = dequantize_weights(w1q, w2q, scales, layer.quant)
    h = torch.einsum("mk,enk->emn", sample, d1)
    inter = torch.nn.functional.silu(h[..., :N]) * h[..., N:]
    assert scales.a2_scale.item() == pytest.approx(inter.abs().max().item() / 448, rel=1e-5)


def test_nvfp4_calibration_gives_quantization_multipliers() -> None:
    layer = MoELayer(quant=QuantScheme.nvfp4(), num_experts=E, top_k=2, hidden_size=K, intermediate_size=N)
    w1, w2 = experts("nvfp4-cal")
    sample = torch.randn(8, K, generator=torch.Generator().manual_seed(seed_for("nv-sample")))
    _, _, scales = quantize_experts(w1, w2, layer, sample)
    assert scales.a1_global_scale.item() == pytest.approx(448 * 6 / sample.abs().max().item())
    assert scales.a2_global_scale.item() > 0 and scales.a1_scale is None


@pytest.mark.parametrize("scheme", [QuantScheme.fp8("block", "group"), QuantScheme.fp8("channel", "token"), NVFP4_WEIGHT_ONLY],
                         ids=lambda s: s.describe())
def test_dynamic_schemes_need_no_sample(scheme: QuantScheme) -> None:
    layer = MoELayer(quant=scheme, num_experts=E, top_k=2, hidden_size=K, intermediate_size=N)
    w1, w2 = experts(scheme)
    _, _, scales = quantize_experts(w1, w2, layer)
    assert scales.a1_scale is None and scales.a2_scale is None and scales.a1_global_scale is None
    assert calibrate_activation_scales(*quantize_weights(w1, w2, scheme), layer, torch.ones(1, K)) is not None


def test_static_scheme_without_sample_is_refused() -> None:
    layer = MoELayer(quant=QuantScheme.fp8("tensor", "token", True), num_experts=E, top_k=2, hidden_size=K, intermediate_size=N)
    with pytest.raises(KernelInputError, match=r"reads static scales \['a1_scale', 'a2_scale'\]; pass a sample batch"):
        quantize_experts(*experts("nosample"), layer)


def test_bad_float_experts_are_refused() -> None:
    w1, w2 = experts("bad")
    with pytest.raises(KernelInputError, match=r"w1 \[E, 2N, K\] and w2 \[E, K, N\]; got w1 \[3, 192, 160\], w2 \[3, 160, 95\]"):
        quantize_weights(w1, w2[..., :95], QuantScheme.fp8())
    with pytest.raises(KernelInputError, match="needs w2's last dim divisible by 16; got \\[3, 160, 40\\]"):
        quantize_weights(w1[:, :80], w2[..., :40], QuantScheme.nvfp4())
    with pytest.raises(KernelInputError, match="must be floating point"):
        quantize_weights(w1.to(torch.int32), w2, QuantScheme.fp8())


def test_per_tensor_weight_scale_is_per_expert() -> None:
    w1, w2 = experts("per-expert")
    w1[2] *= 100
    _, _, scales = quantize_weights(w1, w2, QuantScheme.fp8("tensor", "tensor"))
    torch.testing.assert_close(scales.w1_scale, fp8.dynamic_scale(w1.abs().amax(dim=(1, 2))))
