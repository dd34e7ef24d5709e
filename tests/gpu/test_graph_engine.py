"""The engine path on a GPU: a Decision-built modular kernel captures in a CUDA graph and replays on new routings.

Nothing in its forward may read a device value on the host (``modular/validation.py``
checks ids only in debug mode), or the capture fails with "operation not permitted
when stream is capturing". Also the Hopper paths of the GEMMs (swap-AB, top-k sum
folded into w2, narrow block-FP8 tiles) against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

from moe_fsm.decision import select  # noqa: E402
from moe_fsm.inputs.layer import MoELayer  # noqa: E402
from moe_fsm.inputs.quant import QuantScheme  # noqa: E402
from moe_fsm.kernels.triton_moe import Fp8Spec, GemmConfig, MoEConfig, fused_experts  # noqa: E402
from moe_fsm.modular.interfaces import ExpertScales  # noqa: E402
from moe_fsm.runtime import build  # noqa: E402

from .moe_gpu_cases import (  # noqa: E402
    DEEPSEEK_V3,
    QWEN3_30B,
    block_fp8_weights,
    dequantize_block,
    float_weights,
    hidden_states,
    reference,
    rel_err,
    routing,
)

BF16_TOL = 1e-2
FP8_VS_FLOAT_TOL = 8e-2


@pytest.mark.parametrize("num_tokens", [1, 24])
@pytest.mark.parametrize("quant", ["bf16", "fp8_block"])
def test_built_kernel_captures_and_replays_new_routings(num_tokens, quant, monkeypatch):
    monkeypatch.delenv("MOE_FSM_DEBUG_CHECKS", raising=False)
    shape = QWEN3_30B
    scheme = QuantScheme.unquantized() if quant == "bf16" else QuantScheme.fp8("block", "group")
    layer = MoELayer(quant=scheme, num_experts=shape.num_experts, top_k=shape.top_k, hidden_size=shape.hidden,
                     intermediate_size=shape.intermediate, dtype="bfloat16")
    decision = select(layer, backend="triton")
    kernel = build(decision)
    if quant == "bf16":
        w1, w2 = float_weights(shape)
        scales, deq, tol = ExpertScales(), None, BF16_TOL
    else:
        w1, w2, s1, s2 = block_fp8_weights(shape)
        scales, deq, tol = ExpertScales(w1_scale=s1, w2_scale=s2), dequantize_block(w1, w2, s1, s2), FP8_VS_FLOAT_TOL
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=21)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=21)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernel(x, w1, w2, g, ids, scales=scales)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(x, w1, w2, g, ids, scales=scales)
    for seed in (22, 23):
        g2, ids2 = routing(num_tokens, shape.num_experts, shape.top_k, seed=seed)
        x.copy_(hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=seed))
        g.copy_(g2)
        ids.copy_(ids2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference(x, w1, w2, g2, ids2, dequantize=deq)) < tol, seed


def test_debug_mode_still_refuses_bad_ids_on_gpu(monkeypatch):
    from moe_fsm.errors import KernelInputError

    monkeypatch.setenv("MOE_FSM_DEBUG_CHECKS", "1")
    shape = QWEN3_30B
    layer = MoELayer(num_experts=shape.num_experts, top_k=shape.top_k, hidden_size=shape.hidden,
                     intermediate_size=shape.intermediate, dtype="bfloat16")
    kernel = build(select(layer, backend="triton"))
    w1, w2 = float_weights(shape)
    x = hidden_states(4, shape.hidden, torch.bfloat16, seed=24)
    g, ids = routing(4, shape.num_experts, shape.top_k, seed=24)
    ids[0, 0] = shape.num_experts
    with pytest.raises(KernelInputError, match="topk_ids holds expert id 128"):
        kernel(x, w1, w2, g, ids)


@pytest.mark.parametrize("num_tokens", [1, 37, 600])
@pytest.mark.parametrize("swap_ab,fold", [(True, False), (False, True), (True, True)])
def test_swap_ab_and_folded_topk_sum(num_tokens, swap_ab, fold):
    shape = QWEN3_30B
    w1, w2 = float_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=25)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=25)
    block_m = 16 if swap_ab else 64
    config = MoEConfig(block_m, GemmConfig(32 if swap_ab else 64, 128, 1, 4, 3, swap_ab), GemmConfig(64, 128, 1, 4, 3, swap_ab), fold)
    out = fused_experts(x, w1, w2, g, ids, config=config, out=torch.full((num_tokens, shape.hidden), float("nan"),
                                                                        dtype=torch.bfloat16, device="cuda"))
    assert rel_err(out, reference(x, w1, w2, g, ids)) < BF16_TOL


@pytest.mark.parametrize("num_tokens", [1, 5, 200])
def test_block_fp8_narrow_tiles_swap_ab(num_tokens):
    """w1 tiles narrower than a 1x128 group quantize the intermediate after the GEMM."""
    shape = DEEPSEEK_V3 if num_tokens < 100 else QWEN3_30B
    w1q, w2q, s1, s2 = block_fp8_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=26)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=26)
    config = MoEConfig(16, GemmConfig(32, 128, 1, 4, 4, True), GemmConfig(64, 128, 1, 4, 4, True), num_tokens > 100)
    out = fused_experts(x, w1q, w2q, g, ids, fp8=Fp8Spec("block", "group"), w1_scale=s1, w2_scale=s2, config=config)
    assert rel_err(out, reference(x, w1q, w2q, g, ids, dequantize=dequantize_block(w1q, w2q, s1, s2))) < FP8_VS_FLOAT_TOL


@pytest.mark.parametrize("num_tokens", [1, 64, 3000])
def test_default_config_of_an_untuned_shape(num_tokens):
    """A shape in no table (E=64, N=320, K=1536, top-6) runs on the default: vLLM's tiles at 1 and 64 tokens, the
    flattened persistent TMA tiles at 3000 (281 rows per expert)."""
    from .moe_gpu_cases import Shape

    shape = Shape("untuned", 64, 1536, 320, 6)
    w1, w2 = float_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=27)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=27)
    assert rel_err(fused_experts(x, w1, w2, g, ids), reference(x, w1, w2, g, ids)) < BF16_TOL


def test_direct_launches_after_the_first_compute_the_same_layer(monkeypatch):
    """Direct-launch mode (opt-in): after one launch per argument signature, launches skip Triton's binding."""
    from moe_fsm.kernels.triton_moe import _runtime

    monkeypatch.setenv(_runtime.DIRECT_LAUNCH_ENV, "1")

    shape = QWEN3_30B
    w1, w2 = float_weights(shape)
    for num_tokens in (1, 37):
        first_x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=40)
        first_g, first_ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=40)
        fused_experts(first_x, w1, w2, first_g, first_ids)
        cached = len(_runtime._compiled)
        assert cached > 0
        x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=41)
        g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=41)
        out = fused_experts(x, w1, w2, g, ids, out=torch.full((num_tokens, shape.hidden), float("nan"), dtype=torch.bfloat16, device="cuda"))
        assert len(_runtime._compiled) == cached  # no new signature: every launch went direct
        assert rel_err(out, reference(x, w1, w2, g, ids)) < BF16_TOL
