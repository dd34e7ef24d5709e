"""Unsorted pair blocks past one token: the rule that picks them, the launches it saves, and the layer they compute.

``align.pair_blocks_pay`` decides whether a batch skips the alignment (one row block per (token, slot) pair, its
expert read from ``topk_ids``): one token always; up to ``UNSORTED_MAX_TOKENS`` tokens while the weight bytes the
pairs are expected to read twice stay within ``UNSORTED_REREAD_BYTES`` (the bound measured on an H100,
``docs/perf/vs_vllm.md``). The rule and the kernels each call launches are checked on the CPU (the launches need
Triton, not CUDA); the layer itself runs under Triton's interpreter (``TRITON_INTERPRET=1 python3 -m pytest
tests/kernels/test_triton_pair_blocks.py``; small shapes in float16, which the interpreter computes) against float64,
outputs poisoned with NaN first, with pairs that share an expert and slots of another rank.
``tests/gpu/test_triton_moe.py`` runs model-sized layers; ``bench_experts_vs_vllm.py``'s ``other`` column times the
two layouts side by side (its summary is checked here)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from moe_fsm.kernels.reference import moe_reference
from moe_fsm.kernels.triton_moe.align import (
    UNSORTED_MAX_TOKENS, UNSORTED_REREAD_BYTES, expected_shared_pairs, pair_blocks_pay,
)

from triton_launches import interpreter, needs_triton_jit

TOL = 1e-2  # fp16 operands and intermediate, fp32 accumulation


def _bytes(n: int, k: int, fp8: bool = False) -> int:
    return 3 * n * k * (1 if fp8 else 2)


@pytest.mark.parametrize("tokens,top_k,experts,expert_bytes,unsorted", [
    (1, 8, 8, 10**10, True),  # one token: distinct experts, never sorted
    (0, 8, 256, 10**10, True),  # no pair at all: nothing to sort
    (2, 10, 512, _bytes(512, 2048), True),  # the measured points (H100): Qwen3-Next-like, 2.3 MB read twice
    (8, 10, 512, _bytes(256, 2048), True),  # its TP2 shard at 8 tokens, 18.5 MB
    (2, 8, 64, _bytes(1024, 2048), True),  # OLMoE-like at 2 tokens, 22.0 MB: the most that paid
    (8, 10, 512, _bytes(512, 2048), False),  # Qwen3-Next-like at 8 tokens, 36.9 MB: even
    (8, 8, 384, _bytes(2048, 7168, fp8=True), False),  # Kimi-K2-like at 8 tokens, 219 MB
    (8, 2, 8, _bytes(14336, 4096), False),  # Mixtral at 8 tokens
    (9, 10, 512, 1024, False),  # past the measured token counts: sorted whatever the bytes
])
def test_the_rule_leaves_few_tokens_unsorted_while_little_weight_is_read_twice(tokens, top_k, experts, expert_bytes,
                                                                               unsorted):
    assert UNSORTED_MAX_TOKENS == 8 and UNSORTED_REREAD_BYTES == 28 * 2**20
    assert pair_blocks_pay(tokens, top_k, experts, expert_bytes) is unsorted


@pytest.mark.parametrize("pairs,experts", [(16, 64), (80, 512), (64, 40), (20, 20)])
def test_expected_shared_pairs_is_what_uniform_routing_shares(pairs, experts):
    """The closed form against counting: pairs drawn uniformly over the experts, less the distinct experts named."""
    gen = torch.Generator().manual_seed(pairs * 1000 + experts)
    draws = torch.randint(0, experts, (20000, pairs), generator=gen)
    distinct = torch.zeros(20000, experts).scatter_(1, draws, 1.0).sum(1)
    assert expected_shared_pairs(pairs, experts) == pytest.approx(float(pairs - distinct.mean()), rel=0.02, abs=0.02)


def test_expected_shared_pairs_edges():
    assert expected_shared_pairs(1, 64) == 0.0
    assert expected_shared_pairs(0, 64) == 0.0
    assert expected_shared_pairs(10, 1) == pytest.approx(9.0)


def _recorded_launches(monkeypatch, num_tokens: int, top_k: int, experts: int, **kwargs) -> list[str]:
    """The kernels one ``fused_experts`` call launches on a bf16 layer, recorded and bound for sm_90, not run."""
    from triton_launches import bind, record_layer_launches

    from moe_fsm.kernels.triton_moe import _runtime, fused
    from moe_fsm.kernels.triton_moe.config import GemmConfig, MoEConfig

    monkeypatch.setattr(_runtime, "_pdl_capable", lambda device: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    calls = record_layer_launches(monkeypatch)
    n, k = 32, 64
    w1, w2 = torch.zeros(experts, 2 * n, k, dtype=torch.bfloat16), torch.zeros(experts, k, n, dtype=torch.bfloat16)
    ids = (torch.arange(num_tokens * top_k, dtype=torch.int32) * 7 % experts).reshape(num_tokens, top_k)
    config = MoEConfig(16, GemmConfig(32, 64, 1, 4, 4, swap_ab=True), GemmConfig(64, 64, 1, 4, 3, swap_ab=True))
    fused.fused_experts(torch.zeros(num_tokens, k, dtype=torch.bfloat16), w1, w2, torch.full(ids.shape, 1 / top_k),
                        ids, config=config, **kwargs)
    names = []
    for fn, grid, args, launch_kwargs in calls:
        _, constexprs = bind(fn, args, launch_kwargs)
        if fn.__name__ == "moe_gemm_kernel":
            pair_blocks = constexprs[(fn.arg_names.index("PAIR_BLOCKS"),)]
            # unsorted: one row block per pair, times the output tiles
            assert pair_blocks is not any(name.startswith("align_") for name in names)
            if pair_blocks:
                assert grid[0] % (num_tokens * top_k) == 0
        names.append(fn.__name__)
    return names


GEMMS_AND_SUM = ["moe_gemm_kernel", "moe_gemm_kernel", "topk_sum_kernel"]
# w2 summing each token's slots itself, no top-k sum launch (fused_experts's sum_in_w2)
W1_AND_SUMMING_W2 = ["moe_gemm_kernel", "w2_token_sum_kernel"]
# sorting 512 experts takes the two-launch alignment (past align.SMALL_EXPERTS), 256 the one-program one
SORT_512 = ["align_count_kernel", "align_scatter_kernel"]


@needs_triton_jit
@pytest.mark.parametrize("tokens,top_k,experts,kwargs,expected", [
    (9, 10, 512, {}, SORT_512 + GEMMS_AND_SUM),  # past UNSORTED_MAX_TOKENS the default sorts
    (9, 10, 256, {}, ["align_small_kernel"] + GEMMS_AND_SUM),
    (1, 4, 8, {}, GEMMS_AND_SUM),
    (8, 10, 512, {}, GEMMS_AND_SUM),  # a small layer at 8 tokens reads a few kB twice: no alignment launch
    (8, 10, 512, {"unsorted": False}, SORT_512 + GEMMS_AND_SUM),  # forced either way
    (9, 10, 256, {"unsorted": True}, GEMMS_AND_SUM),
    (1, 4, 8, {"sum_in_w2": True}, W1_AND_SUMMING_W2),  # the sum forced into w2, also where the rows are sorted
    (9, 10, 256, {"sum_in_w2": True}, ["align_small_kernel"] + W1_AND_SUMMING_W2),
])
def test_unsorted_batches_launch_no_alignment(monkeypatch, tokens, top_k, experts, kwargs, expected):
    assert _recorded_launches(monkeypatch, tokens, top_k, experts, **kwargs) == expected


@needs_triton_jit
@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_unsorted_takes_a_bool_or_none(monkeypatch, bad):
    from moe_fsm.errors import KernelInputError

    with pytest.raises(KernelInputError, match="unsorted must be True, False or None"):
        _recorded_launches(monkeypatch, 2, 2, 16, unsorted=bad)


def _layer(seed: int, tokens: int, experts: int, top_k: int, k: int = 64, n: int = 48):
    """A float16 layer whose routing has pairs sharing an expert (tokens 0 and 1) and a slot of another rank (-1)."""
    gen = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(experts, 2 * n, k, generator=gen) / k**0.5).half()
    w2 = (torch.randn(experts, k, n, generator=gen) / n**0.5).half()
    x = torch.randn(tokens, k, generator=gen).half()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    ids[1, 0] = ids[0, 1]  # two tokens on one expert: read twice, unsorted
    ids[tokens - 1, top_k - 1] = -1
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1)
    local = ids >= 0
    ref = moe_reference(x, w1.double(), w2.double(), weights * local, ids.clamp(min=0))
    return x, w1, w2, weights, ids, ref


@interpreter
@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("fold_topk", [False, True])
@pytest.mark.parametrize("unsorted", [True, False, None])
def test_unsorted_and_sorted_layers_match_float64(poisoned, swap_ab, fold_topk, unsorted):
    from moe_fsm.kernels.triton_moe import GemmConfig, MoEConfig, fused_experts

    tokens, experts, top_k = 3, 32, 2  # 6 pairs over 32 experts of a few kB: the rule leaves them unsorted
    x, w1, w2, weights, ids, ref = _layer(7, tokens, experts, top_k)
    config = MoEConfig(16, GemmConfig(16, 32, 1, 4, 2, swap_ab=swap_ab), GemmConfig(32, 16, 1, 4, 2, swap_ab=swap_ab),
                       fold_topk=fold_topk)
    out = torch.full((tokens, x.shape[1]), math.nan, dtype=torch.float16)
    fused_experts(x, w1, w2, weights, ids, out=out, config=config, unsorted=unsorted)
    assert bool(torch.isfinite(out).all())
    assert float((out.double() - ref).norm() / ref.norm()) <= TOL


def test_the_benchmark_summarizes_the_other_layout_column():
    """bench_experts_vs_vllm.py's ``other`` column (the layout the rule did not pick): other / ours per point, its
    geometric mean, and the points where the rule's layout was the slower, named with the layout the rule took."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "bench_experts_vs_vllm.py"
    spec = importlib.util.spec_from_file_location("bench_experts_vs_vllm", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [
        {"series": "qwen3-next-tp2", "tokens": 8, "ours_unsorted": False, "other_over_ours": 0.9, "other_rel_diff": 2e-3},
        {"series": "olmoe-like", "tokens": 8, "ours_unsorted": False, "other_over_ours": 1.6, "other_rel_diff": 1e-3},
        {"series": "olmoe-like", "tokens": 1, "ours_us": 10.0},  # one token: no other layout timed
    ]
    summary = bench.summarize({"results": rows})["other_layout"]
    assert summary["points"] == 2
    assert summary["geomean_other_over_ours"] == pytest.approx(math.sqrt(0.9 * 1.6), abs=1e-3)
    assert summary["rule_slower"] == ["qwen3-next-tp2/8 (sorted): x0.900"]
    assert summary["max_rel_diff_vs_ours"] == 2e-3
