"""Tune the Triton fused-MoE configs on this GPU and write the table the kernels read.

For each shape, dtype and token count it tries a few row blocks (BLOCK_M, chosen
from the mean rows per expert) and, for each, a short list of tile/launch
candidates for the w1 GEMM and then for the w2 GEMM (their shapes differ, so
they are tuned apart; they share BLOCK_M because they share the alignment). The
fastest pair per token count goes to
``src/moe_fsm/kernels/triton_moe/configs/<device>.json``.

Compiling ~100 kernel variants serially would take minutes, so worker processes
compile them first on small problems with the same strides and dtypes (Triton's
on-disk cache then serves the main process), and the main process times them on
the real shapes with ``triton.testing.do_bench`` (median, L2 flushed per run).
"""

from __future__ import annotations

import argparse
from dataclasses import astuple
import itertools
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))

from bench_gpu import SHAPES, TOKENS, Shape, routings, weights  # noqa: E402

from moe_fsm.kernels.triton_moe import (  # noqa: E402
    Fp8Spec,
    GemmConfig,
    MoEConfig,
    align_tokens,
    pair_blocks,
    quantize_activation,
    w1_gemm,
    w2_gemm,
)
from moe_fsm.kernels.triton_moe.config import config_file_name, shape_key, validate_config  # noqa: E402

# (block_n, block_k, group_m, num_warps, num_stages); w1's block_n is the width of act(gate)*up,
# so its tile reads 2*block_n weight rows
SMALL_W1 = [
    (16, 128, 1, 4, 4), (16, 256, 1, 4, 3), (32, 128, 1, 4, 4), (64, 128, 1, 4, 4),
    (64, 256, 1, 4, 3), (128, 128, 1, 4, 3), (32, 256, 1, 4, 3), (64, 64, 1, 4, 5),
]
SMALL_W2 = [
    (16, 256, 1, 4, 3), (32, 128, 1, 4, 4), (64, 128, 1, 4, 4), (128, 128, 1, 4, 3),
    (32, 256, 1, 4, 3), (64, 256, 1, 4, 3), (128, 64, 1, 4, 4), (256, 64, 1, 4, 3),
]
LARGE_W1 = [
    (64, 64, 8, 4, 4), (64, 64, 8, 8, 3), (128, 64, 8, 8, 3), (128, 64, 8, 8, 4),
    (64, 128, 8, 4, 3), (128, 64, 8, 4, 3), (32, 64, 8, 4, 4), (64, 64, 8, 8, 4),
]
LARGE_W2 = [
    (128, 64, 8, 4, 4), (128, 64, 8, 8, 3), (128, 64, 8, 8, 4), (256, 64, 8, 8, 3),
    (256, 64, 8, 8, 4), (128, 128, 8, 8, 3), (64, 128, 8, 4, 3), (64, 64, 8, 4, 4),
]
FP8_W1 = [(128, 128, 1, 4, 3), (128, 128, 1, 4, 4), (128, 64, 1, 4, 4), (128, 128, 8, 8, 3), (128, 64, 8, 8, 4)]
FP8_W2 = [(64, 128, 1, 4, 4), (128, 128, 1, 4, 3), (128, 128, 8, 8, 3), (64, 128, 8, 4, 3), (128, 64, 8, 4, 4), (256, 128, 8, 8, 3)]


def block_ms(shape: Shape, tokens: int) -> list[int]:
    rows = tokens * shape.top_k / shape.num_experts
    if rows < 4:
        return [16]
    if rows < 16:
        return [16, 32]
    if rows < 64:
        return [32, 64]
    if rows < 256:
        return [64, 128]
    return [128, 64]


def candidates(quant: str, block_m: int) -> tuple[list[GemmConfig], list[GemmConfig]]:
    if quant == "fp8_block":
        w1, w2 = FP8_W1, FP8_W2
    elif block_m <= 32:
        w1, w2 = SMALL_W1, SMALL_W2
    else:
        w1, w2 = LARGE_W1, LARGE_W2
    if block_m <= 32:  # grouping row blocks only pays when there are many
        w1 = [c for c in w1 if c[2] == 1] or [(c[0], c[1], 1, c[3], c[4]) for c in w1]
        w2 = [c for c in w2 if c[2] == 1] or [(c[0], c[1], 1, c[3], c[4]) for c in w2]
    return [GemmConfig(*c) for c in dict.fromkeys(w1)], [GemmConfig(*c) for c in dict.fromkeys(w2)]


class Problem:
    """One shape/dtype/routing prepared for timing the two GEMMs with any config."""

    def __init__(self, shape: Shape, quant: str, w1, w2, scales, g: torch.Tensor, ids: torch.Tensor):
        self.shape, self.quant, self.w1, self.w2, self.scales = shape, quant, w1, w2, scales
        self.spec = Fp8Spec("block", "group") if quant == "fp8_block" else None
        self.g, self.ids = g, ids
        x = torch.randn(ids.shape[0], shape.hidden, device="cuda", dtype=torch.bfloat16)
        self.a, self.a_scale = quantize_activation(x, "group") if self.spec else (x, None)
        self.flat_g = self.g.reshape(-1)
        self.routing = {}

    def rows(self, block_m: int):
        """The row source fused_experts would use: pair blocks for one token, else the sorted alignment."""
        if block_m not in self.routing:
            align = pair_blocks if self.ids.shape[0] == 1 else align_tokens
            self.routing[block_m] = align(self.ids, self.shape.num_experts, block_m)
        return self.routing[block_m]

    def run_w1(self, block_m: int, cfg: GemmConfig):
        return w1_gemm(
            self.a, self.a_scale, self.w1, self.scales.w1_scale, self.rows(block_m), spec=self.spec,
            activation="silu", swiglu_limit=None, row_weights=None, a2_scale=None, config=cfg, out_dtype=torch.bfloat16,
        )

    def run_w2(self, block_m: int, cfg: GemmConfig, inter):
        return w2_gemm(
            inter[0], inter[1], self.w2, self.scales.w2_scale, self.rows(block_m), spec=self.spec,
            row_weights=self.flat_g, config=cfg, out_dtype=torch.bfloat16,
        )


def _compile_jobs(jobs: list[tuple]) -> list[str]:
    """Worker: compile each (shape, quant, block_m, which, config) on a 2-expert copy of the shape."""
    failures = []
    problems = {}
    for shape_name, quant, single, block_m, which, cfg_tuple in jobs:
        shape = SHAPES[shape_name]
        small = Shape(shape.name, 2, shape.hidden, shape.intermediate, shape.top_k)
        key = (shape_name, quant, single)
        if key not in problems:
            problems.clear()
            torch.cuda.empty_cache()
            w1, w2, scales = weights(small, quant)
            # both experts of the copy, repeated across the real top_k (A_ROW_DIV is compiled in);
            # one token compiles the pair-block variant fused_experts uses for one token
            ids = torch.randint(0, 2, (1 if single else 16, shape.top_k), device="cuda", dtype=torch.int32)
            problems[key] = Problem(small, quant, w1, w2, scales, torch.rand(ids.shape, device="cuda"), ids)
        p = problems[key]
        cfg = GemmConfig(*cfg_tuple)
        try:
            inter = p.run_w1(block_m, cfg if which == "w1" else GemmConfig(128 if p.spec else 64, 128, 1, 4, 3))
            if which == "w2":
                p.run_w2(block_m, cfg, inter)
            torch.cuda.synchronize()
        except Exception as exc:  # record and move on: a config that cannot compile is just not a candidate
            failures.append(
                f"{shape_name} {quant} single={single} BM={block_m} {which} {cfg_tuple}: {type(exc).__name__}: {str(exc)[:120]}"
            )
    return failures


def precompile(plan: list[tuple[str, str, int]], workers: int) -> list[str]:
    jobs = []
    for shape_name, quant, tokens in plan:
        for block_m in block_ms(SHAPES[shape_name], tokens):
            c1, c2 = candidates(quant, block_m)
            single = tokens == 1
            jobs += [(shape_name, quant, single, block_m, "w1", astuple(c)) for c in c1]
            jobs += [(shape_name, quant, single, block_m, "w2", astuple(c)) for c in c2]
    jobs = list(dict.fromkeys(jobs))
    # jobs are dealt round-robin; each worker takes its share slice by slice (shape, dtype, one token or
    # many), so it builds each slice's small weights once
    jobs.sort(key=lambda j: j[:3])
    chunks = [jobs[i::workers] for i in range(workers)]
    chunks = [sorted(c, key=lambda j: j[:3]) for c in chunks if c]
    with mp.get_context("spawn").Pool(len(chunks)) as pool:
        return list(itertools.chain.from_iterable(pool.map(_compile_jobs, chunks)))


def bench_ms(fn, rep: float) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(2.0, rep / 5), rep=rep, return_mode="median"))


def tune_point(problem: Problem, tokens: int, log) -> tuple[MoEConfig, float]:
    best = None
    for block_m in block_ms(problem.shape, tokens):
        c1, c2 = candidates(problem.quant, block_m)
        rep = 10.0 if tokens < 2048 else 25.0
        t1 = []
        for cfg in c1:
            try:
                t1.append((bench_ms(lambda: problem.run_w1(block_m, cfg), rep), cfg))
            except Exception as exc:
                log(f"  skip w1 BM={block_m} {cfg}: {type(exc).__name__}")
        if not t1:
            continue
        ms1, best1 = min(t1, key=lambda t: t[0])
        inter = problem.run_w1(block_m, best1)
        t2 = []
        for cfg in c2:
            try:
                t2.append((bench_ms(lambda: problem.run_w2(block_m, cfg, inter), rep), cfg))
            except Exception as exc:
                log(f"  skip w2 BM={block_m} {cfg}: {type(exc).__name__}")
        if not t2:
            continue
        ms2, best2 = min(t2, key=lambda t: t[0])
        log(f"  BM={block_m:3d} w1 {ms1 * 1e3:9.1f} us {best1}  w2 {ms2 * 1e3:9.1f} us {best2}")
        if best is None or ms1 + ms2 < best[1]:
            best = (MoEConfig(block_m, best1, best2), ms1 + ms2)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--out", type=Path, help="table path (default: the package's configs/<device>.json)")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    out = args.out or ROOT.parent / "src" / "moe_fsm" / "kernels" / "triton_moe" / "configs" / config_file_name(device)
    import triton

    plan = [(s, "bf16", t) for s in args.shapes for t in args.tokens]
    if "deepseek-v3" in args.shapes:
        plan += [("deepseek-v3", "fp8_block", t) for t in args.tokens]
    start = time.time()
    failures = precompile(plan, args.workers)
    print(f"precompiled in {time.time() - start:.0f} s; {len(failures)} candidates failed to build", flush=True)
    for f in failures:
        print("  " + f)
    table = {
        "device": device, "torch": torch.__version__, "triton": triton.__version__,
        "generated_by": "bench/tune_triton.py", "date": time.strftime("%Y-%m-%d"), "configs": {}, "best_us": {},
    }
    for shape_name, quant in dict.fromkeys((s, q) for s, q, _ in plan):
        shape = SHAPES[shape_name]
        w1, w2, scales = weights(shape, quant)
        dtype = "bf16" if quant == "bf16" else "fp8_block"
        key = shape_key(shape.num_experts, shape.intermediate, shape.hidden, dtype)
        for tokens in [t for s, q, t in plan if (s, q) == (shape_name, quant)]:
            print(f"{key} tokens={tokens}", flush=True)
            (g, ids), = routings(tokens, shape, 1, seed=tokens)
            problem = Problem(shape, quant, w1, w2, scales, g, ids)
            best = tune_point(problem, tokens, print)
            if best is None:
                continue
            validate_config(best[0], block_fp8=quant == "fp8_block")
            table["configs"].setdefault(key, {})[str(tokens)] = best[0].to_json()
            table["best_us"].setdefault(key, {})[str(tokens)] = round(best[1] * 1e3, 1)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(table, indent=1) + "\n")
        del w1, w2, scales
        torch.cuda.empty_cache()
    print(f"wrote {out} in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
