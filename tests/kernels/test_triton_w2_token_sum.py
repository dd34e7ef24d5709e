"""The w2 GEMM that sums each token's top-k slots itself (``fused.w2_token_sum``): one launch fewer at decode.

One program per (token, output tile) walks the token's slots, sums them in fp32 registers with the router weights
and writes the output once (``_kernels.w2_token_sum_kernel``), instead of a row per pair and a top-k sum launch. By
default (``config.sums_slots_in_w2``) only where every pair has a row block of its own (unsorted pair blocks) and
the grid has 256 programs of at least 64 columns, where an H200 measured it faster; ``sum_in_w2=True`` forces it.
The rule, its tile and the errors are checked on the CPU; the kernel itself under
Triton's interpreter (``TRITON_INTERPRET=1 python3 -m pytest tests/kernels/test_triton_w2_token_sum.py``; float16,
which the interpreter computes) against float64, outputs poisoned with NaN first: whole layers with slots of another
rank, a token with no local slot, a reduction width no K step divides, and every FP8 scale layout with float16
values standing in for the e4m3 ones (the scales' addressing is what differs). ``tests/gpu/test_triton_moe.py``
runs model-sized layers in bf16 and FP8; the launch lists are in ``test_triton_launch.py`` and
``test_triton_pair_blocks.py``.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from moe_fsm.kernels.reference import moe_reference
from moe_fsm.kernels.triton_moe.config import (
    TOKEN_SUM_MIN_PROGRAMS, TOKEN_SUM_STAGES, GemmConfig, MoEConfig, sums_slots_in_w2, token_sum_config,
)

from triton_launches import interpreter, needs_triton_jit

TOL = 1e-2  # fp16 operands and intermediate, fp32 accumulation
DECODE = MoEConfig(16, GemmConfig(16, 32, 1, 4, 2, swap_ab=True), GemmConfig(32, 16, 1, 4, 2, swap_ab=True))


@pytest.mark.parametrize("w2_block_n,tokens,n_out,block_n", [
    (128, 8, 2048, 64),  # Qwen3-Next TP2 at 8 tokens (measured faster): 16 tiles of 128 a token, halved once
    (64, 4, 7168, 64),  # DeepSeek-V3 TP4 at 4 tokens (measured faster): 448 programs already
    (128, 1, 2048, 64),  # narrowed no further than 64 columns, whatever the grid
    (32, 1, 2048, 32),  # a w2 tile narrower than that is kept
    (256, 8, 8192, 256),  # 8 x 32 tiles of 256: wide enough already
])
def test_the_tile_narrows_to_64_columns_at_most(w2_block_n, tokens, n_out, block_n):
    w2 = GemmConfig(w2_block_n, 128, 8, 4, 3, swap_ab=False)
    assert token_sum_config(w2, tokens, n_out) == GemmConfig(block_n, 128, 1, 4, TOKEN_SUM_STAGES, swap_ab=True)


@pytest.mark.parametrize("unsorted,tokens,n_out,w2_block_n,sums", [
    (True, 8, 2048, 128, True),  # Qwen3-Next TP2 at 8 tokens: 256 programs of 64 columns (measured 8% faster)
    (True, 4, 7168, 64, True),  # DeepSeek-V3 TP4 at 4 tokens: 448 (measured 5% faster)
    (True, 2, 7168, 64, False),  # 224 programs: it needed 32-column tiles, 10% slower
    (True, 4, 2880, 64, False),  # GPT-OSS-120B TP2 at 4 tokens: 180, 17% slower at 32 columns
    (True, 1, 4096, 64, False),  # one token: 64 programs
    (True, 1, 16384, 64, True),  # one token past a 16384-wide hidden size
    (True, 8, 2048, 32, False),  # a 32-column w2 tile: never measured faster
    (False, 8, 7168, 64, False),  # sorted rows: each expert read once by w2 as it is (forced: slower at 8 of 9)
])
def test_which_calls_sum_in_w2(unsorted, tokens, n_out, w2_block_n, sums):
    """Unsorted pair blocks with the decode (swap-AB) w2 tile sum in w2 where the grid has 256 programs of at least
    64 columns; sorted rows, prefill tiles and the atomic fold never do."""
    config = MoEConfig(16, DECODE.w1, GemmConfig(w2_block_n, 128, 1, 4, 4, swap_ab=True))
    assert sums_slots_in_w2(unsorted, config, tokens, n_out) is sums
    assert TOKEN_SUM_MIN_PROGRAMS == 256
    prefill = MoEConfig(64, GemmConfig(64, 64), GemmConfig(128, 64))
    assert not sums_slots_in_w2(True, prefill, 8, 7168)
    assert not sums_slots_in_w2(True, MoEConfig(16, DECODE.w1, config.w2, fold_topk=True), 8, 7168)


def _record(monkeypatch, **kwargs) -> list[str]:
    from triton_launches import record_layer_launches

    from moe_fsm.kernels.triton_moe import fused

    calls = record_layer_launches(monkeypatch)
    experts, n, k = 8, 32, 64
    w1, w2 = torch.zeros(experts, 2 * n, k, dtype=torch.bfloat16), torch.zeros(experts, k, n, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 3]], dtype=torch.int32)
    fused.fused_experts(torch.zeros(1, k, dtype=torch.bfloat16), w1, w2, torch.full(ids.shape, 0.5), ids,
                        config=DECODE, **kwargs)
    return [fn.__name__ for fn, _, _, _ in calls]


@needs_triton_jit
@pytest.mark.parametrize("fp8", [None, "tensor", "channel", "block"])
def test_the_summing_w2_launch_binds_in_every_format(monkeypatch, fp8):
    """``sum_in_w2=True``: w2's launch is ``w2_token_sum_kernel`` with no top-k sum after it, bound by Triton's
    binder for sm_90 (a renamed or missing argument fails here) with the scale modes of the format."""
    from triton_launches import bind, record_layer_launches

    from moe_fsm.kernels.triton_moe import _runtime, fused
    from moe_fsm.kernels.triton_moe.quant import FP8_DTYPE

    monkeypatch.setattr(_runtime, "_pdl_capable", lambda device: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    calls = record_layer_launches(monkeypatch)
    experts, n, k = 4, 256, 512
    dt = FP8_DTYPE if fp8 else torch.bfloat16
    w1, w2 = torch.zeros(experts, 2 * n, k, dtype=dt), torch.zeros(experts, k, n, dtype=dt)
    kwargs = {}
    if fp8 == "channel":
        kwargs = dict(fp8=fused.Fp8Spec("channel", "token"), w1_scale=torch.ones(experts, 2 * n),
                      w2_scale=torch.ones(experts, k))
    elif fp8 == "tensor":
        kwargs = dict(fp8=fused.Fp8Spec("tensor", "tensor"), w1_scale=torch.ones(experts), w2_scale=torch.ones(experts))
    elif fp8 == "block":
        kwargs = dict(fp8=fused.Fp8Spec("block", "group"), w1_scale=torch.ones(experts, 2 * n // 128, k // 128),
                      w2_scale=torch.ones(experts, k // 128, n // 128))
    ids = torch.tensor([[0, 3]], dtype=torch.int32)
    fused.fused_experts(torch.zeros(1, k, dtype=torch.bfloat16), w1, w2, torch.full(ids.shape, 0.5), ids,
                        config=DECODE, sum_in_w2=True, **kwargs)
    fn, grid, args, launch_kwargs = calls[-1]
    assert fn.__name__ == "w2_token_sum_kernel" and "topk_sum_kernel" not in [c[0].__name__ for c in calls]
    assert grid == (k // DECODE.w2.block_n, 1)  # a one-token call keeps w2's 32-column tile (no wider grid to gain)
    _, constexprs = bind(fn, args, launch_kwargs)
    modes = {None: 0, "tensor": 1, "channel": 2, "block": 3}[fp8]
    assert constexprs[(fn.arg_names.index("W_SCALE"),)] == modes
    assert constexprs[(fn.arg_names.index("A_SCALE"),)] == modes
    assert constexprs[(fn.arg_names.index("PDL"),)] is True


@needs_triton_jit
@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_sum_in_w2_takes_a_bool_or_none(monkeypatch, bad):
    from moe_fsm.errors import KernelInputError

    with pytest.raises(KernelInputError, match="sum_in_w2 must be True, False or None"):
        _record(monkeypatch, sum_in_w2=bad)


@needs_triton_jit
def test_sum_in_w2_is_refused_where_the_hopper_kernels_run(monkeypatch):
    from moe_fsm.errors import KernelInputError
    from moe_fsm.kernels.triton_moe import fused

    monkeypatch.setattr(fused, "hopper_usable", lambda *args: True)
    with pytest.raises(KernelInputError, match="sum_in_w2=True: this config runs the Hopper/Gluon kernels"):
        _record(monkeypatch, sum_in_w2=True)


def _layer(seed: int, tokens: int, experts: int, top_k: int, k: int, n: int):
    """A float16 layer: two tokens share an expert, one slot is another rank's (-1), and with three tokens or more
    token 2 has no local slot at all."""
    gen = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(experts, 2 * n, k, generator=gen) / k**0.5).half()
    w2 = (torch.randn(experts, k, n, generator=gen) / n**0.5).half()
    x = torch.randn(tokens, k, generator=gen).half()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    if tokens > 1:
        ids[1, 0] = ids[0, top_k - 1]
    ids[0, 0] = -1
    if tokens > 2:
        ids[2] = -1
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1)
    ref = moe_reference(x, w1.double(), w2.double(), weights * (ids >= 0), ids.clamp(min=0))
    return x, w1, w2, weights, ids, ref


@interpreter
@pytest.mark.parametrize("tokens,unsorted", [(1, None), (3, True), (3, False), (5, None)])
@pytest.mark.parametrize("n", [48, 64])  # 48: the last K step of w2 (16-wide here) is whole, then not (32-wide)
def test_layers_summed_in_w2_match_float64(poisoned, tokens, unsorted, n):
    from moe_fsm.kernels.triton_moe import fused_experts

    x, w1, w2, weights, ids, ref = _layer(tokens * 10 + n, tokens, 16, 3, 64, n)
    for block_k in (16, 32):
        config = MoEConfig(16, DECODE.w1, GemmConfig(32, block_k, 1, 4, 2, swap_ab=True))
        out = torch.full((tokens, x.shape[1]), math.nan, dtype=torch.float16)
        fused_experts(x, w1, w2, weights, ids, out=out, config=config, unsorted=unsorted, sum_in_w2=True)
        assert bool(torch.isfinite(out).all())
        if tokens > 2:
            assert bool((out[2] == 0).all())  # no local slot: zeros, not a stale row
        assert float((out.double() - ref).norm() / ref.norm()) <= TOL


@interpreter
def test_router_weight_on_input_is_not_applied_again(poisoned):
    from moe_fsm.kernels.triton_moe import fused_experts

    x, w1, w2, weights, ids, _ = _layer(3, 2, 16, 1, 64, 32)
    ids[0, 0] = 5
    ref = moe_reference(x, w1.double(), w2.double(), weights, ids, apply_router_weight_on_input=True)
    out = fused_experts(x, w1, w2, weights, ids, config=DECODE, apply_router_weight_on_input=True, sum_in_w2=True)
    assert float((out.double() - ref).norm() / ref.norm()) <= TOL


@interpreter
@pytest.mark.parametrize("weight,activation", [("tensor", "tensor"), ("channel", "token"), ("tensor", "token"),
                                               ("block", "group")])
@pytest.mark.parametrize("block_n", [16, 64, 256])  # one 128-row scale group per tile, or two
def test_every_fp8_scale_layout(poisoned, weight, activation, block_n):
    """``w2_token_sum`` with each weight and activation scale layout on float16 values (the interpreter has no e4m3
    arithmetic): out[m] = sum_j g * (a_scale * a[pair]) @ (w_scale * w2[e])^T, in float64."""
    from moe_fsm.kernels.triton_moe.fused import Fp8Spec, w2_token_sum

    gen = torch.Generator().manual_seed(block_n)
    experts, k_out, n, tokens, top_k = 6, 256, 256, 2, 3
    ids = torch.tensor([[4, -1, 1], [1, 0, 5]], dtype=torch.int32)
    g = torch.rand(tokens, top_k, generator=gen)
    pairs = tokens * top_k
    a = torch.randn(pairs, n, generator=gen).half()
    w2 = torch.randn(experts, k_out, n, generator=gen).half()
    w_scale = {"tensor": torch.rand(experts, generator=gen) + 0.5,
               "channel": torch.rand(experts, k_out, generator=gen) + 0.5,
               "block": torch.rand(experts, k_out // 128, n // 128, generator=gen) + 0.5}[weight]
    a_scale = {"tensor": torch.rand(1, generator=gen) + 0.5, "token": torch.rand(pairs, 1, generator=gen) + 0.5,
               "group": torch.rand(pairs, n // 128, generator=gen) + 0.5}[activation]
    a[1] = math.nan  # the slot of another rank: its intermediate row was never written
    if weight == "block":
        w_full = w_scale.repeat_interleave(128, 1).repeat_interleave(128, 2) * w2.double()
    else:
        w_full = w_scale.reshape(experts, -1, 1) * w2.double()
    a_full = (a_scale.repeat_interleave(128, 1) if activation == "group" else a_scale) * a.double()
    ref = torch.zeros(tokens, k_out, dtype=torch.float64)
    for m in range(tokens):
        for j in range(top_k):
            e = int(ids[m, j])
            if e >= 0:
                ref[m] += float(g[m, j]) * (w_full[e] @ a_full[m * top_k + j])
    out = torch.full((tokens, k_out), math.nan, dtype=torch.float16)
    w2_token_sum(a, a_scale, w2, w_scale, ids, out, spec=Fp8Spec(weight, activation), row_weights=g.reshape(-1),
                 config=GemmConfig(block_n, 64 if weight == "block" else 128, 1, 4, 2, swap_ab=True))
    assert bool(torch.isfinite(out).all())
    assert float((out.double() - ref).norm() / ref.norm()) <= TOL


def test_the_benchmark_summarizes_the_sum_columns():
    """bench_experts_vs_vllm.py's ``sum_apart`` / ``sum_in_w2`` columns: column / ours per point where timed, their
    geometric mean and the largest distance to ours."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "bench_experts_vs_vllm.py"
    spec = importlib.util.spec_from_file_location("bench_experts_vs_vllm", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [
        {"series": "qwen3-next-tp2", "tokens": 8, "sum_apart_over_ours": 1.085, "sum_apart_rel_diff": 2.6e-3},
        {"series": "olmoe-like", "tokens": 1, "sum_apart_over_ours": 0.58, "sum_apart_rel_diff": 2.5e-3},
        {"series": "olmoe-like", "tokens": 8, "sum_in_w2_over_ours": 1.081, "sum_in_w2_rel_diff": 3.1e-3},
        {"series": "mixtral-8x7b", "tokens": 128, "ours_us": 10.0},  # past 8 tokens: neither column
    ]
    summary = bench.summarize({"results": rows})["topk_sum"]
    assert summary["sum_apart"]["points"] == 2
    assert summary["sum_apart"]["geomean_over_ours"] == pytest.approx(math.sqrt(1.085 * 0.58), abs=1e-3)
    assert summary["sum_apart"]["over_ours"] == {"qwen3-next-tp2/8": 1.085, "olmoe-like/1": 0.58}
    assert summary["sum_in_w2"] == {"points": 1, "geomean_over_ours": 1.081, "over_ours": {"olmoe-like/8": 1.081},
                                    "max_rel_diff_vs_ours": 3.1e-3}
