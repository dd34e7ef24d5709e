"""Where a decode layer call's device time goes: each kernel of ``fused_experts`` at 1-32 tokens (torch.profiler).

For each named layer shape and token count, with the runtime's own config: the layer's time as
``tuning.time_graph`` measures it (CUDA-graph replays over R routings, L2 flushed), then R eager calls under the
profiler, and per kernel name its mean device µs per call, next to the layer's weight-bandwidth roofline (hit
experts' bytes at the measured copy rate). What the kernels do not add up to is the gaps between launches.

    python bench/profile_decode.py [--series qwen3-30b-a3b-tp2 ...] [--tokens 1 8 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench_gpu import measure_ceilings
    from bench_vs_vllm import expert_bytes
    from moe_fsm.kernels.triton_moe import get_config
    from moe_fsm.kernels.triton_moe._runtime import device_name
    from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES, layer_fn, make_weights, replays_per_graph, routings, time_graph

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--series", nargs="*", default=list(NAMED_SHAPES))
    parser.add_argument("--tokens", nargs="*", type=int, default=[1, 8, 32])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    copy_gbps = measure_ceilings()["copy_GBps"]
    rows = []
    for series in args.series:
        shape = NAMED_SHAPES[series]
        weights = make_weights(shape)
        fn = layer_fn(shape, weights, None)
        for t in args.tokens:
            routes = routings(t, shape.num_experts, shape.top_k, replays_per_graph(t), seed=t)
            gen = torch.Generator(device="cuda").manual_seed(t + 1)
            inputs = [(torch.randn(t, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=gen), g, ids)
                      for g, ids in routes]
            hit = statistics.mean(int(torch.unique(ids).numel()) for _, _, ids in inputs)
            roofline = (hit * expert_bytes(shape) + 4 * t * shape.hidden) / copy_gbps / 1e3
            graph_us = time_graph(fn, inputs, 50.0)
            for args_ in inputs:
                fn(*args_)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for args_ in inputs:
                    fn(*args_)
                torch.cuda.synchronize()
            per_kernel = defaultdict(float)
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    per_kernel[event.name[:60]] += event.device_time / len(inputs)
            config = get_config(device_name(torch.device("cuda", 0)), shape.num_experts, shape.intermediate, shape.hidden,
                                shape.top_k, t, shape.dtype, shape.fp8)
            row = {"series": series, "tokens": t, "graph_us": graph_us, "roofline_us": roofline,
                   "kernels_us": dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])),
                   "kernel_sum_us": sum(per_kernel.values()), "config": config.to_json()}
            rows.append(row)
            print(f"{series:28s} T={t:3d} graph {graph_us:7.1f} µs  roofline {roofline:7.1f}  x{graph_us / roofline:5.2f}  "
                  f"kernels {row['kernel_sum_us']:7.1f}: " + ", ".join(f"{k[:34]} {v:.1f}" for k, v in row["kernels_us"].items()),
                  flush=True)
        del weights, fn
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
