"""Dispatch + combine time of moe-fsm's distributed prepare/finalize, next to plain collectives of the same bytes.

    python bench/bench_distributed.py [--nproc N] [--out bench-out] [--tokens 128 1024 4096] [--quant none fp8]
                                      [--routing uniform skewed]
                                      [--pf all2all capped capped_graph fixed fixed_graph allgather]
                                      [--with-experts] [--profile] [--host-breakdown]

Starts itself on N ranks through ``moe_fsm.distributed.launch`` (NCCL with one
process per GPU when CUDA is present, gloo on the CPU otherwise) unless it is
already a launched rank. For the DeepSeek-V3 MoE shape (256 experts, hidden
7168, top-8, experts split evenly over the ranks), each routing (``uniform``:
top-8 of uniform random scores; ``skewed``: experts drawn with Zipf weights
1/(e+1), so the lower ranks' experts are hot and ranks receive unequal rows) and
each token count per rank, it times

* ``all2all``: AllToAllPrepareFinalize (Standard format) prepare + finalize (quantize,
  pack, counts exchange, one all_to_all_single dispatch; all_to_all_single combine and
  scatter-add), against two plain ``all_to_all_single`` calls with the very same split
  sizes and byte widths;
* ``capped``: the same P/F built with ``max_tokens_per_rank`` = the tokens per rank: fixed blocks
  of that many rows each way, no counts exchange and no host read, against two plain equal-split
  ``all_to_all_single`` of the same bytes; ``capped_graph``: that call captured in a CUDA graph
  and replayed (CUDA only);
* ``fixed``: FixedCapacityAllToAllPrepareFinalize (Batched format, capacity = the tokens
  per rank), eagerly, against two plain equal-split ``all_to_all_single`` of the same
  bytes (W blocks of capacity rows each way);
* ``fixed_graph``: the same prepare + finalize captured once in a CUDA graph and
  replayed (CUDA only), against the same baseline;
* ``allgather``: AllGatherReduceScatterPrepareFinalize (with the expert map) against
  a plain single-tensor all-gather + reduce-scatter of the same bytes.

``--with-experts`` also times a whole EP layer (AllToAllPrepareFinalize + TritonExperts
on the rank's E/W experts, DeepSeek-V3's intermediate size 2048) next to the
single-GPU layer of the same per-rank shape (LocalPrepareFinalize + TritonExperts,
the same E/W experts, the same tokens, top-8 among them), with the EP layer's
dispatch / experts / combine split (:class:`moe_fsm.modular.kernel.StageClock`).

Otherwise the experts are left out: the expert output handed to finalize is a preallocated
stand-in (already reduced for the Standard format, per-expert slabs for the
Batched one), so the times are the token movement alone. FP8 payloads are
quantized by the quantizer the experts would hand to prepare (the Triton 1x128
group quantizer on CUDA, the torch one on CPU); where the Triton kernels run, the
all-to-all P/Fs apply that quantization inside their send-row kernel (one pass over
the tokens), and the column "quantize ms" times the quantizer alone on the rank's
tokens, what a separate quantization pass costs. Bandwidth is "algorithm bandwidth" in the
nccl-tests sense: the per-rank bytes of the larger buffer of each collective
(all-to-all: what this rank sends; all-gather: the gathered output;
reduce-scatter: the input), summed over dispatch and combine, divided by the
slowest rank's median time. The P/F and its baseline are charged the same
bytes, so their ratio is the P/F's own overhead.

``--profile`` also prints rank 0's torch.profiler tables of one P/F call per case
(where the time goes, operator by operator) and its Python profile of 20 calls
(the host time around them: Triton's launcher, the collectives' Python, the wait
of the host synchronisation).

``--host-breakdown`` also gives, for the eager all-to-all calls (``all2all``, ``capped``), the host time of each
step of one call on rank 0 (:func:`host_breakdown`: the wall clock around each step, averaged over
``BREAKDOWN_CALLS`` calls), so the host time of an eager call can be split without a profiler's inflation.

The column "host ms" is the median time until the call returns, before the device sync that ends
it: where it is close to "P/F ms", the host's launches, not the GPU or the wire, set the time. Each such
call starts from an idle device; "back to back" times calls made one after another without a sync between
them (the P/F's and the bare collectives'), as an engine runs layer after layer, where a call's host work
overlaps the device work queued before it. "new outputs" times the bare all-to-alls receiving into tensors
allocated on each call, as the P/Fs receive theirs: what the caching allocator adds to a call.

Writes ``distributed_{backend}_w{N}.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from moe_fsm.distributed import ExpertPlacement, destroy, init_from_env, is_launched, launch
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.modular.interfaces import DynamicFP8RowQuantizer, ExpertScales, InputQuantizer, WeightAndReduce
from moe_fsm.prepare_finalize.all2all import AllToAllPrepareFinalize
from moe_fsm.prepare_finalize.allgather import AllGatherReduceScatterPrepareFinalize
from moe_fsm.prepare_finalize.fixed_all2all import FixedCapacityAllToAllPrepareFinalize
from moe_fsm.quantize.activations import input_quantizer

NUM_EXPERTS = 256
HIDDEN = 7168
TOP_K = 8
INTERMEDIATE = 2048  # DeepSeek-V3's moe_intermediate_size, for --with-experts
DTYPE = torch.bfloat16
ROUTINGS = ("uniform", "skewed")
QUANTS = {
    "none": None,
    "fp8": QuantScheme.fp8("block", "group"),  # DeepSeek-V3: 1x128 dynamic activation groups
}
PF_KINDS = ("all2all", "capped", "capped_graph", "fixed", "fixed_graph", "allgather")
# Environment the GPU run must keep as the machine sets it; recorded in the report.
RECORDED_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "NCCL_DEBUG", "OMP_NUM_THREADS")

# Newer torch (2.13 here) renamed the single-tensor all-gather / reduce-scatter; older releases have only the old names.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None, help="ranks to launch (default: GPUs with CUDA, else 2)")
    p.add_argument("--out", default="bench-out", help="directory for the JSON and Markdown report (docs/perf/distributed.md shows the latest)")
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 4096], help="tokens per rank")
    p.add_argument("--routing", nargs="+", default=list(ROUTINGS), choices=list(ROUTINGS), help="how tokens pick experts")
    p.add_argument("--with-experts", action="store_true",
                   help="also time the whole EP layer (dispatch, Triton experts, combine) against the single-GPU layer "
                        "of the same per-rank shape (CUDA only)")
    p.add_argument("--layer-tokens", type=int, nargs="+", default=[128, 4096], help="tokens per rank of --with-experts")
    p.add_argument("--quant", nargs="+", default=list(QUANTS), choices=list(QUANTS), help="dispatch payload")
    p.add_argument("--pf", nargs="+", default=list(PF_KINDS), choices=list(PF_KINDS))
    p.add_argument("--fixed-max-gib", type=float, default=None,
                   help="skip fixed-capacity cases whose expert slabs (input + stand-in output) exceed this many GiB "
                        "(default: 60 on CUDA, 1.5 on CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations (default: 5 on GPU, 1 on CPU)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default: 20 on GPU, 5 on CPU)")
    p.add_argument("--profile", action="store_true", help="print rank 0's torch.profiler tables of one P/F call per case and its Python profile of 20 calls")
    p.add_argument("--host-breakdown", action="store_true",
                   help="also time, in rank 0's eager all-to-all calls, the host time of each step of prepare and "
                        "finalize (wall clock around each, no profiler)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the launch is stopped")
    return p.parse_args(argv)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> tuple[list[float], list[float]]:
    """Seconds per call, each call started together on every rank (barrier) and ended by a device sync; and the
    seconds until each call returned, before that sync (the host's share)."""
    for _ in range(warmup):
        fn()
    times, host = [], []
    for _ in range(iters):
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        host.append(time.perf_counter() - start)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times, host


def back_to_back(fn: Callable[[], None], device: torch.device, calls: int, repeats: int = 3) -> float:
    """Seconds per call of ``calls`` calls made one after another with no barrier or device sync between them
    (one barrier before, one sync after; the median of ``repeats`` such runs): the rate of an engine that runs layer
    after layer, where a call's host work overlaps the device work queued before it. ``timed`` measures each call
    alone, from an idle device, so there every launch's host cost adds to the call's time."""
    runs = []
    for _ in range(repeats):
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs)


def routing(tokens: int, device: torch.device, seed: int, kind: str = "uniform",
            num_experts: int = NUM_EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if kind == "skewed":
        zipf = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64)
        ids = torch.multinomial(zipf.expand(tokens, num_experts), TOP_K, replacement=False, generator=gen) if tokens else \
            torch.empty((0, TOP_K), dtype=torch.int64)
        weights = torch.rand(tokens, TOP_K, generator=gen) + 0.1
        weights = weights / weights.sum(dim=1, keepdim=True)
        return ids.to(torch.int32).to(device), weights.to(torch.float32).to(device)
    scores = torch.rand(tokens, num_experts, generator=gen)
    weights, ids = scores.topk(TOP_K, dim=1)
    weights = weights / weights.sum(dim=1, keepdim=True)
    return ids.to(torch.int32).to(device), weights.to(torch.float32).to(device)


def quantizer_for(quant: str, device: torch.device) -> Optional[InputQuantizer]:
    """What the experts would hand prepare: the Triton group quantizer on CUDA, the torch emulation on CPU.

    Both are DynamicFP8RowQuantizer("group", ...), as TritonExperts hands it, so the all-to-all P/Fs quantize in
    their send-row kernel where the kernels run (the all-gather P/F calls it).
    """
    scheme = QUANTS[quant]
    if scheme is None:
        return None
    if device.type == "cuda":
        from moe_fsm.kernels.triton_moe import quantize_activation

        return DynamicFP8RowQuantizer("group", lambda hidden: quantize_activation(hidden, "group"))
    return input_quantizer(scheme, ExpertScales())


def captured(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``step`` captured once in a CUDA graph (after warm-up on a side stream); returns the replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


@dataclass
class Case:
    """One measured P/F against its baseline, on this rank."""

    pf: str
    step: Callable[[], None]
    baseline: Callable[[], None]
    baseline_name: str
    row_bytes: int
    rows_sent: int
    nbytes: int
    # The same bare collectives receiving into outputs allocated on each call, as a P/F that does not keep its
    # received buffers would (None for the all-gather baseline): what the caching allocator adds to a call.
    fresh_baseline: Optional[Callable[[], None]] = None
    # The P/F whose eager call ``step`` makes, for --host-breakdown (None for replays and the other P/Fs).
    eager_all2all: Optional[AllToAllPrepareFinalize] = None


def all2all_case(ctx, tokens, hidden, ids, weights, quantize, output) -> Case:
    device, world = ctx.device, ctx.world_size
    placement = ExpertPlacement(NUM_EXPERTS, world, ctx.rank)
    expert_map = placement.expert_map(device)
    pf = AllToAllPrepareFinalize(placement, quantize_first=True)

    def prepare():
        return pf.prepare(hidden, weights, ids, num_experts=NUM_EXPERTS, expert_map=expert_map,
                          apply_router_weight_on_input=False, quantize=quantize)

    first = prepare()
    stand_in = torch.zeros(first.hidden.shape[0], HIDDEN, dtype=DTYPE, device=device)  # the experts' reduced output

    def step() -> None:
        prepared = prepare()
        pf.finalize(output, stand_in, prepared, topk_weights=prepared.topk_weights, topk_ids=prepared.topk_ids,
                    apply_router_weight_on_input=False, reduce=WeightAndReduce.EXPERTS)

    state = first.state
    send, recv, row_bytes = list(state.send_counts), list(state.recv_counts), state.row_bytes
    combine_row = HIDDEN * DTYPE.itemsize
    d_in = torch.zeros(sum(send), row_bytes, dtype=torch.uint8, device=device)
    d_out = torch.empty(sum(recv), row_bytes, dtype=torch.uint8, device=device)
    c_in = torch.zeros(sum(recv), HIDDEN, dtype=DTYPE, device=device)
    c_out = torch.empty(sum(send), HIDDEN, dtype=DTYPE, device=device)

    def baseline() -> None:
        dist.all_to_all_single(d_out, d_in, output_split_sizes=recv, input_split_sizes=send)
        dist.all_to_all_single(c_out, c_in, output_split_sizes=send, input_split_sizes=recv)

    def fresh_baseline() -> None:
        dist.all_to_all_single(torch.empty_like(d_out), d_in, output_split_sizes=recv, input_split_sizes=send)
        dist.all_to_all_single(torch.empty_like(c_out), c_in, output_split_sizes=send, input_split_sizes=recv)

    nbytes = sum(send) * row_bytes + sum(recv) * combine_row
    return Case(pf.name, step, baseline, "all_to_all_single x2", row_bytes, sum(send), nbytes, fresh_baseline, pf)


def capped_case(ctx, tokens, hidden, ids, weights, quantize, output, graph: bool) -> Case:
    """AllToAllPrepareFinalize with max_tokens_per_rank = tokens: equal blocks, no host read (graph-capturable)."""
    device, world = ctx.device, ctx.world_size
    placement = ExpertPlacement(NUM_EXPERTS, world, ctx.rank)
    expert_map = placement.expert_map(device)
    pf = AllToAllPrepareFinalize(placement, quantize_first=True, max_tokens_per_rank=tokens)

    def prepare():
        return pf.prepare(hidden, weights, ids, num_experts=NUM_EXPERTS, expert_map=expert_map,
                          apply_router_weight_on_input=False, quantize=quantize)

    first = prepare()
    stand_in = torch.zeros(first.hidden.shape[0], HIDDEN, dtype=DTYPE, device=device)  # the experts' reduced output

    def step() -> None:
        prepared = prepare()
        pf.finalize(output, stand_in, prepared, topk_weights=prepared.topk_weights, topk_ids=prepared.topk_ids,
                    apply_router_weight_on_input=False, reduce=WeightAndReduce.EXPERTS)

    case = _equal_blocks_case(pf.name + " (max_tokens_per_rank" + (", CUDA graph)" if graph else ")"),
                              captured(step, device) if graph else step, world * tokens, first.state.row_bytes, device)
    case.eager_all2all = None if graph else pf
    return case


def _equal_blocks_case(name: str, step: Callable[[], None], rows: int, row_bytes: int, device: torch.device) -> Case:
    """A P/F that sends ``rows`` rows of ``row_bytes`` each way in equal blocks, against bare equal-split collectives."""
    d_in = torch.zeros(rows, row_bytes, dtype=torch.uint8, device=device)
    d_out = torch.empty_like(d_in)
    c_in = torch.zeros(rows, HIDDEN, dtype=DTYPE, device=device)
    c_out = torch.empty_like(c_in)

    def baseline() -> None:
        dist.all_to_all_single(d_out, d_in)
        dist.all_to_all_single(c_out, c_in)

    def fresh_baseline() -> None:
        dist.all_to_all_single(torch.empty_like(d_out), d_in)
        dist.all_to_all_single(torch.empty_like(c_out), c_in)

    return Case(name, step, baseline, "all_to_all_single x2 (equal splits)", row_bytes, rows,
                rows * (row_bytes + HIDDEN * DTYPE.itemsize), fresh_baseline)


def fixed_case(ctx, tokens, hidden, ids, weights, quantize, output, graph: bool) -> Case:
    device, world = ctx.device, ctx.world_size
    placement = ExpertPlacement(NUM_EXPERTS, world, ctx.rank)
    expert_map = placement.expert_map(device)
    pf = FixedCapacityAllToAllPrepareFinalize(placement, max_tokens_per_rank=tokens)

    def prepare():
        return pf.prepare(hidden, weights, ids, num_experts=NUM_EXPERTS, expert_map=expert_map,
                          apply_router_weight_on_input=False, quantize=quantize)

    first = prepare()
    stand_in = torch.zeros(first.hidden.shape[:2] + (HIDDEN,), dtype=DTYPE, device=device)  # the experts' slabs

    def step() -> None:
        prepared = prepare()
        pf.finalize(output, stand_in, prepared, topk_weights=prepared.topk_weights, topk_ids=prepared.topk_ids,
                    apply_router_weight_on_input=False, reduce=WeightAndReduce.BATCHED)

    name = pf.name + (" (CUDA graph)" if graph else "")
    return _equal_blocks_case(name, captured(step, device) if graph else step, world * tokens, first.state.row_bytes,
                              device)


def allgather_case(ctx, tokens, hidden, ids, weights, quantize, output) -> Case:
    device, world = ctx.device, ctx.world_size
    expert_map = ExpertPlacement(NUM_EXPERTS, world, ctx.rank).expert_map(device)
    pf = AllGatherReduceScatterPrepareFinalize(quantize_first=True)

    def prepare():
        return pf.prepare(hidden, weights, ids, num_experts=NUM_EXPERTS, expert_map=expert_map,
                          apply_router_weight_on_input=False, quantize=quantize)

    first = prepare()
    stand_in = torch.zeros(first.hidden.shape[0], HIDDEN, dtype=DTYPE, device=device)

    def step() -> None:
        prepared = prepare()
        pf.finalize(output, stand_in, prepared, topk_weights=prepared.topk_weights, topk_ids=prepared.topk_ids,
                    apply_router_weight_on_input=False, reduce=WeightAndReduce.EXPERTS)

    row_bytes, total = first.state.row_bytes, sum(first.state.sizes)
    g_in = torch.zeros(tokens, row_bytes, dtype=torch.uint8, device=device)
    g_out = torch.empty(world * tokens, row_bytes, dtype=torch.uint8, device=device)
    r_in = torch.zeros(world * tokens, HIDDEN, dtype=DTYPE, device=device)
    r_out = torch.empty(tokens, HIDDEN, dtype=DTYPE, device=device)

    def baseline() -> None:
        ALL_GATHER_SINGLE(g_out, g_in)
        REDUCE_SCATTER_SINGLE(r_out, r_in)

    return Case(pf.name, step, baseline, "all-gather + reduce-scatter (single tensor)", row_bytes, total,
                total * row_bytes + total * HIDDEN * DTYPE.itemsize)


def fixed_slab_gib(tokens: int, world: int, quant: str) -> float:
    """Memory of the fixed-capacity expert slabs (dispatched input plus the stand-in output)."""
    rows = NUM_EXPERTS * tokens  # E_local * W * tokens = E * tokens
    payload = 1 if quant == "fp8" else DTYPE.itemsize
    return rows * HIDDEN * (payload + DTYPE.itemsize) / 2**30


# Calls the Python profile of --profile averages over (each rank makes them, rank 0 records).
PROFILED_CALLS = 20


def profile_table(fn: Callable[[], None], device: torch.device, record: bool) -> str:
    """Where one call's time goes: torch's operators by host and device time, and Python's functions.

    torch.profiler sees torch operators and kernels but not the Python around them, nor Triton's launcher (a
    Python function); cProfile over PROFILED_CALLS calls does, and names the host synchronisation as the torch
    call that waits in it (``tolist``). Every rank makes the same calls, so the collectives pair up; only
    ``record`` (rank 0) records.
    """
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    if not record:
        fn()
        synchronize(device)
        for _ in range(PROFILED_CALLS):
            fn()
        synchronize(device)
        return ""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    averages = prof.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    if device.type == "cuda":
        tables.append(averages.table(sort_by="self_device_time_total", row_limit=15))
    python = cProfile.Profile()
    python.enable()
    for _ in range(PROFILED_CALLS):
        fn()
    synchronize(device)
    python.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(python, stream=text).sort_stats(order).print_stats(30)
        tables.append(f"Python functions over {PROFILED_CALLS} calls, by {order}:\n{text.getvalue()}")
    return "\n".join(tables)


# Calls --host-breakdown averages over, and the steps it times: (label, module, attribute), each a function or
# method the P/F calls through that name, so wrapping it there times every call of it.
BREAKDOWN_CALLS = 50
BREAKDOWN_STEPS = (
    ("check the call", "moe_fsm.prepare_finalize.all2all:AllToAllPrepareFinalize", "_check_call"),
    ("source rows, small fields packed", "moe_fsm.prepare_finalize.all2all:AllToAllPrepareFinalize", "_source"),
    ("route kernel", "moe_fsm.prepare_finalize.all2all", "route"),
    ("counts all-to-all", "moe_fsm.prepare_finalize.all2all", "exchange_counts"),
    ("send-row kernel", "moe_fsm.prepare_finalize.all2all", "send_rows"),
    ("all-to-all (variable)", "moe_fsm.prepare_finalize.all2all", "all_to_all_v"),
    ("all-to-all (equal)", "moe_fsm.prepare_finalize.all2all", "all_to_all_equal"),
    ("received fields as views", "moe_fsm.prepare_finalize.all2all", "unpack_row_bytes"),
    ("local ids kernel", "moe_fsm.prepare_finalize.all2all", "local_ids"),
    ("local prepare", "moe_fsm.prepare_finalize.local:LocalPrepareFinalize", "prepare"),
    ("combine kernel", "moe_fsm.prepare_finalize.all2all", "combine_returned"),
)


def host_breakdown(pf: AllToAllPrepareFinalize, call: Callable[[], None], device: torch.device) -> dict:
    """µs a call of host time per step of ``pf``'s prepare and finalize (BREAKDOWN_STEPS), by phase.

    Each step is wrapped where the P/F looks it up, and the wall clock around it summed per phase (prepare or
    finalize, themselves wrapped on ``pf``); "rest" is the phase's time outside the steps (the host read of the
    variable call is there). Nested steps (the route inside ``_routes``) are not wrapped twice. The device is
    synchronized only before and after the calls, so what is timed is the host's work, as in "host ms".
    """
    import importlib

    clock = time.perf_counter
    totals: dict[tuple[str, str], float] = {}
    phase = ["outside"]
    restore = []

    def timed_step(label: str, fn: Callable) -> Callable:
        def wrapper(*a, **k):
            start = clock()
            try:
                return fn(*a, **k)
            finally:
                key = (phase[0], label)
                totals[key] = totals.get(key, 0.0) + clock() - start
        return wrapper

    def timed_phase(name: str, fn: Callable) -> Callable:
        def wrapper(*a, **k):
            phase[0] = name
            start = clock()
            try:
                return fn(*a, **k)
            finally:
                totals[(name, "total")] = totals.get((name, "total"), 0.0) + clock() - start
                phase[0] = "outside"
        return wrapper

    for label, where, attribute in BREAKDOWN_STEPS:
        module_name, _, class_name = where.partition(":")
        owner = importlib.import_module(module_name)
        owner = getattr(owner, class_name) if class_name else owner
        original = getattr(owner, attribute)  # a class's inherited method is set on the class and deleted after
        restore.append((owner, attribute, original if attribute in vars(owner) else None))
        setattr(owner, attribute, timed_step(label, original))
    pf.prepare, pf.finalize = timed_phase("prepare", pf.prepare), timed_phase("finalize", pf.finalize)
    try:
        call()
        synchronize(device)
        totals.clear()
        for _ in range(BREAKDOWN_CALLS):
            call()
        synchronize(device)
    finally:
        for owner, attribute, original in restore:
            if original is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)
        del pf.prepare, pf.finalize
    result: dict[str, dict[str, float]] = {}
    for (name, label), seconds in totals.items():
        result.setdefault(name, {})[label] = seconds / BREAKDOWN_CALLS * 1e6
    for steps in result.values():
        steps["rest"] = steps.get("total", 0.0) - sum(v for k, v in steps.items() if k != "total")
    return result


def render_breakdown(breakdown: dict) -> str:
    return "; ".join(
        f"{name} {steps['total']:.0f} µs: " + ", ".join(f"{k} {v:.0f}" for k, v in steps.items() if k != "total")
        for name, steps in breakdown.items() if "total" in steps
    )


def bench_case(pf_kind: str, quant: str, tokens: int, route: str, ctx, args, warmup: int, iters: int) -> Optional[dict]:
    device, rank, world = ctx.device, ctx.rank, ctx.world_size
    if pf_kind.endswith("_graph") and device.type != "cuda":
        return None  # CUDA graphs need CUDA
    limit = args.fixed_max_gib if args.fixed_max_gib is not None else (60.0 if device.type == "cuda" else 1.5)
    if pf_kind.startswith("fixed") and fixed_slab_gib(tokens, world, quant) > limit:
        return {"skipped": f"fixed-capacity slabs need {fixed_slab_gib(tokens, world, quant):.1f} GiB > --fixed-max-gib {limit}"}
    quantize = quantizer_for(quant, device)
    gen = torch.Generator(device="cpu").manual_seed(100 + rank)
    hidden = torch.randn(tokens, HIDDEN, generator=gen).to(DTYPE).to(device)
    ids, weights = routing(tokens, device, seed=200 + rank, kind=route)
    output = torch.empty_like(hidden)
    args_ = (ctx, tokens, hidden, ids, weights, quantize, output)
    if pf_kind == "all2all":
        case = all2all_case(*args_)
    elif pf_kind == "allgather":
        case = allgather_case(*args_)
    elif pf_kind.startswith("capped"):
        case = capped_case(*args_, graph=pf_kind == "capped_graph")
    else:
        case = fixed_case(*args_, graph=pf_kind == "fixed_graph")

    pf_times, host_times = timed(case.step, device, warmup, iters)
    base_times, base_host = timed(case.baseline, device, warmup, iters)
    fresh_times, fresh_host = timed(case.fresh_baseline, device, warmup, iters) if case.fresh_baseline else ([], [])
    quant_times = timed(lambda: quantize(hidden), device, warmup, iters)[0] if quantize is not None else [0.0]
    pf_b2b, base_b2b = back_to_back(case.step, device, iters), back_to_back(case.baseline, device, iters)
    breakdown = None
    if args.host_breakdown and case.eager_all2all is not None:
        breakdown = host_breakdown(case.eager_all2all, case.step, device)
        if rank == 0:
            print(f"--- host breakdown (rank 0, µs a call): {case.pf} {quant} {route} {tokens} tok/rank: "
                  f"{render_breakdown(breakdown)}", flush=True)
    if args.profile:
        table = profile_table(case.step, device, record=rank == 0)
        if rank == 0:
            print(f"--- profile: {case.pf} {quant} {route} {tokens} tok/rank\n{table}", flush=True)
    return {
        "pf": case.pf,
        "quant": quant,
        "tokens_per_rank": tokens,
        "routing": route,
        "rank": rank,
        "dispatch_row_bytes": case.row_bytes,
        "rows_dispatched": case.rows_sent,
        "bytes": case.nbytes,
        "pf_median_s": statistics.median(pf_times),
        "host_median_s": statistics.median(host_times),
        "quantize_median_s": statistics.median(quant_times),
        "baseline": case.baseline_name,
        "baseline_median_s": statistics.median(base_times),
        "baseline_host_median_s": statistics.median(base_host),
        "fresh_baseline_median_s": statistics.median(fresh_times) if fresh_times else None,
        "fresh_baseline_host_median_s": statistics.median(fresh_host) if fresh_host else None,
        "pf_back_to_back_s": pf_b2b,
        "baseline_back_to_back_s": base_b2b,
        "host_breakdown_us": breakdown,
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
        "routing": first["routing"],
        "dispatch_row_bytes": first["dispatch_row_bytes"],
        "rows_dispatched_per_rank": statistics.mean(r["rows_dispatched"] for r in per_rank),
        "bytes_per_rank": nbytes,
        "pf_ms": pf_s * 1e3,
        "host_ms": max(r["host_median_s"] for r in per_rank) * 1e3,
        "pf_gbps": nbytes / pf_s / 1e9,
        "quantize_ms": max(r["quantize_median_s"] for r in per_rank) * 1e3,
        "baseline": first["baseline"],
        "baseline_ms": base_s * 1e3,
        "baseline_host_ms": max(r["baseline_host_median_s"] for r in per_rank) * 1e3,
        "fresh_baseline_ms": _slowest_ms(per_rank, "fresh_baseline_median_s"),
        "fresh_baseline_host_ms": _slowest_ms(per_rank, "fresh_baseline_host_median_s"),
        "baseline_gbps": nbytes / base_s / 1e9,
        "pf_over_baseline": pf_s / base_s,
        "pf_back_to_back_ms": max(r["pf_back_to_back_s"] for r in per_rank) * 1e3,
        "baseline_back_to_back_ms": max(r["baseline_back_to_back_s"] for r in per_rank) * 1e3,
        "back_to_back_over_baseline": max(r["pf_back_to_back_s"] for r in per_rank)
        / max(r["baseline_back_to_back_s"] for r in per_rank),
        "per_rank": per_rank,
    }


def _slowest_ms(per_rank: list[dict], key: str) -> Optional[float]:
    """The slowest rank's median in ms, None where the case has no such figure."""
    values = [r[key] for r in per_rank if r.get(key) is not None]
    return max(values) * 1e3 if values else None


def target_lines(cases: list[dict]) -> list[str]:
    """Issue 42's targets per (payload, routing, tokens): all-to-all over bare, the P/Fs that send fixed blocks (no
    host read) over the variable one, the replays over the eager calls."""
    by = {(c["quant"], c["routing"], c["tokens_per_rank"], c["pf"]): c for c in cases}
    keys = sorted({k[:3] for k in by}, key=lambda k: (k[0], k[1], k[2]))
    variable, fixed = AllToAllPrepareFinalize.name, FixedCapacityAllToAllPrepareFinalize.name
    capped = variable + " (max_tokens_per_rank"
    rows = []
    for key in keys:
        a2a = by.get((*key, variable))
        if a2a is None:
            continue
        eager, graph = by.get((*key, fixed)), by.get((*key, fixed + " (CUDA graph)"))
        capped_eager, capped_graph = by.get((*key, capped + ")")), by.get((*key, capped + ", CUDA graph)"))
        cell = lambda num, den: f"{num['pf_ms'] / den['pf_ms']:.2f}x" if num and den else "-"  # noqa: E731
        best_fixed = min((c for c in (eager, graph) if c), key=lambda c: c["pf_ms"], default=None)
        over_bare = lambda c: f"{c['pf_ms'] * 1e3:.0f} µs, {c['pf_over_baseline']:.2f}x" if c else "-"  # noqa: E731
        rows.append(f"| {key[0]} | {key[1]} | {key[2]} | {a2a['pf_ms'] * 1e3:.0f} | {a2a['pf_over_baseline']:.2f}x | "
                    f"{over_bare(capped_graph)} | {cell(best_fixed, a2a)} | {cell(graph, eager)} | "
                    f"{cell(capped_graph, capped_eager)} |")
    if not rows:
        return []
    return ["", "Targets (issue 42): all-to-all P/F over the bare collectives (<= 1.3x at 4096 tokens/rank; <= 3x and "
            "<= 250 µs at 128; the variable call, and the call with max_tokens_per_rank replayed in a CUDA graph over "
            "the bare equal-split collectives), the faster fixed-capacity call (eager or replay) over the variable one "
            "(<= 1.2x), the replays over the eager calls (<= 1x):", "",
            "| payload | routing | tokens/rank | all-to-all µs | over bare | max_tokens_per_rank replayed | "
            "fixed / variable | replay / eager (fixed) | replay / eager (max_tokens_per_rank) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|", *rows]


def release_memory(device: torch.device) -> None:
    """Return the last case's buffers (the fixed-capacity slabs reach tens of GiB) before the next one allocates."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def layer_case(quant: str, tokens: int, ctx, warmup: int, iters: int) -> dict:
    """This rank's EP layer and the single-GPU layer of its shape: medians and the EP layer's stage split."""
    from moe_fsm.experts.triton_experts import TritonExperts
    from moe_fsm.inputs.layer import MoELayer
    from moe_fsm.modular.kernel import ModularKernel, StageClock
    from moe_fsm.prepare_finalize.local import LocalPrepareFinalize
    from moe_fsm.quantize.weights import quantize_weights

    device, rank, world = ctx.device, ctx.rank, ctx.world_size
    scheme = QUANTS[quant] or QuantScheme.unquantized()
    local_experts = NUM_EXPERTS // world
    gen = torch.Generator(device=device).manual_seed(300 + rank)
    w1 = (torch.randn(local_experts, 2 * INTERMEDIATE, HIDDEN, generator=gen, device=device) * 0.02).to(DTYPE)
    w2 = (torch.randn(local_experts, HIDDEN, INTERMEDIATE, generator=gen, device=device) * 0.02).to(DTYPE)
    w1, w2, scales = quantize_weights(w1, w2, scheme)
    hidden = torch.randn(tokens, HIDDEN, generator=gen, device=device).to(DTYPE)

    def layer(num_experts: int) -> MoELayer:
        return MoELayer(quant=scheme, num_experts=num_experts, top_k=TOP_K, hidden_size=HIDDEN,
                        intermediate_size=INTERMEDIATE, dtype="bfloat16")

    placement = ExpertPlacement(NUM_EXPERTS, world, rank)
    ep_layer = layer(NUM_EXPERTS)
    ep = ModularKernel(AllToAllPrepareFinalize(placement), TritonExperts(ep_layer), ep_layer)
    ep_ids, ep_weights = routing(tokens, device, seed=400 + rank)
    expert_map = placement.expert_map(device)
    single_layer = layer(local_experts)
    single = ModularKernel(LocalPrepareFinalize(), TritonExperts(single_layer), single_layer)
    ids, weights = routing(tokens, device, seed=500 + rank, num_experts=local_experts)

    def ep_call() -> None:
        ep(hidden, w1, w2, ep_weights, ep_ids, scales=scales, expert_map=expert_map, check_values=False)

    def single_call() -> None:
        single(hidden, w1, w2, weights, ids, scales=scales, check_values=False)

    for _ in range(warmup):
        ep_call()
    ep.stage_clock = StageClock()
    ep_times = timed(ep_call, device, 0, iters)
    stages = ep.stage_clock.medians()
    ep.stage_clock = None
    single_times = timed(single_call, device, warmup, iters)
    return {"quant": quant, "tokens_per_rank": tokens, "rank": rank, "ep_s": statistics.median(ep_times),
            "single_s": statistics.median(single_times), **{f"{k}_ms": v for k, v in stages.items()}}


def summarize_layer(per_rank: list[dict]) -> dict:
    first = per_rank[0]
    ep_s, single_s = max(r["ep_s"] for r in per_rank), max(r["single_s"] for r in per_rank)
    return {"quant": first["quant"], "tokens_per_rank": first["tokens_per_rank"], "ep_ms": ep_s * 1e3,
            "single_ms": single_s * 1e3, "ep_over_single": ep_s / single_s,
            **{f"{k}_ms": max(r[f"{k}_ms"] for r in per_rank) for k in ("dispatch", "experts", "combine")},
            "per_rank": per_rank}


def render_layer_line(c: dict) -> str:
    return (f"EP layer {c['quant']:<5} {c['tokens_per_rank']:>5} tok/rank: {c['ep_ms']:8.3f} ms (dispatch {c['dispatch_ms']:.3f}, "
            f"experts {c['experts_ms']:.3f}, combine {c['combine_ms']:.3f}) | single-GPU layer {c['single_ms']:8.3f} ms "
            f"| {c['ep_over_single']:.2f}x")


def device_name(ctx) -> str:
    if ctx.device.type == "cuda":
        return torch.cuda.get_device_name(ctx.device)
    return f"{platform.processor() or platform.machine()} CPU ({os.cpu_count()} cores)"


def write_report(out: Path, meta: dict, cases: list[dict], skipped: list[str], layers: list[dict]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"distributed_{meta['backend']}_w{meta['world_size']}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "cases": cases, "skipped": skipped, "layers": layers}, indent=1))
    lines = [
        f"# Distributed dispatch + combine: {meta['backend']}, {meta['world_size']} ranks",
        "",
        f"- device: {meta['device']}; torch {meta['torch']}" + (f"; NCCL {meta['nccl']}" if meta.get("nccl") else ""),
        f"- shape: DeepSeek-V3 MoE, E={NUM_EXPERTS}, K={HIDDEN}, top-{TOP_K}, bf16 activations, experts split evenly "
        f"over the ranks; routing uniform (top-8 of uniform scores) or skewed (experts drawn with Zipf weights 1/(e+1): "
        f"the lower ranks' experts are hot)",
        f"- timing: median of {meta['iters']} calls after {meta['warmup']} warm-up call(s), slowest rank; each call starts "
        f"after a barrier and ends with a device sync",
        "- GB/s: algorithm bandwidth (per-rank bytes of the larger buffer of each collective, dispatch + combine); "
        "the P/F and its baseline are charged the same bytes",
        "- host ms: the slowest rank's median time until the call returned, before the device sync (the host's share); "
        "bare host ms: the same for the bare collectives (the host time of the collectives alone); new outputs: the "
        "bare all-to-alls receiving into tensors allocated on each call (ms, host ms), what the caching allocator adds",
        "- back to back: the slowest rank's time per call over calls made one after another without a barrier or sync "
        "between them (median of 3 runs of as many calls as the timed ones), the P/F's and the bare collectives' "
        "(an engine's layer after layer: a call's host work overlaps the device work before it)",
        "- quantize ms: the activation quantizer alone on the rank's tokens, as a separate pass (the all-to-all P/Fs quantize inside their send-row kernel on CUDA; the all-gather P/F calls it)",
        f"- environment: {', '.join(f'{k}={v}' for k, v in meta['env'].items()) or 'none of the recorded variables set'}",
        f"- host load average at the end (1, 5, 15 min): {', '.join(map(str, meta['load_average']))} on {os.cpu_count()} cores",
        f"- command: `{meta['command']}`",
        f"- run at {meta['date']}",
        "",
        "| P/F | payload | routing | tokens/rank | row bytes | rows sent/rank | MB/rank | P/F ms | host ms | quantize ms | P/F GB/s | baseline | baseline ms | bare host ms | new outputs ms (host) | baseline GB/s | P/F / baseline | back to back ms: P/F, bare | back to back: P/F / bare |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cases:
        fresh = (f"{c['fresh_baseline_ms']:.3f} ({c['fresh_baseline_host_ms']:.3f})"
                 if c.get("fresh_baseline_ms") is not None else "-")
        lines.append(
            f"| {c['pf']} | {c['quant']} | {c['routing']} | {c['tokens_per_rank']} | {c['dispatch_row_bytes']} | "
            f"{c['rows_dispatched_per_rank']:.0f} | {c['bytes_per_rank'] / 1e6:.1f} | {c['pf_ms']:.3f} | {c['host_ms']:.3f} | "
            f"{c['quantize_ms']:.3f} | "
            f"{c['pf_gbps']:.2f} | {c['baseline']} | {c['baseline_ms']:.3f} | {c['baseline_host_ms']:.3f} | {fresh} | "
            f"{c['baseline_gbps']:.2f} | {c['pf_over_baseline']:.2f}x | {c['pf_back_to_back_ms']:.3f}, "
            f"{c['baseline_back_to_back_ms']:.3f} | {c['back_to_back_over_baseline']:.2f}x |"
        )
    lines += target_lines(cases)
    if layers:
        lines += ["", "Whole EP layer (dispatch + TritonExperts + combine) against the single-GPU layer of the same per-rank "
                  f"shape ({NUM_EXPERTS // meta['world_size']} experts, intermediate {INTERMEDIATE}, uniform routing; "
                  "slowest rank's medians; the stages are CUDA-event medians of the same calls):", "",
                  "| payload | tokens/rank | EP layer ms | dispatch ms | experts ms | combine ms | single-GPU layer ms | EP / single |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for c in layers:
            lines.append(f"| {c['quant']} | {c['tokens_per_rank']} | {c['ep_ms']:.3f} | {c['dispatch_ms']:.3f} | "
                         f"{c['experts_ms']:.3f} | {c['combine_ms']:.3f} | {c['single_ms']:.3f} | {c['ep_over_single']:.2f}x |")
    if skipped:
        lines += ["", "Not run:", *(f"- {line}" for line in skipped)]
    lines.append("")
    md = out / f"{stem}.md"
    md.write_text("\n".join(lines))
    return md


def run_meta(ctx, warmup: int, iters: int) -> dict:
    gpu = ctx.device.type == "cuda"
    return {
        "backend": ctx.backend,
        "world_size": ctx.world_size,
        "device": device_name(ctx),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None,
        "warmup": warmup,
        "iters": iters,
        "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ},
        "load_average": [round(v, 1) for v in os.getloadavg()],
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def run_rank(args: argparse.Namespace) -> int:
    ctx = init_from_env()
    try:
        gpu = ctx.device.type == "cuda"
        warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
        iters = args.iters if args.iters is not None else (20 if gpu else 5)
        cases, skipped, layers = [], [], []
        for quant in args.quant:
            for route in args.routing:
                for tokens in args.tokens:
                    for pf_kind in args.pf:
                        mine = bench_case(pf_kind, quant, tokens, route, ctx, args, warmup, iters)
                        release_memory(ctx.device)
                        if mine is None or "skipped" in mine:
                            if ctx.rank == 0:
                                why = mine["skipped"] if mine else "CUDA graphs need CUDA devices"
                                skipped.append(f"{pf_kind}, {quant}, {route}, {tokens} tokens/rank: {why}")
                            continue
                        gathered: list[Optional[dict]] = [None] * ctx.world_size
                        dist.all_gather_object(gathered, mine)
                        if ctx.rank == 0:
                            case = summarize(gathered)
                            cases.append(case)
                            write_report(Path(args.out), run_meta(ctx, warmup, iters), cases, skipped, layers)  # a cut run keeps what it measured
                            print(
                                f"{case['pf']:<52} {quant:<5} {route:<7} {tokens:>5} tok/rank: P/F {case['pf_ms']:9.3f} ms "
                                f"(quantize {case['quantize_ms']:7.3f}) | {case['baseline']}: {case['baseline_ms']:9.3f} ms "
                                f"| {case['pf_over_baseline']:.2f}x | back to back {case['pf_back_to_back_ms']:.3f} / "
                                f"{case['baseline_back_to_back_ms']:.3f} ms = {case['back_to_back_over_baseline']:.2f}x",
                                flush=True,
                            )
        if args.with_experts and ctx.device.type == "cuda":
            for quant in args.quant:
                for tokens in args.layer_tokens:
                    mine = layer_case(quant, tokens, ctx, warmup, iters)
                    release_memory(ctx.device)
                    gathered = [None] * ctx.world_size
                    dist.all_gather_object(gathered, mine)
                    if ctx.rank == 0:
                        layers.append(summarize_layer(gathered))
                        write_report(Path(args.out), run_meta(ctx, warmup, iters), cases, skipped, layers)
                        print(render_layer_line(layers[-1]), flush=True)
        elif args.with_experts and ctx.rank == 0:
            skipped.append("--with-experts: the Triton experts need CUDA devices")
        if ctx.rank == 0:
            print(f"wrote {write_report(Path(args.out), run_meta(ctx, warmup, iters), cases, skipped, layers)}")
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
