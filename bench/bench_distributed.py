"""Dispatch + combine time of moe-fsm's distributed prepare/finalize, next to plain collectives of the same bytes.

    python bench/bench_distributed.py [--nproc N] [--out docs/perf] [--tokens 128 4096] [--quant none fp8]

Starts itself on N ranks through ``moe_fsm.distributed.launch`` (NCCL with one
process per GPU when CUDA is present, gloo on the CPU otherwise) unless it is
already a launched rank. For the DeepSeek-V3 MoE shape (256 experts, hidden
7168, top-8, uniform random routing, experts split evenly over the ranks) and
each token count per rank, it times

* ``all2all``: AllToAllPrepareFinalize.prepare + finalize (routing index, quantize,
  pack, counts exchange, all_to_all_single dispatch; local weighting; all_to_all_single
  combine and scatter-add), against two plain ``all_to_all_single`` calls with the
  very same split sizes and byte widths;
* ``allgather``: AllGatherReduceScatterPrepareFinalize (with the expert map) against
  a plain single-tensor all-gather + reduce-scatter of the same bytes.

The experts are left out: the expert output handed to finalize is a preallocated
already-reduced tensor (``WeightAndReduce.EXPERTS``), so the times are the token
movement alone. Bandwidth is "algorithm bandwidth" in the nccl-tests sense: the
per-rank bytes of the larger buffer of each collective (all-to-all: what this rank
sends; all-gather: the gathered output; reduce-scatter: the input), summed over
dispatch and combine, divided by the slowest rank's median time. The P/F and its
baseline are charged the same bytes, so their ratio is the P/F's own overhead.

Writes ``distributed_{backend}_w{N}.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from moe_fsm.distributed import ExpertPlacement, destroy, init_from_env, is_launched, launch
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.modular.interfaces import ExpertScales, WeightAndReduce
from moe_fsm.prepare_finalize.all2all import AllToAllPrepareFinalize
from moe_fsm.prepare_finalize.allgather import AllGatherReduceScatterPrepareFinalize
from moe_fsm.quantize.activations import input_quantizer

NUM_EXPERTS = 256
HIDDEN = 7168
TOP_K = 8
DTYPE = torch.bfloat16
QUANTS = {
    "none": None,
    "fp8": QuantScheme.fp8("block", "group"),  # DeepSeek-V3: 1x128 dynamic activation groups
}
# Environment the GPU run must keep as the machine sets it; recorded in the report.
RECORDED_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "NCCL_DEBUG", "OMP_NUM_THREADS")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None, help="ranks to launch (default: GPUs with CUDA, else 2)")
    p.add_argument("--out", default="docs/perf", help="directory for the JSON and Markdown report")
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 4096], help="tokens per rank")
    p.add_argument("--quant", nargs="+", default=list(QUANTS), choices=list(QUANTS), help="dispatch payload")
    p.add_argument("--pf", nargs="+", default=["all2all", "allgather"], choices=["all2all", "allgather"])
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations (default: 5 on GPU, 1 on CPU)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default: 20 on GPU, 5 on CPU)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the launch is stopped")
    return p.parse_args(argv)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Newer torch (2.13 here) renamed the single-tensor all-gather / reduce-scatter; older releases have only the old names.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def timed(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Seconds per call, each call started together on every rank (barrier) and ended by a device sync."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def routing(tokens: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.rand(tokens, NUM_EXPERTS, generator=gen)
    weights, ids = scores.topk(TOP_K, dim=1)
    weights = weights / weights.sum(dim=1, keepdim=True)
    return ids.to(torch.int32).to(device), weights.to(torch.float32).to(device)


def bench_case(pf_kind: str, quant: str, tokens: int, ctx, warmup: int, iters: int) -> dict:
    device, rank, world = ctx.device, ctx.rank, ctx.world_size
    placement = ExpertPlacement(NUM_EXPERTS, world, rank)
    expert_map = placement.expert_map(device)
    scheme = QUANTS[quant]
    quantize = input_quantizer(scheme, ExpertScales()) if scheme is not None else None
    gen = torch.Generator(device="cpu").manual_seed(100 + rank)
    hidden = torch.randn(tokens, HIDDEN, generator=gen).to(DTYPE).to(device)
    ids, weights = routing(tokens, device, seed=200 + rank)
    output = torch.empty_like(hidden)

    if pf_kind == "all2all":
        pf = AllToAllPrepareFinalize(placement, quantize_first=True)
    else:
        pf = AllGatherReduceScatterPrepareFinalize(quantize_first=True)

    def prepare():
        return pf.prepare(hidden, weights, ids, num_experts=NUM_EXPERTS, expert_map=expert_map,
                          apply_router_weight_on_input=False, quantize=quantize)

    first = prepare()
    stand_in = torch.zeros(first.hidden.shape[0], HIDDEN, dtype=DTYPE, device=device)  # the experts' reduced output

    def dispatch_and_combine() -> None:
        prepared = prepare()
        pf.finalize(output, stand_in, prepared, topk_weights=prepared.topk_weights, topk_ids=prepared.topk_ids,
                    apply_router_weight_on_input=False, reduce=WeightAndReduce.EXPERTS)

    state = first.state
    combine_row = HIDDEN * torch.empty((), dtype=DTYPE).element_size()
    if pf_kind == "all2all":
        send, recv, row_bytes = list(state.send_counts), list(state.recv_counts), state.row_bytes
        nbytes = sum(send) * row_bytes + sum(recv) * combine_row
        d_in = torch.zeros(sum(send), row_bytes, dtype=torch.uint8, device=device)
        d_out = torch.empty(sum(recv), row_bytes, dtype=torch.uint8, device=device)
        c_in = torch.zeros(sum(recv), HIDDEN, dtype=DTYPE, device=device)
        c_out = torch.empty(sum(send), HIDDEN, dtype=DTYPE, device=device)

        def baseline() -> None:
            dist.all_to_all_single(d_out, d_in, output_split_sizes=recv, input_split_sizes=send)
            dist.all_to_all_single(c_out, c_in, output_split_sizes=send, input_split_sizes=recv)

        rows_out = sum(send)
        baseline_name = "all_to_all_single x2"
    else:
        row_bytes, total = state.row_bytes, sum(state.sizes)
        nbytes = total * row_bytes + total * combine_row
        g_in = torch.zeros(tokens, row_bytes, dtype=torch.uint8, device=device)
        g_out = torch.empty(world * tokens, row_bytes, dtype=torch.uint8, device=device)
        r_in = torch.zeros(world * tokens, HIDDEN, dtype=DTYPE, device=device)
        r_out = torch.empty(tokens, HIDDEN, dtype=DTYPE, device=device)

        def baseline() -> None:
            ALL_GATHER_SINGLE(g_out, g_in)
            REDUCE_SCATTER_SINGLE(r_out, r_in)

        rows_out = total
        baseline_name = "all-gather + reduce-scatter (single tensor)"

    pf_times = timed(dispatch_and_combine, device, warmup, iters)
    base_times = timed(baseline, device, warmup, iters)
    return {
        "pf": pf.name,
        "quant": quant,
        "tokens_per_rank": tokens,
        "rank": rank,
        "dispatch_row_bytes": row_bytes,
        "rows_dispatched": rows_out,
        "bytes": nbytes,
        "pf_median_s": statistics.median(pf_times),
        "baseline": baseline_name,
        "baseline_median_s": statistics.median(base_times),
    }


def summarize(per_rank: list[dict]) -> dict:
    """Slowest rank's median time; mean bytes over ranks; GB/s = bytes / time."""
    first = per_rank[0]
    nbytes = statistics.mean(r["bytes"] for r in per_rank)
    pf_s = max(r["pf_median_s"] for r in per_rank)
    base_s = max(r["baseline_median_s"] for r in per_rank)
    return {
        "pf": first["pf"],
        "quant": first["quant"],
        "tokens_per_rank": first["tokens_per_rank"],
        "dispatch_row_bytes": first["dispatch_row_bytes"],
        "rows_dispatched_per_rank": statistics.mean(r["rows_dispatched"] for r in per_rank),
        "bytes_per_rank": nbytes,
        "pf_ms": pf_s * 1e3,
        "pf_gbps": nbytes / pf_s / 1e9,
        "baseline": first["baseline"],
        "baseline_ms": base_s * 1e3,
        "baseline_gbps": nbytes / base_s / 1e9,
        "pf_over_baseline": pf_s / base_s,
        "per_rank": per_rank,
    }


def device_name(ctx) -> str:
    if ctx.device.type == "cuda":
        return torch.cuda.get_device_name(ctx.device)
    return f"{platform.processor() or platform.machine()} CPU ({os.cpu_count()} cores)"


def write_report(out: Path, meta: dict, cases: list[dict]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"distributed_{meta['backend']}_w{meta['world_size']}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "cases": cases}, indent=1))
    lines = [
        f"# Distributed dispatch + combine: {meta['backend']}, {meta['world_size']} ranks",
        "",
        f"- device: {meta['device']}; torch {meta['torch']}" + (f"; NCCL {meta['nccl']}" if meta.get("nccl") else ""),
        f"- shape: DeepSeek-V3 MoE, E={NUM_EXPERTS}, K={HIDDEN}, top-{TOP_K}, bf16 activations, uniform random routing, "
        f"experts split evenly over the ranks",
        f"- timing: median of {meta['iters']} calls after {meta['warmup']} warm-up call(s), slowest rank; each call starts "
        f"after a barrier and ends with a device sync",
        "- GB/s: algorithm bandwidth (per-rank bytes of the larger buffer of each collective, dispatch + combine); "
        "the P/F and its baseline are charged the same bytes",
        f"- environment: {', '.join(f'{k}={v}' for k, v in meta['env'].items()) or 'none of the recorded variables set'}",
        f"- command: `{meta['command']}`",
        f"- run at {meta['date']}",
        "",
        "| P/F | payload | tokens/rank | row bytes | rows sent/rank | MB/rank | P/F ms | P/F GB/s | baseline | baseline ms | baseline GB/s | P/F / baseline |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for c in cases:
        lines.append(
            f"| {c['pf']} | {c['quant']} | {c['tokens_per_rank']} | {c['dispatch_row_bytes']} | "
            f"{c['rows_dispatched_per_rank']:.0f} | {c['bytes_per_rank'] / 1e6:.1f} | {c['pf_ms']:.3f} | {c['pf_gbps']:.2f} | "
            f"{c['baseline']} | {c['baseline_ms']:.3f} | {c['baseline_gbps']:.2f} | {c['pf_over_baseline']:.2f}x |"
        )
    lines.append("")
    md = out / f"{stem}.md"
    md.write_text("\n".join(lines))
    return md


def run_rank(args: argparse.Namespace) -> int:
    ctx = init_from_env()
    try:
        gpu = ctx.device.type == "cuda"
        warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
        iters = args.iters if args.iters is not None else (20 if gpu else 5)
        cases = []
        for quant in args.quant:
            for tokens in args.tokens:
                for pf_kind in args.pf:
                    mine = bench_case(pf_kind, quant, tokens, ctx, warmup, iters)
                    gathered: list[Optional[dict]] = [None] * ctx.world_size
                    dist.all_gather_object(gathered, mine)
                    if ctx.rank == 0:
                        case = summarize(gathered)
                        cases.append(case)
                        print(
                            f"{case['pf']:<40} {quant:<5} {tokens:>5} tok/rank: P/F {case['pf_ms']:9.3f} ms "
                            f"{case['pf_gbps']:7.2f} GB/s | {case['baseline']}: {case['baseline_ms']:9.3f} ms "
                            f"{case['baseline_gbps']:7.2f} GB/s",
                            flush=True,
                        )
        if ctx.rank == 0:
            meta = {
                "backend": ctx.backend,
                "world_size": ctx.world_size,
                "device": device_name(ctx),
                "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None,
                "warmup": warmup,
                "iters": iters,
                "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ},
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            }
            print(f"wrote {write_report(Path(args.out), meta, cases)}")
    finally:
        destroy()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if is_launched():
        return run_rank(args)
    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    if nproc < 2:
        print(f"a distributed benchmark needs at least 2 ranks; got --nproc {nproc}", file=sys.stderr)
        return 2
    return launch(nproc, [str(Path(__file__).resolve()), *argv], timeout_s=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
