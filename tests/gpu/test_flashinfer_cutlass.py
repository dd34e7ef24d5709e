"""FlashInfer's CUTLASS fused MoE through moe-fsm's adapter, against the float64 reference.

Runs where CUDA, flashinfer-python and (on Hopper) the prebuilt trimmed module are present;
``moe-fsm flashinfer build`` builds that module into the user cache (``MOE_FSM_FLASHINFER_PREBUILT``
points elsewhere). Every test poisons torch's allocator with NaN first, so an output or a
workspace the kernel leaves unwritten fails the comparison. The last tests go the whole way an
engine does: select -> build -> run, the README's sm90 block-FP8 layer among them.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("flashinfer.fused_moe")

from moe_fsm.errors import BackendUnavailableError  # noqa: E402
from moe_fsm.experts.flashinfer_experts import FlashInferCutlassExperts  # noqa: E402
from moe_fsm.inputs.layer import MoELayer  # noqa: E402
from moe_fsm.inputs.quant import QuantScheme  # noqa: E402
from moe_fsm.kernels import fp8  # noqa: E402
from moe_fsm.modular.interfaces import ExpertScales  # noqa: E402
from moe_fsm.runtime import build  # noqa: E402

from .moe_gpu_cases import (  # noqa: E402
    DEEPSEEK_V3,
    MIXTRAL_8X7B,
    QWEN3_30B,
    Shape,
    block_fp8_weights,
    dequantize_block,
    emulate_fp8,
    float_weights,
    hidden_states,
    poison_allocator,
    quantize_rowwise,
    reference,
    rel_err,
    routing,
)

BF16_TOL = 1e-2
FP8_VS_EMULATION_TOL = 2e-2
# FlashInfer's DeepSeek block-FP8 path sits a steady 1.76e-2..2.17e-2 from the torch emulation on the H100 (1, 5,
# 200 and 300 tokens; the most at 1 token), the same whether the emulation rounds activations as vLLM does
# (x / (amax / 448)) or as TensorRT-LLM's 1x128 quantizer does (x * (448 / amax)): a difference the emulation does
# not model, not tie rounding; its cause is not yet known (docs/perf/flashinfer.md). Against float64 it stays 4.3e-2.
FP8_BLOCK_VS_EMULATION_TOL = 3e-2
FP8_VS_FLOAT_TOL = 8e-2
SMALL_DEEPSEEK = Shape("deepseek-v3-32e", 32, 7168, 2048, 8)  # the V3 layer's sizes, fewer experts


def _layer(shape, quant):
    return MoELayer(quant=quant, num_experts=shape.num_experts, top_k=shape.top_k, hidden_size=shape.hidden,
                    intermediate_size=shape.intermediate, dtype="bfloat16")


def _kernel(layer):
    from moe_fsm.modular.kernel import ModularKernel
    from moe_fsm.prepare_finalize.local import LocalPrepareFinalize

    try:
        experts = FlashInferCutlassExperts(layer)
    except BackendUnavailableError as err:
        pytest.skip(f"FlashInfer CUTLASS MoE module unavailable here: {err}")
    return ModularKernel(LocalPrepareFinalize(), experts, layer)


def _static_scales(x: torch.Tensor, w1q, w1_scale, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibrated static activation scales: a1 from the input, a2 from a float pass of the intermediate."""
    a1 = fp8.quantize_per_tensor(x.float(), None)[1]
    w1 = fp8.dequantize_weight_per_tensor(w1q, w1_scale, torch.float32)
    n = shape.intermediate
    gate = x.float() @ w1[:, :n].flatten(0, 1).T
    up = x.float() @ w1[:, n:].flatten(0, 1).T
    a2 = fp8.quantize_per_tensor(torch.nn.functional.silu(gate) * up, None)[1]
    return a1, a2


@pytest.mark.parametrize("shape,num_tokens", [(QWEN3_30B, 1), (QWEN3_30B, 37), (QWEN3_30B, 300), (MIXTRAL_8X7B, 64),
                                              (MIXTRAL_8X7B, 512)])
def test_bf16_matches_reference(shape, num_tokens):
    kernel = _kernel(_layer(shape, QuantScheme.unquantized()))
    w1, w2 = float_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=1)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=1)
    poison_allocator()
    out = kernel(x, w1, w2, g, ids)
    ref = reference(x, w1, w2, g, ids)
    assert 0 < rel_err(out, ref) < BF16_TOL  # exactly 0 against float64 would mean the output was not looked at


@pytest.mark.parametrize("num_tokens", [1, 37, 300])
def test_fp8_per_tensor_static_matches_emulation_and_reference(num_tokens):
    shape = QWEN3_30B
    kernel = _kernel(_layer(shape, QuantScheme.fp8("tensor", "tensor", static_activation=True)))
    w1f, w2f = float_weights(shape)
    w1q, w2q, s1, s2, deq = quantize_rowwise(w1f, w2f, "tensor")
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=2)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=2)
    a1, a2 = _static_scales(x, w1q, s1, shape)
    poison_allocator()
    out = kernel(x, w1q, w2q, g, ids, scales=ExpertScales(w1_scale=s1, w2_scale=s2, a1_scale=a1, a2_scale=a2))
    emulated = emulate_fp8(x, w1q, w2q, g, ids, granularity="tensor", a1_scale=a1, a2_scale=a2, dequantize=deq)
    assert rel_err(out, emulated) < FP8_VS_EMULATION_TOL
    assert rel_err(out, reference(x, w1q, w2q, g, ids, dequantize=deq)) < FP8_VS_FLOAT_TOL


@pytest.mark.parametrize("shape,num_tokens", [(SMALL_DEEPSEEK, 1), (SMALL_DEEPSEEK, 5), (SMALL_DEEPSEEK, 200),
                                              (QWEN3_30B, 300)], ids=lambda v: getattr(v, "name", str(v)))
def test_fp8_block_matches_emulation_and_reference(shape, num_tokens):
    if shape.intermediate % 128:
        pytest.skip(f"{shape.name}: intermediate {shape.intermediate} is not a multiple of 128")
    kernel = _kernel(_layer(shape, QuantScheme.fp8("block", "group")))
    w1q, w2q, s1, s2 = block_fp8_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=7)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=7)
    poison_allocator()
    out = kernel(x, w1q, w2q, g, ids, scales=ExpertScales(w1_scale=s1, w2_scale=s2))
    deq = dequantize_block(w1q, w2q, s1, s2)
    assert rel_err(out, reference(x, w1q, w2q, g, ids, dequantize=deq)) < FP8_VS_FLOAT_TOL
    assert rel_err(out, emulate_fp8(x, w1q, w2q, g, ids, granularity="group", dequantize=deq)) < FP8_BLOCK_VS_EMULATION_TOL


def _selected_kernel(layer, env, policy):
    from moe_fsm import ParallelConfig, select
    from moe_fsm.inputs.platform import probe

    decision = select(layer, ParallelConfig(), env=env, platform=probe(), policy=policy)
    if decision.backend != "FLASHINFER_CUTLASS":
        pytest.skip(f"this GPU's decision is {decision.backend}, not FLASHINFER_CUTLASS")
    assert decision.trace["build"]["experts"] == "FlashInferExperts"
    assert decision.trace["build"]["how"] == "native", decision.trace["build"]
    try:
        kernel = build(decision, strict=True)  # strict: a missing module skips here, never runs as a stand-in
    except BackendUnavailableError as err:
        pytest.skip(f"FlashInfer CUTLASS MoE module unavailable here: {err}")
    assert type(kernel.experts) is FlashInferCutlassExperts and kernel.stand_in is None
    return kernel


def test_select_build_run_fp8_per_tensor_goes_through_flashinfer():
    shape, num_tokens = QWEN3_30B, 64
    kernel = _selected_kernel(_layer(shape, QuantScheme.fp8("tensor", "tensor", static_activation=True)), {}, "seeds")
    w1f, w2f = float_weights(shape)
    w1q, w2q, s1, s2, deq = quantize_rowwise(w1f, w2f, "tensor")
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=3)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=3)
    a1, a2 = _static_scales(x, w1q, s1, shape)
    poison_allocator()
    out = kernel(x, w1q, w2q, g, ids, scales=ExpertScales(w1_scale=s1, w2_scale=s2, a1_scale=a1, a2_scale=a2))
    assert rel_err(out, reference(x, w1q, w2q, g, ids, dequantize=deq)) < FP8_VS_FLOAT_TOL


@pytest.mark.parametrize("num_tokens", [1, 4])
def test_select_build_run_of_the_readme_sm90_fp8_layer(num_tokens):
    """README: block FP8, 256 experts, top-8, 7168 x 2048, VLLM_USE_DEEP_GEMM=0 on an H100 -> FLASHINFER_CUTLASS."""
    shape = DEEPSEEK_V3
    kernel = _selected_kernel(_layer(shape, QuantScheme.fp8("block", "group")), {"VLLM_USE_DEEP_GEMM": "0"}, "seeds")
    w1q, w2q, s1, s2 = block_fp8_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=11)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=11)
    poison_allocator()
    out = kernel(x, w1q, w2q, g, ids, scales=ExpertScales(w1_scale=s1, w2_scale=s2))
    deq = dequantize_block(w1q, w2q, s1, s2)
    assert rel_err(out, reference(x, w1q, w2q, g, ids, dequantize=deq)) < FP8_VS_FLOAT_TOL
