"""CPU time of TorchExperts per MoE layer, and how much of it is not matrix products.

For the presets' layer shapes (expert count and top-k as in the models, hidden and
intermediate sizes divided by ``--scale`` so the whole run takes a couple of
minutes on 2 cores) and several token counts, it reports the median time of one
``TorchExperts.apply`` call and of the two GEMMs per active expert replayed alone
on the same shapes; the difference is the share spent outside matrix products
(grouping, gathers, the activation, scatters, Python per expert). It also reports
the whole modular-kernel call (prepare, experts, finalize with the top-k sum).

    python bench/bench_cpu_experts.py [--scale 8] [--tokens 1 16 64 256 1024] [--dtype bfloat16] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from moe_fsm.experts.torch_experts import TorchExperts
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.kernels.grouping import group_by_expert
from moe_fsm.modular.interfaces import ExpertScales, PreparedTokens
from moe_fsm.modular.kernel import ModularKernel
from moe_fsm.prepare_finalize.local import LocalPrepareFinalize


@dataclass(frozen=True)
class Preset:
    name: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int


PRESETS = (
    Preset("Qwen3-30B-A3B-like", 128, 2048, 768, 8),
    Preset("Mixtral-8x7B-like", 8, 4096, 14336, 2),
    Preset("DeepSeek-V3-like", 256, 7168, 2048, 8),
)


def median_seconds(fn: Callable[[], object], budget_s: float = 0.4, max_reps: int = 25) -> float:
    """Median wall time of ``fn`` after one warm-up call; repeats while the budget lasts (at least 3)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    reps = max(3, min(max_reps, int(budget_s / max(first, 1e-6))))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def routing(num_tokens: int, layer: MoELayer, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, uniformly spread, like a balanced router."""
    ids = torch.argsort(torch.rand(num_tokens, layer.num_experts, generator=gen), dim=1)[:, : layer.top_k]
    weights = torch.softmax(torch.randn(num_tokens, layer.top_k, generator=gen), dim=1)
    return weights, ids


def gemm_replay(layer: MoELayer, hidden: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> Callable[[], None]:
    """Only the two matrix products per active expert, on inputs of the shapes the experts see."""
    groups = group_by_expert(ids, layer.num_experts)
    rows = hidden[groups.token]
    h = torch.empty(rows.shape[0], 2 * layer.intermediate_size, dtype=hidden.dtype)
    inter = torch.randn(rows.shape[0], layer.intermediate_size, dtype=hidden.dtype)
    y = torch.empty_like(rows)
    parts = [(e, groups.rows(e)) for e in groups.active_experts]

    def run() -> None:
        for e, part in parts:
            torch.mm(rows[part], w1[e].T, out=h[part])
        for e, part in parts:
            torch.mm(inter[part], w2[e].T, out=y[part])

    return run


def bench_layer(preset: Preset, scale: int, tokens: list[int], dtype: str, gen: torch.Generator) -> list[dict]:
    layer = MoELayer(
        num_experts=preset.num_experts, top_k=preset.top_k, hidden_size=preset.hidden_size // scale,
        intermediate_size=preset.intermediate_size // scale, dtype=dtype,
    )
    torch_dtype = getattr(torch, dtype)
    k, n = layer.hidden_size, layer.intermediate_size
    w1 = (torch.randn(layer.num_experts, 2 * n, k, generator=gen) / k**0.5).to(torch_dtype)
    w2 = (torch.randn(layer.num_experts, k, n, generator=gen) / n**0.5).to(torch_dtype)
    experts = TorchExperts(layer)
    kernel = ModularKernel(LocalPrepareFinalize(), experts, layer)
    rows = []
    for m in tokens:
        hidden = torch.randn(m, k, generator=gen).to(torch_dtype)
        weights, ids = routing(m, layer, gen)
        prepared = PreparedTokens(hidden=hidden, scale=None, topk_ids=ids, topk_weights=weights)
        experts_s = median_seconds(lambda: experts.apply(prepared, w1, w2, ExpertScales(), apply_router_weight_on_input=False))
        gemm_s = median_seconds(gemm_replay(layer, hidden, ids, w1, w2))
        kernel_s = median_seconds(lambda: kernel(hidden, w1, w2, weights, ids))
        rows.append(dict(
            layer=preset.name, shape=f"E={layer.num_experts} K={k} N={n} top{layer.top_k}", tokens=m,
            active=len(group_by_expert(ids, layer.num_experts).active_experts),
            experts_ms=experts_s * 1e3, gemm_ms=gemm_s * 1e3, kernel_ms=kernel_s * 1e3,
            outside=max(0.0, 1 - gemm_s / experts_s),
        ))
    return rows


def print_table(rows: list[dict]) -> None:
    header = f"{'layer':20s} {'shape':28s} {'tokens':>6s} {'active':>6s} {'experts ms':>10s} {'GEMM ms':>9s} {'outside GEMM':>12s} {'kernel ms':>9s}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['layer']:20s} {r['shape']:28s} {r['tokens']:6d} {r['active']:6d} {r['experts_ms']:10.2f} "
            f"{r['gemm_ms']:9.2f} {r['outside']:11.0%} {r['kernel_ms']:9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=8, help="divide hidden and intermediate sizes by this (default 8)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    print(
        f"TorchExperts on CPU: hidden and intermediate sizes divided by {args.scale}; dtype {args.dtype}; "
        f"{args.threads} threads; torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}"
    )
    start = time.perf_counter()
    rows = [row for preset in PRESETS for row in bench_layer(preset, args.scale, args.tokens, args.dtype, gen)]
    print_table(rows)
    print(f"(medians of repeated calls; 'outside GEMM' = 1 - GEMM replay / experts; total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
