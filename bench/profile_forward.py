"""Where an eager whole-model forward spends its host time, per experts implementation (torch.profiler).

Builds ``bench_transformers``'s model, enables moe_fsm, then for each implementation profiles ``--forwards``
eager forwards at ``--tokens`` after warm-up and prints the operators by self CPU time, the count of
synchronizing calls (cudaStreamSynchronize, cudaDeviceSynchronize, device-to-host copies) per forward, and the
wall time of a forward without the profiler. Writes the rows as JSON with ``--json``.

    python bench/profile_forward.py --shape qwen3-30b-a3b --layers 4 --tokens 1 --device cuda
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench_transformers import SHAPES, build_model
from moe_fsm.integrations.transformers import enable

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "aten::item", "aten::_local_scalar_dense")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--impls", nargs="+", default=["batched_mm", "grouped_mm", "moe_fsm"])
    parser.add_argument("--forwards", type=int, default=10)
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    model = build_model(args.shape, args.layers, torch.bfloat16, device)
    with tempfile.TemporaryDirectory() as traces:
        enable(model, env={}, trace_dir=traces)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(1)).to(device)
    results = {"shape": args.shape, "layers": args.layers, "tokens": args.tokens, "rows": {}}
    for impl in args.impls:
        model.set_experts_implementation(impl)
        with torch.no_grad():
            for _ in range(5):
                model(ids)
            sync()
            start = time.perf_counter()
            for _ in range(args.forwards):
                model(ids)
            sync()
            wall_ms = (time.perf_counter() - start) / args.forwards * 1e3
            with profile(activities=activities) as prof:
                for _ in range(args.forwards):
                    model(ids)
                sync()
        averages = prof.key_averages()
        syncs = {a.key: a.count / args.forwards for a in averages if any(s in a.key for s in SYNCS)}
        top = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[: args.top]
        row = {"wall_ms": wall_ms, "syncs_per_forward": syncs,
               "top_self_cpu": [(a.key, a.count / args.forwards, a.self_cpu_time_total / args.forwards) for a in top]}
        results["rows"][impl] = row
        print(f"== {impl}: {wall_ms:.3f} ms per forward (no profiler); syncing calls per forward: {syncs}")
        for key, count, us in row["top_self_cpu"]:
            print(f"   {us:9.1f} µs self CPU  {count:6.1f} calls  {key[:90]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
