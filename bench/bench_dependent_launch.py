"""Programmatic dependent launch (PDL) off and on, side by side: each named layer at each token count.

For every point: the runtime's own table config, the outputs of both settings compared bit for bit (eager),
then ``tuning.time_graph`` (CUDA-graph replays, L2 flushed) three times per setting, interleaved; the medians.
``MOE_FSM_PDL`` is what switches (``moe_fsm.kernels.triton_moe._runtime``). Kernels are compiled first by
``tuning.precompile`` (14 worker processes, two-expert copies of the layers), once per setting.

    python bench/bench_dependent_launch.py [SERIES,SERIES,...] [TOKENS,TOKENS,...] [JSON]
    python bench/bench_dependent_launch.py qwen3-30b-a3b-tp2,mixtral-8x7b-fp8-tensor 1,8,32,128 pdl.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

VARIANTS = ["off", "on"]


def set_variant(v: str) -> None:
    os.environ["MOE_FSM_PDL"] = "0" if v == "off" else "1"


def main() -> None:
    import torch

    from moe_fsm.kernels.triton_moe import get_config
    from moe_fsm.kernels.triton_moe._runtime import device_name
    from moe_fsm.kernels.triton_moe.tuning import (
        NAMED_SHAPES, layer_fn, make_weights, precompile, replays_per_graph, routings, time_graph,
    )

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("series", nargs="?", default=",".join(NAMED_SHAPES),
                        help=f"comma-separated layer names, of: {', '.join(NAMED_SHAPES)}")
    parser.add_argument("tokens", nargs="?", default="1,8,32,128", help="comma-separated token counts")
    parser.add_argument("json", nargs="?", type=Path, default=Path("pdl_probe.json"))
    args = parser.parse_args()
    series_list = args.series.split(",")
    unknown = [s for s in series_list if s not in NAMED_SHAPES]
    if unknown:
        parser.error(f"unknown layer {unknown}; accepted: {', '.join(NAMED_SHAPES)}")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"token counts are comma-separated integers, got {args.tokens!r}")

    device = device_name(torch.device("cuda", 0))
    jobs = []
    for series in series_list:
        shape = NAMED_SHAPES[series]
        jobs += [(shape, t, get_config(device, shape.num_experts, shape.intermediate, shape.hidden, shape.top_k, t,
                                       shape.dtype, shape.fp8)) for t in tokens]
    start = time.time()
    fails = []
    for v in VARIANTS:  # the workers are spawned with this setting in their environment
        set_variant(v)
        fails += precompile(jobs, workers=14)
    print(f"precompiled {len(jobs)} points x {len(VARIANTS)} settings in {time.time() - start:.0f} s; "
          f"failures: {fails}", flush=True)
    rows = []
    for series in series_list:
        shape = NAMED_SHAPES[series]
        w = make_weights(shape)
        fn = layer_fn(shape, w, None)
        for t in tokens:
            routes = routings(t, shape.num_experts, shape.top_k, replays_per_graph(t), seed=t)
            gen = torch.Generator(device="cuda").manual_seed(t + 1)
            inputs = [(torch.randn(t, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=gen), g, ids)
                      for g, ids in routes]
            outputs = {}
            for v in VARIANTS:
                set_variant(v)
                outputs[v] = torch.stack([fn(*a) for a in inputs])
            torch.cuda.synchronize()
            same = {v: bool(torch.equal(y, outputs["off"])) for v, y in outputs.items()}
            times = {v: [] for v in VARIANTS}
            for _ in range(3):
                for v in VARIANTS:
                    set_variant(v)
                    times[v].append(time_graph(fn, inputs, 40.0))
            med = {v: statistics.median(x) for v, x in times.items()}
            rows.append(dict(series=series, tokens=t, us=med, all=times, equal=same))
            print(f"{series:28s} T={t:4d} " + "  ".join(f"{v} {med[v]:7.1f} (x{med['off'] / med[v]:.3f})" for v in VARIANTS)
                  + ("" if all(same.values()) else "  OUTPUTS DIFFER"), flush=True)
        del w, fn
        torch.cuda.empty_cache()
    args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
