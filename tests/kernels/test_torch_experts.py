"""TorchExperts / TorchBatchedExperts through the modular kernel, against float64.

Tolerances (all relative; Frobenius = ||out - ref|| / ||ref||):

* unquantized, vs moe_reference: float32 1e-5 (GEMM accumulation order);
  bfloat16 2e-2 and float16 4e-3 (the intermediate and the per-slot results are
  stored in the layer dtype, as the GPU kernels do: a few roundings of 2^-9 / 2^-12).
* quantized, vs moe_reference on the SAME dequantized weights (so only the
  activation quantization differs): FP8 0.1 (e4m3 keeps 3 mantissa bits: each of
  the two activation quantizations is off by up to 2^-4, about 3.6% RMS), NVFP4
  0.3 (e2m1 steps are up to 1/3 of the value), NVFP4 weight-only like float32.
* quantized, vs the float64 emulation of the exact quantization (torch_moe_cases):
  Frobenius 5e-3 and median element 1e-5 of the output's max for float32 layers;
  the Frobenius bound sits an order of magnitude under the quantization error
  itself and leaves room for the odd value that float32 vs float64 rounding puts
  across an e4m3 rounding boundary. bfloat16 layers add the bf16 output roundings
  (Frobenius 1e-2, median 2e-3).
"""

from __future__ import annotations

import pytest
import torch
from torch_moe_cases import ALL_FP8, NVFP4_WEIGHT_ONLY, emulate, make_case, rel_fro, rel_median, seed_for, single_thread  # noqa: F401

from moe_fsm.experts.torch_experts import TorchBatchedExperts, TorchExperts
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import QuantFamily, QuantScheme
from moe_fsm.kernels.reference import moe_reference
from moe_fsm.modular.interfaces import ExpertScales
from moe_fsm.modular.kernel import ModularKernel
from moe_fsm.prepare_finalize.local import LocalBatchedPrepareFinalize, LocalPrepareFinalize

FORMATS = {
    "standard": (LocalPrepareFinalize, TorchExperts),
    "batched": (LocalBatchedPrepareFinalize, TorchBatchedExperts),
}
UNQUANTIZED_TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 4e-3}
REFERENCE_TOL = {QuantFamily.FP8: 0.1, QuantFamily.NVFP4: 0.3}
EMULATION_TOL = {"float32": (5e-3, 1e-5), "bfloat16": (1e-2, 2e-3)}

# Small shapes that still cross the interesting boundaries: K and N are not
# multiples of 128 (partial FP8 blocks and groups), both are multiples of 16 (NVFP4).
SHAPE = dict(num_experts=6, top_k=2, hidden_size=160, intermediate_size=96)
TOKENS = 24


def kernel_for(layer: MoELayer, fmt: str) -> ModularKernel:
    pf_cls, experts_cls = FORMATS[fmt]
    return ModularKernel(pf_cls(), experts_cls(layer), layer)


def run(layer: MoELayer, fmt: str, case) -> torch.Tensor:
    out = kernel_for(layer, fmt)(case.hidden, case.w1, case.w2, case.topk_weights, case.topk_ids, scales=case.scales)
    assert out.shape == case.hidden.shape and out.dtype == case.hidden.dtype
    assert torch.isfinite(out).all(), "NaN or inf in the output"
    return out


def reference(case) -> torch.Tensor:
    layer = case.layer
    return moe_reference(
        case.hidden, case.w1_float, case.w2_float, case.topk_weights, case.topk_ids,
        activation=layer.activation.value, swiglu_limit=layer.swiglu_limit,
        apply_router_weight_on_input=layer.router_weight_on_input,
    )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("activation,limit", [("silu", None), ("gelu", None), ("swigluoai", 7.0), ("silu", 0.5)])
def test_unquantized_matches_reference(fmt: str, dtype: str, activation: str, limit) -> None:
    layer = MoELayer(dtype=dtype, activation=activation, swiglu_limit=limit, **SHAPE)
    case = make_case(layer, TOKENS, seed_for(fmt, dtype, activation, limit))
    assert rel_fro(run(layer, fmt, case), reference(case)) <= UNQUANTIZED_TOL[dtype]


def _check_quantized(layer: MoELayer, fmt: str, case) -> None:
    out = run(layer, fmt, case)
    fro_tol, median_tol = EMULATION_TOL[layer.dtype]
    expected = emulate(case)
    assert rel_fro(out, expected) <= fro_tol
    assert rel_median(out, expected) <= median_tol
    bound = 1e-5 if layer.quant.activation is None else REFERENCE_TOL[layer.quant.family]
    assert rel_fro(out, reference(case)) <= bound


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", ALL_FP8, ids=lambda s: s.describe())
def test_fp8_schemes(fmt: str, scheme: QuantScheme) -> None:
    layer = MoELayer(quant=scheme, dtype="float32", **SHAPE)
    _check_quantized(layer, fmt, make_case(layer, TOKENS, seed_for(fmt, scheme)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", [QuantScheme.nvfp4(), NVFP4_WEIGHT_ONLY], ids=["w4a4", "w4a16"])
def test_nvfp4_schemes(fmt: str, scheme: QuantScheme) -> None:
    layer = MoELayer(quant=scheme, dtype="float32", **SHAPE)
    _check_quantized(layer, fmt, make_case(layer, TOKENS, seed_for(fmt, scheme)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "scheme", [QuantScheme.fp8("block", "group"), QuantScheme.fp8("tensor", "tensor", True), QuantScheme.nvfp4()],
    ids=lambda s: s.describe(),
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_quantized_half_precision_layers(fmt: str, scheme: QuantScheme, dtype: str) -> None:
    layer = MoELayer(quant=scheme, dtype=dtype, **SHAPE)
    case = make_case(layer, TOKENS, seed_for(fmt, scheme, dtype))
    out = run(layer, fmt, case)
    assert rel_fro(out, emulate(case)) <= EMULATION_TOL["bfloat16"][0]
    assert rel_fro(out, reference(case)) <= REFERENCE_TOL[scheme.family]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", [QuantScheme.fp8("block", "group"), QuantScheme.fp8("channel", "token", True), QuantScheme.nvfp4()],
                         ids=lambda s: s.describe())
@pytest.mark.parametrize("activation,limit", [("swigluoai", 7.0), ("gelu", None), ("silu", 1.0)])
def test_quantized_activations(fmt: str, scheme: QuantScheme, activation: str, limit) -> None:
    layer = MoELayer(quant=scheme, dtype="float32", activation=activation, swiglu_limit=limit, **SHAPE)
    _check_quantized(layer, fmt, make_case(layer, TOKENS, seed_for(fmt, scheme, activation, limit)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "scheme,dtype",
    [(QuantScheme.unquantized(), "float32"), (QuantScheme.unquantized(), "bfloat16"),
     (QuantScheme.fp8("tensor", "tensor", True), "float32"), (QuantScheme.fp8("block", "group"), "float32"),
     (QuantScheme.nvfp4(), "float32")],
    ids=lambda v: v.describe() if isinstance(v, QuantScheme) else v,
)
def test_router_weight_on_input(fmt: str, scheme: QuantScheme, dtype: str) -> None:
    """Top-1 with the weight applied to the input: it passes through the activation, unlike output weighting."""
    layer = MoELayer(quant=scheme, dtype=dtype, router_weight_on_input=True, **{**SHAPE, "top_k": 1})
    case = make_case(layer, TOKENS, seed_for(fmt, scheme, dtype, "on-input"))
    out = run(layer, fmt, case)
    ref = reference(case)
    if scheme.family is QuantFamily.UNQUANTIZED:
        assert rel_fro(out, ref) <= UNQUANTIZED_TOL[dtype]
    else:
        assert rel_fro(out, emulate(case)) <= EMULATION_TOL[dtype][0]
        assert rel_fro(out, ref) <= REFERENCE_TOL[scheme.family]
    weighted_output = moe_reference(case.hidden, case.w1_float, case.w2_float, case.topk_weights, case.topk_ids)
    assert rel_fro(out, weighted_output) > 10 * UNQUANTIZED_TOL[dtype], "router weight was applied on the output"


@pytest.mark.parametrize("fmt", FORMATS)
def test_static_per_token_input_scales(fmt: str) -> None:
    """A static per-token a1_scale holds one scale per row."""
    layer = MoELayer(quant=QuantScheme.fp8("channel", "token", True), dtype="float32", **SHAPE)
    case = make_case(layer, TOKENS, seed_for(fmt, "static-token-rows"))
    row_scales = (case.hidden.abs().amax(dim=1) / 448).to(torch.float32)
    case.scales = ExpertScales(**{**vars(case.scales), "a1_scale": row_scales})
    _check_quantized(layer, fmt, case)


def test_formats_agree_bitwise_for_unquantized() -> None:
    """Both layouts run the same per-expert GEMMs on the same rows; only the reduction order differs."""
    layer = MoELayer(dtype="float32", **SHAPE)
    case = make_case(layer, TOKENS, seed_for("formats-agree"))
    standard, batched = run(layer, "standard", case), run(layer, "batched", case)
    torch.testing.assert_close(standard, batched, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("experts_cls", [TorchExperts, TorchBatchedExperts])
@pytest.mark.parametrize("scheme", [QuantScheme.unquantized(), QuantScheme.fp8("block", "group"), QuantScheme.nvfp4()],
                         ids=lambda s: s.describe())
def test_workspace_estimate_grows_with_tokens(experts_cls, scheme: QuantScheme) -> None:
    experts = experts_cls(MoELayer(quant=scheme, **SHAPE))
    small, large = experts.workspace_bytes(1), experts.workspace_bytes(1024)
    assert 0 < small < large
    k, n, top_k = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["top_k"]
    assert large >= 1024 * top_k * (k + n) * 2, "must cover at least the intermediate and per-slot output"


def test_dequantized_weights_are_kept_and_redone_when_the_weights_change_in_place():
    from moe_fsm.experts.torch_experts import ExpertMath
    from moe_fsm.inputs.layer import MoELayer
    from moe_fsm.inputs.quant import QuantScheme
    from moe_fsm.kernels import fp8
    from moe_fsm.modular.interfaces import ExpertScales

    layer = MoELayer(quant=QuantScheme.fp8("tensor", "tensor"), num_experts=4, top_k=2, hidden_size=32,
                     intermediate_size=16)
    math = ExpertMath(layer)
    w1q, s1 = fp8.quantize_weight_per_tensor(torch.randn(4, 32, 32))
    scales = ExpertScales(w1_scale=s1)
    first = math._weights_t(w1q, scales, "w1")(2)
    assert math._weights_t(w1q, scales, "w1")(2) is first
    torch.testing.assert_close(first, fp8.dequantize_weight_per_tensor(w1q, s1)[2].T)
    s1.mul_(2.0)  # a checkpoint reload in place: the kept copy must not be served
    again = math._weights_t(w1q, scales, "w1")(2)
    torch.testing.assert_close(again, 2.0 * first)
    over_budget = ExpertMath(layer)
    over_budget.DEQUANTIZED_BUDGET_BYTES = 0  # past the budget: dequantized per call, nothing kept
    assert over_budget._weights_t(w1q, scales, "w1")(1) is not over_budget._weights_t(w1q, scales, "w1")(1)
