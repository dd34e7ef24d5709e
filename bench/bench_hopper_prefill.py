"""The Hopper TMA kernels (``MoEConfig.hopper``) against the pointer-load kernels at prefill sizes, on one GPU.

For each layer shape and token count it times the whole layer (``tuning.time_graph``: CUDA-graph replays
on fresh routings, L2 flushed) with the shipped config, the same tiles through the TMA kernels (plain and
persistent), and a sweep of TMA tiles; prints µs, TFLOP/s (6 * pairs * N * K flops) and the relative
difference from the shipped config's output, then one call's kernels in order (torch profiler) for the
fastest TMA variant, so the time of each GEMM shows. Writes everything as JSON (after each shape and
token count, so a run cut short keeps what it measured).

Every config of the plan goes through ``validate_config`` first (a refused one is printed and left out),
then all are compiled in ``--workers`` processes, for at most ``--compile-timeout-s``; ``--budget-s`` stops
starting new measurements once that many seconds have passed since the start.

    python bench/bench_hopper_prefill.py [--shapes ...] [--tokens 2048 8192] [--json out.json] [--no-sweep | --gluon]
                                 [--budget-s S] [--compile-timeout-s S] [--dry-run]

``--dry-run`` prints the plan (and the refusals) without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moe_fsm.errors import KernelInputError  # noqa: E402
from moe_fsm.kernels.triton_moe.config import GemmConfig, MoEConfig, default_config, validate_config  # noqa: E402
from moe_fsm.kernels.triton_moe.tuning import (  # noqa: E402
    NAMED_SHAPES,
    layer_fn,
    make_weights,
    precompile,
    routings,
    shipped_config,
    time_graph,
)


def tma(config: MoEConfig, persistent: bool, ws: bool = False) -> MoEConfig:
    return replace(
        config, hopper=True, w1=replace(config.w1, swap_ab=False, persistent=persistent, warp_specialize=ws),
        w2=replace(config.w2, swap_ab=False, persistent=persistent, warp_specialize=ws),
    )


COMBOS = ((True, True, False), (True, True, True), (False, False, False), (False, False, True), (True, False, True),
          (False, True, True))  # (persistent, gather_input, paired)
# the persistent tile loop flattened into the K loop (GemmConfig.flatten): on the first tile of each dtype only,
# (persistent, gather_input, paired)
FLAT_COMBOS = ((True, False, True), (True, True, True), (True, False, False))
# the top-k sum folded into the w2 GEMM (fp32 atomics into the token's row instead of a [pairs, K] output that
# topk_sum then reads again): on the first tile of each dtype only
FOLD_COMBOS = ((True, False, True), (True, True, True), (False, False, True))
# warp specialization: 4-warp tiles only (Triton runs them as 12 warps), the gathered input only (the w1 GEMM's
# pointer loads cannot be specialized) and no paired loads; validate_config refuses the rest
WS_COMBOS = ((False, True, False), (True, True, False))


def sweep(fp8: str | None) -> list[tuple[str, MoEConfig]]:
    """TMA tiles around what Hopper GEMMs run at, each under a few (persistent, gather_input, paired) choices;
    the 4-warp tiles also warp-specialized."""
    bk = 128 if fp8 else 64
    out = []
    tiles = [(128, 128, 256, 8, 4, 8), (128, 128, 256, 8, 3, 8), (128, 128, 128, 4, 3, 8)]
    if fp8 in ("tensor", "channel"):
        tiles = [(128, 128, 256, 8, 4, 16), (128, 128, 256, 8, 3, 16), (64, 128, 128, 4, 4, 8)]
    if fp8 == "block":
        # block_m 128 too: two 64-row warpgroups, each with a whole-width wgmma (block_m 64 at 8 warps splits the
        # columns between them)
        tiles = [(64, 128, 256, 8, 3, 16), (64, 64, 128, 4, 4, 8), (64, 128, 128, 8, 3, 8), (128, 128, 128, 8, 3, 8),
                 (128, 64, 128, 8, 4, 8), (64, 128, 128, 4, 3, 8), (64, 128, 128, 4, 2, 8)]
    for index, (bm, n1, n2, warps, stages, group_m) in enumerate(tiles):
        combos = [(p, g, pa, False, False, False) for p, g, pa in COMBOS]
        if warps == 4:
            combos += [(p, g, pa, True, False, False) for p, g, pa in WS_COMBOS]
        if index == 0:
            combos += [(p, g, pa, False, True, False) for p, g, pa in FOLD_COMBOS]
            combos += [(p, g, pa, False, False, True) for p, g, pa in FLAT_COMBOS]
        for persistent, gather, paired, ws, fold, flat in combos:
            c = MoEConfig(
                bm, GemmConfig(n1, bk, group_m, warps, stages, persistent=persistent, paired=paired, warp_specialize=ws,
                               flatten=flat),
                GemmConfig(n2, bk, group_m, warps, stages, persistent=persistent, warp_specialize=ws, flatten=flat),
                fold, True, gather,
            )
            flags = "".join(
                f for f, on in (("-pers", persistent), ("-flat", flat), ("-gather", gather), ("-paired", paired),
                                ("-ws", ws), ("-fold", fold)) if on
            )
            out.append((f"tma{flags} bm{bm} w1 {n1} w2 {n2} k{bk} g{group_m} w{warps}s{stages}", c))
    return out


def gluon_sweep(fp8: str | None) -> list[tuple[str, MoEConfig]]:
    """Tiles for the Gluon block-FP8 kernel (``MoEConfig.gluon``): 64-row wgmmas per warpgroup, w1 gate plus up
    boxes of 32 or 64 rows, w2 tiles of 64 or 128 columns."""
    if fp8 != "block":
        return []
    # (block_m, w1, w2, warps, stages, group_m, warp-specialized, persistent)
    tiles = [(64, 64, 128, 4, 4, 8, False, False), (128, 64, 128, 8, 4, 8, True, False),
             (128, 64, 128, 8, 5, 8, True, False), (128, 64, 128, 8, 4, 8, True, True),
             (128, 64, 128, 8, 5, 8, True, True), (128, 64, 128, 8, 3, 8, True, True),
             (128, 64, 128, 8, 4, 16, True, True), (128, 64, 128, 8, 4, 4, True, True),
             (64, 64, 128, 4, 4, 8, True, True), (64, 64, 128, 4, 6, 8, True, True),
             (128, 32, 64, 8, 6, 8, True, True), (128, 64, 64, 8, 5, 8, True, True)]
    out = []
    for bm, n1, n2, warps, stages, group_m, ws, persistent in tiles:
        flags = dict(warp_specialize=ws, persistent=persistent)
        label = "gluon" + "-ws" * ws + "-pers" * persistent
        out.append((f"{label} bm{bm} w1 {n1} w2 {n2} g{group_m} w{warps}s{stages}",
                    MoEConfig(bm, GemmConfig(n1, 128, group_m, warps, stages, **flags),
                              GemmConfig(n2, 128, group_m, warps, stages, **flags), False, True, True, True)))
    return out


def plan_for(name: str, num_tokens: int, no_sweep: bool, gluon: bool = False) -> list[tuple[str, MoEConfig]]:
    """(label, config) to time for one shape and token count: the shipped config first, refused configs left out."""
    shape = NAMED_SHAPES[name]
    block_fp8 = shape.fp8 == "block"
    base = shipped_config(shape, num_tokens) or default_config(
        shape.num_experts, shape.intermediate, shape.hidden, shape.top_k, num_tokens, block_fp8=block_fp8,
        fp8=shape.fp8 is not None,
    )
    variants = [("shipped", base), ("shipped+fold", replace(base, fold_topk=True)), ("shipped+tma", tma(base, False)),
                ("shipped+tma-pers", tma(base, True))]
    if gluon:
        variants += gluon_sweep(shape.fp8)
    elif not no_sweep:
        variants += sweep(shape.fp8)
    kept = []
    for label, config in variants:
        try:
            validate_config(config, block_fp8=block_fp8)
        except KernelInputError as exc:
            print(f"{name} T={num_tokens} {label}: refused, left out: {exc}", flush=True)
            continue
        kept.append((label, config))
    return kept


def kernel_times(fn, args) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return [(e.name[:40], round(e.device_time_total, 1)) for e in events]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3-fp8-block",
                                                     "mixtral-8x7b-fp8-tensor", "qwen3-30b-a3b-fp8-channel"])
    ap.add_argument("--tokens", nargs="*", type=int, default=[2048, 8192])
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--rep-ms", type=float, default=40.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--gluon", action="store_true", help="time the Gluon block-FP8 tiles instead of the TMA sweep")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new measurement after this many seconds from the start (the JSON keeps what ran)")
    ap.add_argument("--compile-timeout-s", type=float, default=None,
                    help="stop the parallel precompile after this long (what is left compiles on first use)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    args = ap.parse_args()
    start = time.time()
    unknown = [n for n in args.shapes if n not in NAMED_SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {sorted(NAMED_SHAPES)}")

    plans = {(name, t): plan_for(name, t, args.no_sweep, args.gluon) for name in args.shapes for t in args.tokens}
    if args.dry_run:
        for (name, t), variants in plans.items():
            for label, config in variants:
                print(f"{name} T={t} {label}: {config.to_json()}")
        print(f"{sum(len(v) for v in plans.values())} variants")
        return
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    t0 = time.time()
    failures = precompile([(NAMED_SHAPES[n], t, c) for (n, t), vs in plans.items() for _, c in vs], args.workers,
                          timeout_s=args.compile_timeout_s)
    print(f"precompiled in {time.time() - t0:.0f} s; {len(failures)} failures", flush=True)
    for f in failures:
        print("  cannot build:", f[:300], flush=True)

    results = []
    for name in args.shapes:
        shape = NAMED_SHAPES[name]
        if args.budget_s is not None and time.time() - start > args.budget_s:
            print(f"{name}: skipped, past --budget-s {args.budget_s:.0f}", flush=True)
            continue
        weights = make_weights(shape)
        for t in args.tokens:
            pairs = t * shape.top_k
            flops = 6.0 * pairs * shape.intermediate * shape.hidden
            routes = routings(t, shape.num_experts, shape.top_k, 2, seed=t)
            gen = torch.Generator(device="cuda").manual_seed(t)
            inputs = [(torch.randn(t, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=gen), g, ids)
                      for g, ids in routes]
            expected = None
            best = None
            for label, config in plans[(name, t)]:
                if args.budget_s is not None and time.time() - start > args.budget_s:
                    print(f"{name} T={t} {label}: skipped, past --budget-s {args.budget_s:.0f}", flush=True)
                    continue
                fn = layer_fn(shape, weights, config)
                try:
                    out = fn(*inputs[0]).float()
                    if expected is None:
                        expected = out
                    diff = float((out - expected).norm() / expected.norm())
                    us = time_graph(fn, inputs, args.rep_ms)
                except Exception as exc:
                    torch.cuda.synchronize()
                    print(f"{name} T={t} {label}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                tflops = flops / us / 1e6
                row = dict(shape=name, tokens=t, label=label, us=round(us, 1), tflops=round(tflops, 1),
                           rel_diff=diff, config=config.to_json())
                results.append(row)
                print(f"{name:24s} T={t:5d} {label:48s} {us:9.1f} us {tflops:7.1f} TF/s diff {diff:.1e}", flush=True)
                if config.hopper and diff < 2e-2 and (best is None or us < best[0]):
                    best = (us, label, config)
            if best is not None:
                times = kernel_times(layer_fn(shape, weights, best[2]), inputs[0])
                print(f"  kernels of {best[1]}: {times}", flush=True)
                results.append(dict(shape=name, tokens=t, label="kernels:" + best[1], kernels=times))
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
        del weights
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
