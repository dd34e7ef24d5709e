"""The Hopper TMA grouped GEMMs (``MoEConfig.hopper``) on an sm_90+ device, against the float64 reference.

Every case asserts that the Hopper path really ran (``hopper_usable``), then compares with the float64
reference (bf16: 1e-2 relative Frobenius; FP8 against the float64 emulation of both activation
quantizations: 1.5e-2, as ``test_triton_moe.py`` explains) and with the pointer-load kernel on the same
tiles (the same products summed in the same K order, so only the intermediate's layout differs: 2e-3).
Outputs and the allocator's free blocks are NaN-poisoned before each call.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

from moe_fsm.kernels.triton_moe import Fp8Spec, GemmConfig, MoEConfig, align_tokens, fused_experts  # noqa: E402
from moe_fsm.kernels.triton_moe.config import WARP_SPECIALIZE_ENV  # noqa: E402
from moe_fsm.kernels.triton_moe.hopper import hopper_usable  # noqa: E402

from .moe_gpu_cases import (  # noqa: E402
    DEEPSEEK_V3,
    Shape,
    MIXTRAL_8X7B,
    QWEN3_30B,
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
FP8_VS_EMULATION_TOL = 1.5e-2
SAME_TILES_TOL = 2e-3

if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("the TMA kernels need a Hopper (sm_90) or later GPU", allow_module_level=True)


# Warp specialization is refused by validate_config (wrong results measured on the H100): these tests opt in to
# run it, and the cases measured wrong are strict xfails, so a Triton that fixes them makes the suite say so.
WS_WRONG = pytest.mark.xfail(strict=True, reason="Triton 3.6 warp-specialized K loop: wrong layer on the H100 "
                             "(NaN rows in bf16 bm64 gather; 3.7e-2 off the emulation in block FP8), 2026-11-25")


# The warp-specialized persistent grid over a gathered input at block_m 128 did not finish on the H100 (2026-11-25,
# twice: pytest-timeout's 200 s never fired, the process waited on the device). The test that followed it in file
# order (dropped slots, persistent + gathered, not warp-specialized) never started in those runs and was wrongly
# counted with it: that call and seven other persistent gathered Qwen3 and Mixtral calls, each run in a process of
# its own with a deadline, finished, equal to the pointer-load kernel (docs/perf/hopper.md). Not run:
# a hung kernel holds the device for every test after it. Warp specialization is refused outside tests anyway.
WS_PERSISTENT_GATHER_HANGS = pytest.mark.xfail(run=False, reason="warp-specialized persistent grid over a gathered "
                                               "input (block_m 128) did not finish on the H100 (2026-11-25)")


@pytest.fixture(autouse=True)
def _warp_specialization_opted_in(monkeypatch):
    monkeypatch.setenv(WARP_SPECIALIZE_ENV, "1")


# DeepSeek-V3's layer dimensions with 16 experts: the float64 checks dequantize every expert a batch hits
DEEPSEEK_V3_E16 = Shape("deepseek-v3-e16", 16, DEEPSEEK_V3.hidden, DEEPSEEK_V3.intermediate, 8)


def _config(block_m=128, bn1=128, bn2=256, bk=64, warps=8, stages=3, persistent=False, fold=False, gather=False,
            paired=False, ws=False, flat=False):
    return MoEConfig(
        block_m,
        GemmConfig(bn1, bk, 8, warps, stages, persistent=persistent, paired=paired, warp_specialize=ws, flatten=flat),
        GemmConfig(bn2, bk, 8, warps, stages, persistent=persistent, warp_specialize=ws, flatten=flat),
        fold,
        True,
        gather,
    )


def _pointer_twin(config: MoEConfig) -> MoEConfig:
    plain = {"persistent": False, "paired": False, "warp_specialize": False, "flatten": False}
    return MoEConfig(
        config.block_m,
        GemmConfig(**{**config.w1.__dict__, **plain}),
        GemmConfig(**{**config.w2.__dict__, **plain}),
        config.fold_topk,
    )


def _run(x, w1, w2, g, ids, config, **kw):
    assert hopper_usable(config, align_tokens(ids, w1.shape[0], config.block_m), x, w1, w2), "Hopper path not taken"
    poison_allocator()
    out = torch.full((x.shape[0], w2.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    return fused_experts(x, w1, w2, g, ids, config=config, out=out, **kw)


@pytest.mark.parametrize(
    "shape,num_tokens,config",
    [
        (QWEN3_30B, 300, _config(block_m=64, bn1=64, bn2=128, warps=4)),
        (QWEN3_30B, 2000, _config()),
        (QWEN3_30B, 2000, _config(persistent=True)),
        (QWEN3_30B, 2000, _config(persistent=True, fold=True)),
        (QWEN3_30B, 2000, _config(gather=True)),
        (QWEN3_30B, 2000, _config(paired=True)),
        (MIXTRAL_8X7B, 700, _config(persistent=True)),
        (MIXTRAL_8X7B, 700, _config(persistent=True, gather=True, paired=True)),
        # the tile loop flattened into the K loop (the shipped Qwen3 8192-token entry's flags), and over the
        # gathered input (a folded top-k sum with a flattened w2 is refused: shared memory)
        (QWEN3_30B, 2000, _config(stages=4, persistent=True, paired=True, flat=True)),
        (QWEN3_30B, 2000, _config(persistent=True, gather=True, flat=True)),
        (MIXTRAL_8X7B, 700, _config(stages=4, persistent=True, gather=True, paired=True, flat=True)),
        (QWEN3_30B, 2000, _config(block_m=64, stages=4, persistent=True, paired=True, flat=True)),
        # warp specialization (4 warps, run as 12): bm64, and bm128 whose rows Triton splits between two
        # consumer warpgroups (the w1 tile is then stored through pointers)
        pytest.param(QWEN3_30B, 2000, _config(block_m=64, bn1=64, bn2=128, warps=4, gather=True, ws=True),
                     marks=WS_WRONG),
        pytest.param(QWEN3_30B, 2000, _config(bn2=128, warps=4, persistent=True, gather=True, ws=True),
                     marks=WS_PERSISTENT_GATHER_HANGS),
    ],
    ids=["qwen-bm64", "qwen-bm128", "qwen-persistent", "qwen-persistent-fold", "qwen-gather", "qwen-paired",
         "mixtral-persistent", "mixtral-persistent-gather-paired", "qwen-persistent-paired-flat",
         "qwen-persistent-gather-flat", "mixtral-persistent-gather-paired-flat", "qwen-bm64-persistent-paired-flat",
         "qwen-bm64-gather-ws",
         "qwen-bm128-persistent-gather-ws"],
)
def test_bf16_matches_reference_and_pointer_kernel(shape, num_tokens, config):
    w1, w2 = float_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=num_tokens)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=num_tokens)
    out = _run(x, w1, w2, g, ids, config)
    assert rel_err(out, reference(x, w1, w2, g, ids)) < BF16_TOL
    assert rel_err(out, fused_experts(x, w1, w2, g, ids, config=_pointer_twin(config)).double()) < SAME_TILES_TOL


@pytest.mark.parametrize("gather", [False, True])
def test_slots_of_other_ranks_and_swigluoai_limit(gather):
    shape, num_tokens = QWEN3_30B, 500
    w1, w2 = float_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=11)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=11)
    ids = ids.clone()
    ids[::3, 2] = -1  # slots another rank owns contribute nothing
    ids[::7, 5] = shape.num_experts + 3  # out of range: nothing either
    config = _config(persistent=True, gather=gather)
    out = _run(x, w1, w2, g, ids, config, activation="swigluoai", swiglu_limit=7.0)
    ref_ids = torch.where(ids >= shape.num_experts, -1, ids)
    ref = reference(x, w1, w2, g, ref_ids, activation="swigluoai", swiglu_limit=7.0)
    assert rel_err(out, ref) < BF16_TOL


def test_router_weight_on_input():
    shape, num_tokens = QWEN3_30B, 400
    w1, w2 = float_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=12)
    g, ids = routing(num_tokens, shape.num_experts, 1, seed=12)
    out = _run(x, w1, w2, g, ids, _config(block_m=64, bn1=64, bn2=128, warps=4), apply_router_weight_on_input=True)
    assert rel_err(out, reference(x, w1, w2, g, ids, apply_router_weight_on_input=True)) < BF16_TOL


@pytest.mark.parametrize(
    "persistent,gather,paired,ws",
    [(False, False, False, False), (True, False, False, False), (True, True, False, False), (False, True, True, False),
     pytest.param(True, True, False, True, marks=WS_WRONG)],
)
def test_block_fp8(persistent, gather, paired, ws):
    shape, num_tokens = DEEPSEEK_V3_E16, 600
    w1q, w2q, s1, s2 = block_fp8_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=13)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=13)
    config = _config(block_m=64, bn1=64 if ws else 128, bn2=128, bk=128, warps=4 if ws else 8, stages=3,
                     persistent=persistent, gather=gather, paired=paired, ws=ws)
    kw = dict(fp8=Fp8Spec("block", "group"), w1_scale=s1, w2_scale=s2)
    out = _run(x, w1q, w2q, g, ids, config, **kw)
    deq = dequantize_block(w1q, w2q, s1, s2)
    assert rel_err(out, emulate_fp8(x, w1q, w2q, g, ids, granularity="group", dequantize=deq)) < FP8_VS_EMULATION_TOL
    assert rel_err(out, fused_experts(x, w1q, w2q, g, ids, config=_pointer_twin(config), **kw).double()) < SAME_TILES_TOL


@pytest.mark.parametrize(
    "weight,activation,static,gather,flat",
    [("tensor", "tensor", False, False, False), ("tensor", "tensor", True, True, False),
     ("channel", "token", False, False, False), ("channel", "token", False, True, False),
     # the flattened persistent loop with paired w1 loads (the tuned H100 FP8 prefill entries' flags)
     ("tensor", "tensor", False, False, True), ("channel", "token", False, False, True)],
)
def test_rowwise_fp8(weight, activation, static, gather, flat):
    shape, num_tokens = QWEN3_30B, 700
    w1, w2 = float_weights(shape)
    w1q, w2q, s1, s2, deq = quantize_rowwise(w1, w2, weight)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=14)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=14)
    a1 = (x.abs().amax().float() / 448).reshape(1) if static else None
    a2 = torch.tensor([0.02], device="cuda") if static else None
    config = _config(bk=128, stages=4 if flat else 3, persistent=True, gather=gather, paired=gather or flat, flat=flat)
    out = _run(x, w1q, w2q, g, ids, config, fp8=Fp8Spec(weight, activation), w1_scale=s1, w2_scale=s2,
               a1_scale=a1, a2_scale=a2)
    emulated = emulate_fp8(x, w1q, w2q, g, ids, granularity=activation, a1_scale=a1, a2_scale=a2, dequantize=deq)
    assert rel_err(out, emulated) < FP8_VS_EMULATION_TOL


@pytest.mark.parametrize("flat", [False, True])
def test_cuda_graph_capture_replays_new_routing(flat):
    shape, num_tokens = QWEN3_30B, 1024
    w1, w2 = float_weights(shape)
    config = _config(persistent=True, gather=True, flat=flat)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=15)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=15)
    out = torch.empty(num_tokens, shape.hidden, dtype=torch.bfloat16, device="cuda")
    fused_experts(x, w1, w2, g, ids, config=config, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts(x, w1, w2, g, ids, config=config, out=out)
    x2 = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=16)
    g2, ids2 = routing(num_tokens, shape.num_experts, shape.top_k, seed=16)
    x.copy_(x2)
    g.copy_(g2)
    ids.copy_(ids2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(x2, w1, w2, g2, ids2)) < BF16_TOL
