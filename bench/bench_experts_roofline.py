"""Benchmark the MoE experts backends on a CUDA GPU against the roofline.

For each shape (Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3) and token count, and
for each backend present (the torch reference loop, torch grouped GEMM, Triton),
it times the experts' whole computation, top-k reduction included (not the
prepare/finalize around it), and compares it with the roofline of the two
ceilings it measures in the same run: device-to-device copy bandwidth and a
large bf16 matrix product (plus an FP8 one for FP8 points).

Bytes are those of the experts a batch actually hits (both weight matrices and
their scales) plus the activations read and written; FLOPs are 2*T*top_k*3*N*K.
Roofline time = max(bytes / copy bandwidth, FLOPs / matmul rate).

Timing (METHOD.md): medians of ``triton.testing.do_bench``, which flushes L2
before every run. Graph-capturable backends (Triton, grouped GEMM: neither waits
on the host) are timed as CUDA-graph replays of R calls on R different routings
(so no call finds its experts' weights left in L2 by the previous one), divided
by R: that is the time a serving engine running graphs would see. Their eager
time (Python launches included) is reported too. The torch loop synchronizes
with the host every call, so it is timed eagerly.

Writes JSON, a Markdown table and a PNG plot (default ``bench-out/gpu_moe.*``; docs/perf/experts_roofline.md shows
the latest table).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from moe_fsm.inputs.layer import MoELayer  # noqa: E402
from moe_fsm.inputs.quant import QuantScheme  # noqa: E402
from moe_fsm.backends.grouped_mm_eligibility import grouped_mm_eligibility  # noqa: E402
from moe_fsm.kernels.grouped_mm import grouped_mm_moe  # noqa: E402
from moe_fsm.modular.interfaces import ExpertScales, PreparedTokens  # noqa: E402

TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
BLOCK = 128
TARGETS = {"small_tokens": (32, 1.35), "large_tokens": (2048, 1.6), "beat_grouped_up_to": 512}


@dataclass(frozen=True)
class Shape:
    name: str
    num_experts: int
    hidden: int
    intermediate: int
    top_k: int


SHAPES = {
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 128, 2048, 768, 8),
    "mixtral-8x7b": Shape("mixtral-8x7b", 8, 4096, 14336, 2),
    "deepseek-v3": Shape("deepseek-v3", 256, 7168, 2048, 8),
}


def do_bench(fn: Callable[[], object], rep_ms: float = 100.0) -> float:
    """Median milliseconds of fn, L2 flushed before each run (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(5.0, rep_ms / 4), rep=rep_ms, return_mode="median"))


def measure_ceilings() -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and bf16 / FP8 8192^3 matmul rates."""
    n_bytes = 2 << 30
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), rep_ms=200)
    del src, dst
    size = 8192
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ b, rep_ms=300)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    fp8_ms = do_bench(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), rep_ms=300)
    flops = 2 * size**3
    return {
        "copy_GBps": 2 * n_bytes / copy_ms / 1e6,
        "bf16_matmul_TFLOPs": flops / mm_ms / 1e9,
        "fp8_matmul_TFLOPs": flops / fp8_ms / 1e9,
        "copy_bytes": 2 * n_bytes,
        "matmul_size": size,
    }


def routings(num_tokens: int, shape: Shape, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` independent random top-k routings (distinct experts per token, normalized weights)."""
    out = []
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(count):
        scores = torch.rand(num_tokens, shape.num_experts, device="cuda", generator=gen)
        w, ids = scores.topk(shape.top_k, dim=1)
        out.append(((w / w.sum(1, keepdim=True)).float(), ids.to(torch.int32)))
    return out


def weights(shape: Shape, quant: str):
    """bf16 N(0, 1/K)/N(0, 1/N) experts, or the same drawn as 128x128-block FP8 with scales."""
    e, k, n = shape.num_experts, shape.hidden, shape.intermediate
    gen = torch.Generator(device="cuda").manual_seed(0)
    if quant == "bf16":
        w1 = torch.randn(e, 2 * n, k, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(k**-0.5)
        w2 = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(n**-0.5)
        return w1, w2, ExpertScales()
    w1 = torch.randn(e, 2 * n, k, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(100).clamp_(-448, 448).to(torch.float8_e4m3fn)
    w2 = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(100).clamp_(-448, 448).to(torch.float8_e4m3fn)
    s1 = (0.5 + torch.rand(e, -(-2 * n // BLOCK), -(-k // BLOCK), device="cuda", generator=gen)) * (k**-0.5 / 100)
    s2 = (0.5 + torch.rand(e, -(-k // BLOCK), -(-n // BLOCK), device="cuda", generator=gen)) * (n**-0.5 / 100)
    return w1, w2, ExpertScales(w1_scale=s1, w2_scale=s2)


def expert_bytes(shape: Shape, quant: str) -> int:
    k, n = shape.hidden, shape.intermediate
    if quant == "bf16":
        return 3 * n * k * 2
    scale_blocks = -(-2 * n // BLOCK) * -(-k // BLOCK) + -(-k // BLOCK) * -(-n // BLOCK)
    return 3 * n * k + 4 * scale_blocks


def layer_for(shape: Shape, quant: str) -> MoELayer:
    return MoELayer(
        quant=QuantScheme.unquantized() if quant == "bf16" else QuantScheme.fp8("block", "group"),
        num_experts=shape.num_experts, top_k=shape.top_k, hidden_size=shape.hidden,
        intermediate_size=shape.intermediate, dtype="bfloat16",
    )


def make_backends(shape: Shape, quant: str, w1, w2, scales: ExpertScales) -> dict[str, tuple[Optional[Callable], bool, str]]:
    """name -> (fn(x, g, ids) or None, graph-capturable, note)."""
    layer = layer_for(shape, quant)
    backends: dict[str, tuple[Optional[Callable], bool, str]] = {}

    try:
        from moe_fsm.kernels.triton_moe import Fp8Spec, fused_experts

        spec = Fp8Spec("block", "group") if quant != "bf16" else None
        kw = {} if spec is None else {"fp8": spec, "w1_scale": scales.w1_scale, "w2_scale": scales.w2_scale}
        backends["triton"] = (lambda x, g, ids: fused_experts(x, w1, w2, g, ids, **kw), True, "")
    except ImportError as exc:
        backends["triton"] = (None, False, f"unavailable: {exc}")

    ok, reason = grouped_mm_eligibility(layer, torch.cuda.get_device_capability(), torch.__version__)
    if ok:
        backends["grouped_mm"] = (lambda x, g, ids: grouped_mm_moe(x, w1, w2, g, ids), True, reason)
    else:
        backends["grouped_mm"] = (None, False, f"ineligible: {reason}")

    try:
        from moe_fsm.experts.torch_experts import TorchExperts
        from moe_fsm.prepare_finalize.reduce import reduce_contiguous

        experts = TorchExperts(layer)
        quantizer = experts.input_quantizer(scales)

        def torch_loop(x, g, ids):
            hidden, scale = quantizer(x) if quantizer is not None else (x, None)
            per_slot = experts.apply(
                PreparedTokens(hidden=hidden, scale=scale, topk_ids=ids, topk_weights=g), w1, w2, scales,
                apply_router_weight_on_input=False,
            )
            out = torch.empty_like(x)
            reduce_contiguous(out, per_slot, g, apply_router_weight_on_input=False)
            return out

        backends["torch"] = (torch_loop, False, "TorchExperts (loop over active experts) + finalize's weighted sum")
    except ImportError:
        def torch_loop(x, g, ids):
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for e in torch.unique(ids).tolist():
                token, slot = (ids == e).nonzero(as_tuple=True)
                h = x[token] @ w1[e].T
                gate, up = h.chunk(2, dim=-1)
                y = (torch.nn.functional.silu(gate) * up) @ w2[e].T
                out.index_add_(0, token, y.float() * g[token, slot, None])
            return out.to(x.dtype)

        backends["torch"] = (torch_loop if quant == "bf16" else None, False, "per-expert torch loop")
    return backends


def time_graph(fn: Callable, inputs: list, rep_ms: float) -> float:
    """Median µs per call of a CUDA graph that replays fn on each input set once."""
    for args in inputs:
        fn(*args)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in inputs:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in inputs:
            fn(*args)
    ms = do_bench(graph.replay, rep_ms=rep_ms)
    del graph
    return ms * 1e3 / len(inputs)


def time_eager(fn: Callable, args: tuple, rep_ms: float) -> float:
    fn(*args)
    torch.cuda.synchronize()
    return do_bench(lambda: fn(*args), rep_ms=rep_ms) * 1e3


def time_slow(fn: Callable, args: tuple, max_runs: int = 5) -> float:
    """Median µs over a few event-timed runs, for calls too slow for do_bench's repeat budget."""
    fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(max_runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
        if sum(times) > 3e6:
            break
    return statistics.median(times)


def bench_point(shape: Shape, quant: str, num_tokens: int, backends: dict, ceilings: dict, args) -> list[dict]:
    count = 8 if num_tokens <= 32 else (4 if num_tokens <= 512 else 2)
    if shape.num_experts * shape.hidden * shape.intermediate * num_tokens > 2e13:
        count = 1  # DeepSeek-V3 at 8192 tokens: one call is ~10 ms, far past L2's reach anyway
    routes = routings(num_tokens, shape, count, seed=num_tokens)
    gen = torch.Generator(device="cuda").manual_seed(num_tokens + 1)
    xs = [torch.randn(num_tokens, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in routes]
    inputs = [(x, g, ids) for x, (g, ids) in zip(xs, routes)]
    hit = statistics.mean(int(torch.unique(ids).numel()) for _, ids in routes)
    n_bytes = hit * expert_bytes(shape, quant) + 2 * num_tokens * shape.hidden * 2
    flops = 2 * num_tokens * shape.top_k * 3 * shape.intermediate * shape.hidden
    rate = ceilings["bf16_matmul_TFLOPs"] if quant == "bf16" else ceilings["fp8_matmul_TFLOPs"]
    roofline_us = max(n_bytes / ceilings["copy_GBps"] / 1e3, flops / rate / 1e6)
    rows = []
    for name, (fn, capturable, note) in backends.items():
        row = {
            "shape": shape.name, "quant": quant, "tokens": num_tokens, "backend": name,
            "hit_experts": hit, "bytes": n_bytes, "flops": flops, "roofline_us": roofline_us,
            "bound": "memory" if n_bytes / ceilings["copy_GBps"] / 1e3 >= flops / rate / 1e6 else "compute",
            "note": note,
        }
        if fn is None or (name == "torch" and num_tokens > args.torch_max_tokens):
            row["skipped"] = note or f"torch loop skipped above {args.torch_max_tokens} tokens (--torch-max-tokens)"
            rows.append(row)
            continue
        try:
            rep = 100.0 if num_tokens <= 2048 else 60.0
            if capturable:
                try:
                    row["median_us"] = time_graph(fn, inputs, rep)
                except RuntimeError as exc:  # report eager time, and why, rather than nothing
                    torch.cuda.synchronize()
                    row["note"] = f"{note}; not graph-capturable here ({str(exc)[:120]}): eager time".lstrip("; ")
                    row["median_us"] = time_eager(fn, inputs[0], rep)
                row["eager_us"] = time_eager(fn, inputs[0], rep)
            else:
                row["median_us"] = row["eager_us"] = time_slow(fn, inputs[0]) if num_tokens >= 512 else time_eager(fn, inputs[0], rep)
        except Exception as exc:  # a backend failing at one point must not lose the others' numbers
            row["skipped"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            torch.cuda.synchronize()
            continue
        t = row["median_us"]
        row.update(GBps=n_bytes / t / 1e3, TFLOPs=flops / t / 1e6, ratio_to_roofline=t / roofline_us)
        rows.append(row)
        print(f"{shape.name:14s} {quant:9s} T={num_tokens:5d} {name:10s} {t:10.1f} us  eager {row['eager_us']:10.1f}  "
              f"roofline {roofline_us:9.1f}  x{t / roofline_us:5.2f}", flush=True)
    return rows


def versions() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "sm_count": props.multi_processor_count,
        "memory_GiB": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def summarize(rows: list[dict]) -> dict:
    """Fastest backend per point and the issue's Triton targets, met or not."""
    fastest, checks = {}, []
    by_point: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if "median_us" in r:
            by_point.setdefault((r["shape"], r["quant"], r["tokens"]), {})[r["backend"]] = r
    for (shape, quant, tokens), backends in sorted(by_point.items()):
        best = min(backends.values(), key=lambda r: r["median_us"])
        fastest[f"{shape}/{quant}/{tokens}"] = best["backend"]
        tri, grp = backends.get("triton"), backends.get("grouped_mm")
        if quant != "bf16" or tri is None:
            continue
        bound = 1.35 if tokens <= TARGETS["small_tokens"][0] else (1.6 if tokens >= TARGETS["large_tokens"][0] else None)
        if bound is not None:
            checks.append({"point": f"{shape}/{tokens}", "target": f"<= {bound}x roofline",
                           "value": round(tri["ratio_to_roofline"], 3), "met": tri["ratio_to_roofline"] <= bound})
        if grp is not None and tokens <= TARGETS["beat_grouped_up_to"]:
            checks.append({"point": f"{shape}/{tokens}", "target": "faster than grouped_mm",
                           "value": round(grp["median_us"] / tri["median_us"], 3), "met": tri["median_us"] < grp["median_us"]})
    return {"fastest": fastest, "target_checks": checks}


def write_markdown(path: Path, report: dict) -> None:
    m, c = report["machine"], report["ceilings"]
    lines = [
        "# MoE experts on the GPU: Triton vs torch grouped GEMM vs torch loop",
        "",
        f"Machine: {m['gpu']} (sm_{m['capability'].replace('.', '')}, {m['sm_count']} SMs, {m['memory_GiB']} GiB), "
        f"torch {m['torch']} (CUDA {m['cuda']}), Triton {m['triton']}, Python {m['python']}, {m['date']}.",
        "",
        f"Ceilings measured in this run: device-to-device copy {c['copy_GBps']:.0f} GB/s (read + write), "
        f"bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s, FP8 matmul {c['fp8_matmul_TFLOPs']:.0f} TFLOP/s "
        f"({c['matmul_size']}^3).",
        "",
        "µs: median per layer call (experts + top-k sum), CUDA-graph replay for Triton and grouped GEMM "
        "(eager, with Python launch costs, in parentheses), eager for the torch loop. "
        "Ratio: time / roofline, roofline = max(bytes hit / copy rate, FLOPs / matmul rate).",
        "",
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in report["results"]:
        groups.setdefault((r["shape"], r["quant"]), []).append(r)
    for (shape, quant), rows in groups.items():
        lines += [f"## {shape}, {quant}", "",
                  "| tokens | bound | roofline µs | triton µs (eager) | x | grouped_mm µs (eager) | x | torch µs | x | fastest | TB/s triton | TFLOP/s triton |",
                  "|---:|:--|---:|---:|---:|---:|---:|---:|---:|:--|---:|---:|"]
        for tokens in sorted({r["tokens"] for r in rows}):
            at = {r["backend"]: r for r in rows if r["tokens"] == tokens}
            any_row = next(iter(at.values()))
            cells = [str(tokens), any_row["bound"], f"{any_row['roofline_us']:.1f}"]
            for b in ("triton", "grouped_mm", "torch"):
                r = at.get(b)
                if r is None or "median_us" not in r:
                    cells += ["n/a", ""]
                    continue
                eager = f" ({r['eager_us']:.1f})" if b != "torch" else ""
                cells += [f"{r['median_us']:.1f}{eager}", f"{r['ratio_to_roofline']:.2f}"]
            cells.append(report["summary"]["fastest"].get(f"{shape}/{quant}/{tokens}", "n/a"))
            tri = at.get("triton", {})
            cells += [f"{tri['GBps'] / 1e3:.2f}" if "GBps" in tri else "", f"{tri['TFLOPs']:.0f}" if "TFLOPs" in tri else ""]
            lines.append("| " + " | ".join(cells) + " |")
        skipped = sorted({f"{r['backend']}: {r['skipped']}" for r in rows if "skipped" in r})
        if skipped:
            lines += [""] + [f"- {s}" for s in skipped]
        lines.append("")
    checks = report["summary"]["target_checks"]
    met = sum(c["met"] for c in checks)
    lines += ["## Targets (Triton, bf16)", "", f"{met} of {len(checks)} met.", "", "| point | target | value | met |", "|:--|:--|---:|:--|"]
    lines += [f"| {c['point']} | {c['target']} | {c['value']} | {'yes' if c['met'] else 'NO'} |" for c in checks]
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list[dict]] = {}
    for r in report["results"]:
        groups.setdefault((r["shape"], r["quant"]), []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4.2), squeeze=False)
    for ax, ((shape, quant), rows) in zip(axes[0], groups.items()):
        tokens = sorted({r["tokens"] for r in rows})
        roof = [next(r["roofline_us"] for r in rows if r["tokens"] == t) for t in tokens]
        ax.plot(tokens, roof, "k--", label="roofline")
        for backend, style in (("triton", "o-"), ("grouped_mm", "s-"), ("torch", "^-")):
            pts = [(r["tokens"], r["median_us"]) for r in rows if r["backend"] == backend and "median_us" in r]
            if pts:
                ax.plot(*zip(*pts), style, label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("µs per layer call")
        ax.set_title(f"{shape} {quant}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    m = report["machine"]
    fig.suptitle(f"{m['gpu']}, torch {m['torch']}, Triton {m['triton']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(out_dir: Path, name: str, report: dict) -> None:
    report["summary"] = summarize(report["results"])
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    write_markdown(out_dir / f"{name}.md", report)
    try:
        write_plot(out_dir / f"{name}.png", report)
    except ImportError as exc:
        print(f"no plot: {exc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    parser.add_argument("--torch-max-tokens", type=int, default=8192, help="skip the torch loop above this many tokens")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench-out")
    parser.add_argument("--name", default="gpu_moe")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_experts_roofline.py needs a CUDA device")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings()
    print(json.dumps(ceilings), flush=True)
    report = {"machine": versions(), "ceilings": ceilings, "results": []}
    plan = [(s, "bf16") for s in args.shapes] + ([("deepseek-v3", "fp8_block")] if "deepseek-v3" in args.shapes else [])
    for shape_name, quant in plan:
        shape = SHAPES[shape_name]
        w1, w2, scales = weights(shape, quant)
        backends = make_backends(shape, quant, w1, w2, scales)
        for tokens in args.tokens:
            report["results"] += bench_point(shape, quant, tokens, backends, ceilings, args)
        del w1, w2, scales, backends
        torch.cuda.empty_cache()
        write_report(args.out_dir, args.name, report)  # after every shape: a run cut short keeps what it measured
    for c in report["summary"]["target_checks"]:
        print(f"{c['point']:22s} {c['target']:24s} {c['value']:7.3f} {'ok' if c['met'] else 'MISSED'}")


if __name__ == "__main__":
    main()
