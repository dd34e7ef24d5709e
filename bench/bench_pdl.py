"""Programmatic dependent launch (PDL) off and on, side by side: each named layer at each token count.

For every point: the runtime's own table config, the outputs of both settings compared bit for bit (eager),
then ``tuning.time_graph`` (CUDA-graph replays, L2 flushed) three times per setting, interleaved; the medians.
``MOE_FSM_PDL`` is what switches (``moe_fsm.kernels.triton_moe._runtime``). Kernels are compiled first in 14
worker processes on two-expert copies of the layers.

    python bench/bench_pdl.py [SERIES,SERIES,...] [TOKENS,TOKENS,...] [JSON]
    python bench/bench_pdl.py qwen3-30b-a3b-tp2,mixtral-8x7b-fp8-tensor 1,8,32,128 pdl.json
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

VARIANTS = ["off", "on"]


def set_variant(v: str) -> None:
    os.environ["MOE_FSM_PDL"] = "0" if v == "off" else "1"


def worker(jobs):
    """Run each (series, tokens, setting) once on a two-expert copy, so that its kernels compile."""
    import torch

    from moe_fsm.kernels.triton_moe import get_config
    from moe_fsm.kernels.triton_moe._runtime import device_name
    from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES, layer_fn, make_weights

    fails = []
    for series, t, v in jobs:
        set_variant(v)
        shape = NAMED_SHAPES[series].with_experts(2) if NAMED_SHAPES[series].num_experts > 2 else NAMED_SHAPES[series]
        try:
            w = make_weights(shape, init=False)
            x = torch.zeros(t, shape.hidden, device="cuda", dtype=torch.bfloat16)
            ids = torch.arange(shape.top_k, device="cuda", dtype=torch.int32).repeat(t, 1) % 2
            g = torch.full(ids.shape, 1.0 / shape.top_k, device="cuda")
            full = NAMED_SHAPES[series]
            cfg = get_config(device_name(torch.device("cuda", 0)), full.num_experts, full.intermediate, full.hidden,
                             full.top_k, t, full.dtype, full.fp8)
            layer_fn(shape, w, cfg)(x, g, ids)
            torch.cuda.synchronize()
        except Exception as exc:
            fails.append(f"{series} {t} {v}: {type(exc).__name__} {str(exc)[:200]}")
    return fails


def main() -> None:
    import torch

    from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES, layer_fn, make_weights, replays_per_graph, routings, time_graph

    series_list = sys.argv[1].split(",") if len(sys.argv) > 1 else list(NAMED_SHAPES)
    tokens = [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8, 32, 128]
    out = sys.argv[3] if len(sys.argv) > 3 else "pdl_probe.json"
    jobs = [(s, t, v) for s in series_list for t in tokens for v in VARIANTS]
    t0 = time.time()
    with mp.get_context("spawn").Pool(14) as pool:
        fails = [f for fs in pool.map(worker, [jobs[i::14] for i in range(14)]) for f in fs]
    print(f"precompiled {len(jobs)} in {time.time()-t0:.0f}s; fails: {fails}", flush=True)
    rows = []
    for series in series_list:
        shape = NAMED_SHAPES[series]
        w = make_weights(shape)
        fn = layer_fn(shape, w, None)
        for t in tokens:
            routes = routings(t, shape.num_experts, shape.top_k, replays_per_graph(t), seed=t)
            gen = torch.Generator(device="cuda").manual_seed(t + 1)
            inputs = [(torch.randn(t, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=gen), g, ids) for g, ids in routes]
            ref = None
            same = {}
            for v in VARIANTS:
                set_variant(v)
                y = torch.stack([fn(*a) for a in inputs]); torch.cuda.synchronize()
                if ref is None:
                    ref = y
                same[v] = bool(torch.equal(y, ref))
            times = {v: [] for v in VARIANTS}
            for _ in range(3):
                for v in VARIANTS:
                    set_variant(v)
                    times[v].append(time_graph(fn, inputs, 40.0))
            med = {v: statistics.median(x) for v, x in times.items()}
            row = dict(series=series, tokens=t, us=med, all=times, equal=same)
            rows.append(row)
            print(f"{series:28s} T={t:4d} " + "  ".join(f"{v} {med[v]:7.1f} (x{med['off']/med[v]:.3f})" for v in VARIANTS) + f" equal={all(same.values())}", flush=True)
        del w, fn
        torch.cuda.empty_cache()
    json.dump(rows, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
