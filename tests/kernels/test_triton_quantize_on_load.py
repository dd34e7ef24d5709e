"""FP8 decode GEMMs that quantize their input as they load it: the launches it saves, and the layer it computes.

At up to ``fused.QUANTIZE_ON_LOAD_TOKENS`` tokens an FP8 layer with dynamic activation scales hands the float input
to w1 and the float intermediate to w2, and each program quantizes what it loads (``fused.load_quantization``: 1x128
groups per K step; a whole small tensor, or with pair blocks a whole row, read once before the K loop) where
quantizer launches did it before. The launches are checked on the CPU (Triton's binder, not CUDA); the layer runs
under Triton's interpreter (``TRITON_INTERPRET=1 python3 -m pytest tests/kernels/test_triton_quantize_on_load.py``)
against the separate quantizers bit for bit, outputs poisoned with NaN first, in float16 (the interpreter does not
compute bfloat16). The float64 check is on the GPU (``tests/gpu/test_triton_moe.py``, model-sized layers): Triton
3.9's interpreter rounds some float32 -> e4m3 casts wrongly (125.97 becomes 64 where e4m3 rounds to 128: the
mantissa's carry into the exponent is lost), in both paths alike, so its FP8 layers are off a float64 emulation by
5-10%. ``bench_experts_vs_vllm.py``'s ``separate`` column times the two paths side by side.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from moe_fsm.kernels import fp8

HAS_TRITON = importlib.util.find_spec("triton") is not None
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not HAS_TRITON,
                                 reason="runs the kernels under Triton's interpreter: start pytest with TRITON_INTERPRET=1")
needs_triton = pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                                  reason="binds launches with Triton's JIT binder: needs Triton, not its interpreter")

WEIGHT_QUANTIZERS = {"block": fp8.quantize_weight_block, "tensor": fp8.quantize_weight_per_tensor,
                     "channel": fp8.quantize_weight_per_channel}
ACTIVATION_OF = {"block": "group", "tensor": "tensor", "channel": "token"}
SEPARATE_QUANTIZERS = {"group": "group_quant_kernel", "tensor": "small_tensor_quant_kernel", "token": "row_quant_kernel"}


def _decode_config(block_k: int = 128, swap_ab: bool = True):
    from moe_fsm.kernels.triton_moe import GemmConfig, MoEConfig

    return MoEConfig(16, GemmConfig(32, block_k, 1, 4, 2, swap_ab=swap_ab), GemmConfig(64, block_k, 1, 4, 2, swap_ab=swap_ab))


def _recorded_kernels(monkeypatch, weight: str, tokens: int, k: int = 256, n: int = 256, **kwargs) -> list[str]:
    """The kernels one ``fused_experts`` call of an FP8 layer launches, recorded and bound for sm_90, not run."""
    from triton_launches import bind, record_layer_launches

    from moe_fsm.kernels.triton_moe import Fp8Spec, _runtime, fused

    monkeypatch.setattr(_runtime, "_pdl_capable", lambda device: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    calls = record_layer_launches(monkeypatch)
    experts, top_k = 64, 4
    w1 = torch.zeros(experts, 2 * n, k, dtype=fp8.FP8_DTYPE)
    w2 = torch.zeros(experts, k, n, dtype=fp8.FP8_DTYPE)
    scales = {"block": (torch.ones(experts, 2 * n // 128, k // 128), torch.ones(experts, k // 128, n // 128)),
              "tensor": (torch.ones(experts), torch.ones(experts)),
              "channel": (torch.ones(experts, 2 * n), torch.ones(experts, k))}[weight]
    ids = (torch.arange(tokens * top_k, dtype=torch.int32) * 7 % experts).reshape(tokens, top_k)
    kwargs.setdefault("config", _decode_config())
    fused.fused_experts(torch.zeros(tokens, k, dtype=torch.bfloat16), w1, w2, torch.full(ids.shape, 1 / top_k), ids,
                        fp8=Fp8Spec(weight, ACTIVATION_OF[weight]), w1_scale=scales[0], w2_scale=scales[1], **kwargs)
    names = []
    for fn, grid, args, launch_kwargs in calls:
        bind(fn, args, launch_kwargs)
        names.append(fn.__name__)
    return names


GEMMS_AND_SUM = ["moe_gemm_kernel", "moe_gemm_kernel", "topk_sum_kernel"]


@needs_triton
@pytest.mark.parametrize("weight", ["block", "tensor", "channel"])
@pytest.mark.parametrize("on_load", [None, False])
def test_decode_launches_no_quantizer(monkeypatch, weight, on_load):
    """One token: the two GEMMs and the top-k sum, where the quantizations took two launches more (as they still do
    with ``quantize_on_load=False``)."""
    separate = SEPARATE_QUANTIZERS[ACTIVATION_OF[weight]]
    expected = GEMMS_AND_SUM if on_load is None else [separate, "moe_gemm_kernel", separate, "moe_gemm_kernel",
                                                      "topk_sum_kernel"]
    assert _recorded_kernels(monkeypatch, weight, 1, quantize_on_load=on_load) == expected


@needs_triton
@pytest.mark.parametrize("weight,tokens,kwargs,expected", [
    # 1x128 groups at any token count the rule allows; sorted rows too
    ("block", 8, {"unsorted": False}, ["align_small_kernel"] + GEMMS_AND_SUM),
    # past QUANTIZE_ON_LOAD_TOKENS the quantizers run as before
    ("block", 9, {}, ["group_quant_kernel", "align_small_kernel", "moe_gemm_kernel", "group_quant_kernel",
                      "moe_gemm_kernel", "topk_sum_kernel"]),
    # a K step of 64 holds half a group: no scale from the tile
    ("block", 1, {"config": _decode_config(block_k=64)}, ["group_quant_kernel", "moe_gemm_kernel", "group_quant_kernel",
                                                          "moe_gemm_kernel", "topk_sum_kernel"]),
    # per tensor: 8 tokens x 256 and 32 pairs x 256 fit LOAD_SCALE_SPAN (8192); an input of 8 x 2048 does not (its
    # maximum, then its quantization), the intermediate still does
    ("tensor", 8, {}, GEMMS_AND_SUM),
    ("tensor", 8, {"k": 2048}, ["small_tensor_quant_kernel", "row_quant_kernel"] + GEMMS_AND_SUM),
    # per token: a row's scale needs the block to be that row alone (pair blocks)
    ("channel", 8, {"unsorted": True}, GEMMS_AND_SUM),
    ("channel", 8, {"unsorted": False}, ["row_quant_kernel", "align_small_kernel", "moe_gemm_kernel", "row_quant_kernel",
                                         "moe_gemm_kernel", "topk_sum_kernel"]),
])
def test_where_the_quantizers_stay(monkeypatch, weight, tokens, kwargs, expected):
    assert _recorded_kernels(monkeypatch, weight, tokens, **kwargs) == expected


@needs_triton
@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_quantize_on_load_takes_a_bool_or_none(monkeypatch, bad):
    from moe_fsm.errors import KernelInputError

    with pytest.raises(KernelInputError, match="quantize_on_load must be True, False or None"):
        _recorded_kernels(monkeypatch, "block", 1, quantize_on_load=bad)


@interpreter
@pytest.mark.parametrize("weight", ["block", "tensor", "channel"])
@pytest.mark.parametrize("tokens,unsorted,swap_ab", [(1, True, True), (3, True, False), (3, False, True)])
def test_quantized_on_load_is_the_separate_quantizers_bit_for_bit(poisoned, weight, tokens, unsorted, swap_ab):
    from moe_fsm.kernels.triton_moe import Fp8Spec, fused_experts

    experts, top_k, k, n = 8, 2, 384, 256  # three 1x128 groups a row; N two groups, four 32-wide w1 tiles each
    gen = torch.Generator().manual_seed(tokens * 10 + len(weight))
    quantize = WEIGHT_QUANTIZERS[weight]
    w1q, s1 = quantize(torch.randn(experts, 2 * n, k, generator=gen) / k**0.5)
    w2q, s2 = quantize(torch.randn(experts, k, n, generator=gen) / n**0.5)
    x = (torch.randn(tokens, k, generator=gen) * torch.linspace(0.1, 4.0, k)).half()  # groups of different ranges
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    if tokens > 1:
        ids[1, 0] = ids[0, 1]  # two tokens on one expert
        ids[tokens - 1, top_k - 1] = -1  # a slot of another rank
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1)
    outs = {}
    for on_load in (True, False):
        out = torch.full((tokens, k), math.nan, dtype=torch.float16)
        fused_experts(x, w1q, w2q, weights, ids, fp8=Fp8Spec(weight, ACTIVATION_OF[weight]), w1_scale=s1, w2_scale=s2,
                      out=out, config=_decode_config(swap_ab=swap_ab), unsorted=unsorted, quantize_on_load=on_load)
        outs[on_load] = out
    assert bool(torch.isfinite(outs[True]).all())
    assert torch.equal(outs[True], outs[False])
