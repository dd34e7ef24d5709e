"""TorchExperts / TorchBatchedExperts on the MX, INT8 and INT4 families, against float64.

Every output buffer the experts allocate is poisoned (NaN) first, so an element
nobody writes fails. Tolerances (relative Frobenius ||out - ref|| / ||ref||):

* weight-only schemes (MXFP4 W4A16, INT4/INT8 WNA16) vs moe_reference on the SAME
  dequantized weights: float32 1e-5 (summation order only), bfloat16 2e-2 (bf16
  intermediate and outputs, as the unquantized case);
* schemes that quantize activations, vs an independent float64 restatement of
  that quantization (written here from vLLM's code): float32 5e-3, bfloat16 1.5e-2
  (float32-vs-float64 rounding puts the odd value across a rounding boundary);
* and vs moe_reference with unquantized activations, the format's own error:
  INT8 per token 4e-2, per tensor 6e-2 (7 bits), MXFP8 / FP8 1e-1 (3 mantissa bits),
  MXFP4 activations 3e-1 (e2m1).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch_moe_cases import fp8_qdq, make_case, rel_fro, seed_for, single_thread  # noqa: F401

from moe_fsm.experts.torch_experts import TorchBatchedExperts, TorchExperts
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import Granularity, QuantFamily, QuantScheme
from moe_fsm.kernels.activations import apply_activation
from moe_fsm.kernels.reference import moe_reference
from moe_fsm.modular.kernel import ModularKernel
from moe_fsm.prepare_finalize.local import LocalBatchedPrepareFinalize, LocalPrepareFinalize

FORMATS = {"standard": (LocalPrepareFinalize, TorchExperts), "batched": (LocalBatchedPrepareFinalize, TorchBatchedExperts)}
SHAPE = dict(num_experts=6, top_k=2, hidden_size=256, intermediate_size=128)
TOKENS = 20

WEIGHT_ONLY = {
    "mxfp4 gpt-oss": QuantScheme.mxfp4(),
    "gptq int4 g128": QuantScheme.int_wna16(4, 64),
    "ct uint4 g32 zp": QuantScheme.int_wna16(4, 32, True, "compressed-tensors"),
    "awq int4 zp": QuantScheme.int_wna16(4, 64, True, "awq"),
    "gptq int8 channel": QuantScheme.int_wna16(8, -1),
    "ct uint8 g64 zp": QuantScheme.int_wna16(8, 64, True, "compressed-tensors"),
    "gptq int4 g32 act-order": QuantScheme.int_wna16(4, 32, act_order=True),
    "ct uint8 g64 zp act-order": QuantScheme.int_wna16(8, 64, True, "compressed-tensors", act_order=True),
}
ACTIVATION_QUANTIZED = {
    "mxfp8": (QuantScheme.mxfp8(), 0.1),
    "mxfp4 w4a8 mx": (QuantScheme.mxfp4("mxfp8"), 0.1),
    "mxfp4 w4a4": (QuantScheme.mxfp4("mxfp4"), 0.3),
    "mxfp4 fp8 groups": (QuantScheme.mxfp4("fp8-group"), 0.1),
    "int8 channel/token": (QuantScheme.int8(), 4e-2),
    "int8 channel/token asym": (QuantScheme.int8(symmetric_activation=False), 4e-2),
    "int8 tensor/tensor": (QuantScheme.int8("tensor", "tensor"), 6e-2),
    "int8 tensor/tensor asym": (QuantScheme.int8("tensor", "tensor", symmetric_activation=False), 6e-2),
    "int8 static tensor": (QuantScheme.int8("tensor", "tensor", True), 6e-2),
    "w4a8 fp8 token": (QuantScheme.w4a8(), 0.1),
    "w4a8_int8 g64": (QuantScheme.w4a8_int8(64), 4e-2),
    "w4a8_int8 channel": (QuantScheme.w4a8_int8(-1), 4e-2),
}


def _layer(scheme: QuantScheme, dtype: str) -> MoELayer:
    gpt_oss = scheme.family is QuantFamily.MXFP4
    return MoELayer(quant=scheme, dtype=dtype, bias=gpt_oss, activation="swigluoai" if gpt_oss else "silu",
                    swiglu_limit=7.0 if gpt_oss else None, **SHAPE)


def _case(layer: MoELayer, *key):
    case = make_case(layer, TOKENS, seed_for(*key))
    if layer.bias:
        gen = torch.Generator().manual_seed(seed_for("bias", *key))
        e, n, k = layer.num_experts, layer.intermediate_size, layer.hidden_size
        case.scales = replace(case.scales, w1_bias=torch.randn(e, 2 * n, generator=gen) * 0.2,
                              w2_bias=torch.randn(e, k, generator=gen) * 0.2)
    return case


def _run(layer: MoELayer, fmt: str, case) -> torch.Tensor:
    pf, experts = FORMATS[fmt]
    out = ModularKernel(pf(), experts(layer), layer)(case.hidden, case.w1, case.w2, case.topk_weights, case.topk_ids,
                                                     scales=case.scales)
    assert out.shape == case.hidden.shape and out.dtype == case.hidden.dtype
    assert torch.isfinite(out).all(), "NaN in the output: an element was never written"
    return out


def _reference(case) -> torch.Tensor:
    layer = case.layer
    return moe_reference(case.hidden, case.w1_float, case.w2_float, case.topk_weights, case.topk_ids,
                         activation=layer.activation.value, swiglu_limit=layer.swiglu_limit,
                         w1_bias=case.scales.w1_bias, w2_bias=case.scales.w2_bias)


# Float64 restatements of the activation quantizations ------------------------------


def _int8_qdq(x: torch.Tensor, per_token: bool, symmetric: bool, static=None) -> torch.Tensor:
    x = x.to(torch.float64)
    lo = x.amin(dim=-1, keepdim=True) if per_token else x.min()
    hi = x.amax(dim=-1, keepdim=True) if per_token else x.max()
    if symmetric:
        s = static.to(torch.float64) if static is not None else torch.maximum(hi.abs(), lo.abs()).clamp(min=1e-10) / 127
        return torch.round(x / s).clamp(-128, 127) * s
    s = ((hi - lo) / 255).clamp(min=1e-10)
    azp = torch.round(-128 - lo / s)
    return ((torch.round(x / s) + azp).clamp(-128, 127) - azp) * s


def _mxfp8_qdq(x: torch.Tensor) -> torch.Tensor:
    blocks = x.to(torch.float64).reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (blocks / scale).to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64)
    return (q * scale).reshape(x.shape)


def _qdq(scheme: QuantScheme, scales, stage: int):
    """What the experts' GEMM ``stage`` sees of its input, restated; None where the emulation is not restated."""
    if scheme.family is QuantFamily.W4A8_INT8:
        return lambda x: _int8_qdq(x, True, False)
    key = scheme.activation
    if key.dtype == "int8":
        static = (scales.a1_scale, scales.a2_scale)[stage] if key.static else None
        return lambda x: _int8_qdq(x, key.granularity is Granularity.TOKEN, key.symmetric, static)
    if key.granularity is Granularity.GROUP_1x32 and key.dtype == "fp8_e4m3":
        return _mxfp8_qdq
    if key.dtype == "fp8_e4m3":
        return lambda x: fp8_qdq(x, key.granularity, None)
    return None


def _emulate(case) -> torch.Tensor:
    """float64 [M, K] with the activation QDQ before each GEMM (and the biases)."""
    layer, scales = case.layer, case.scales
    ids, g = case.topk_ids.long(), case.topk_weights.to(torch.float64)
    x = _qdq(layer.quant, scales, 0)(case.hidden.to(torch.float64))
    h = torch.einsum("mk,mjnk->mjn", x, case.w1_float[ids])
    if scales.w1_bias is not None:
        h = h + scales.w1_bias.to(torch.float64)[ids]
    inter = apply_activation(layer.activation.value, h, layer.swiglu_limit)
    inter = _qdq(layer.quant, scales, 1)(inter.reshape(-1, inter.shape[-1])).reshape(inter.shape)
    y = torch.einsum("mjn,mjkn->mjk", inter, case.w2_float[ids])
    if scales.w2_bias is not None:
        y = y + scales.w2_bias.to(torch.float64)[ids]
    return (y * g.unsqueeze(-1)).sum(dim=1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(WEIGHT_ONLY))
def test_weight_only_schemes_match_reference(name, dtype, fmt, poisoned):
    layer = _layer(WEIGHT_ONLY[name], dtype)
    case = _case(layer, name, dtype)
    assert rel_fro(_run(layer, fmt, case), _reference(case)) <= {"float32": 1e-5, "bfloat16": 2e-2}[dtype]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(ACTIVATION_QUANTIZED))
def test_activation_quantized_schemes_match_their_emulation(name, dtype, fmt, poisoned):
    scheme, format_tol = ACTIVATION_QUANTIZED[name]
    layer = _layer(scheme, dtype)
    case = _case(layer, name, dtype)
    out = _run(layer, fmt, case)
    err_ref = rel_fro(out, _reference(case))
    assert err_ref <= format_tol, err_ref
    if _qdq(scheme, case.scales, 0) is not None:
        err = rel_fro(out, _emulate(case))
        assert err <= {"float32": 5e-3, "bfloat16": 1.5e-2}[dtype], err
        assert err < err_ref / 3, "the emulation should explain most of the difference from the float reference"


def test_biases_reach_the_output():
    """Dropping the biases changes the answer (so a bias that is never added fails the tests above)."""
    layer = _layer(QuantScheme.mxfp4(), "float32")
    case = _case(layer, "bias-check")
    with_bias = _run(layer, "standard", case)
    assert rel_fro(with_bias, _reference(case)) <= 1e-5
    case.scales = replace(case.scales, w1_bias=torch.zeros_like(case.scales.w1_bias), w2_bias=torch.zeros_like(case.scales.w2_bias))
    assert rel_fro(with_bias, _reference(case)) > 1e-2


def test_triton_weight_quant_experts_build_here_and_say_why_they_cannot_run():
    from moe_fsm.errors import BackendUnavailableError, KernelInputError
    from moe_fsm.experts.triton_wq_experts import TritonMxfp4Experts, TritonWna16Experts

    with pytest.raises(KernelInputError, match="runs mxfp4 layers"):
        TritonMxfp4Experts(_layer(QuantScheme.int_wna16(), "bfloat16"))
    with pytest.raises(KernelInputError, match="16-bit activations"):
        TritonMxfp4Experts(_layer(QuantScheme.mxfp4("mxfp8"), "bfloat16"))
    with pytest.raises(KernelInputError, match="runs mxfp4 layers"):
        TritonMxfp4Experts(MoELayer(quant=QuantScheme.int_wna16(act_order=True), **SHAPE))
    assert "sorted by g_idx" in TritonWna16Experts(MoELayer(quant=QuantScheme.int_wna16(act_order=True), **SHAPE)).relayout
    layer = _layer(QuantScheme.int_wna16(4, 64), "bfloat16")
    case = _case(layer, "cpu-refusal")
    kernel = ModularKernel(LocalPrepareFinalize(), TritonWna16Experts(layer), layer)
    with pytest.raises(BackendUnavailableError, match="triton|CUDA"):
        kernel(case.hidden, case.w1, case.w2, case.topk_weights, case.topk_ids, scales=case.scales)
