"""Where the time goes, under torch.profiler: a decode layer's kernels, an eager forward's host time, a compiled generate().

Three subcommands, one per question; each prints its rows as it measures them and writes them as JSON with ``--json``:

``decode``: a decode layer call's device time, kernel by kernel. For each named layer shape and token count
(``fused_experts`` with the runtime's own config): the layer's time as ``tuning.time_graph`` measures it (CUDA-graph
replays over R routings, L2 flushed), then R eager calls under the profiler, and per kernel name its mean device µs
per call, next to the layer's weight-bandwidth roofline (hit experts' bytes at the measured copy rate). What the
kernels do not add up to is the gaps between launches.

``forward``: an eager whole-model forward's host time, per experts implementation. Builds ``bench_transformers``'s
model, enables moe_fsm, then for each implementation profiles ``--forwards`` eager forwards at ``--tokens`` after
warm-up and prints the operators by self CPU time, the synchronizing calls (cudaStreamSynchronize,
cudaDeviceSynchronize, device-to-host copies) per forward, and the wall time of a forward without the profiler.

``generate``: a compiled ``generate()`` decoding step, per experts implementation. ``bench_transformers.py
--generate`` gives tokens/s; this says why: it compiles transformers' decoding step (static cache, ``fullgraph=True``,
``--mode``), reports whether Inductor took CUDA graphs or skipped them (its ``cudagraph_skips`` counter and the skip
messages it logs), the wall time of a ``generate()`` call, and under the profiler the CUDA-graph launches per call,
the device time of all kernels per generated token and the kernels that take most of it.

    python bench/profile_breakdown.py decode [--series qwen3-30b-a3b-tp2 ...] [--tokens 1 8 32] [--json PATH]
    python bench/profile_breakdown.py forward --shape qwen3-30b-a3b --layers 4 --tokens 1 --device cuda
    python bench/profile_breakdown.py generate --shape qwen3-30b-a3b --layers 4 --batch 1
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "aten::item", "aten::_local_scalar_dense")
LAUNCHES = ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize")


def ranked(averages, time_of, per: int, top: int | None = None, width: int = 120) -> list[tuple[str, float, float]]:
    """The profiler's key averages by ``time_of``, longest first: (name, calls per unit, µs per unit).

    A unit is what the profile is divided by (a layer call, a forward, a generated token), so rows of profiles of
    different lengths compare.
    """
    rows = sorted(averages, key=time_of, reverse=True)[:top]
    return [(a.key[:width], a.count / per, time_of(a) / per) for a in rows]


def print_rows(rows: list[tuple[str, float, float]], what: str, unit: str) -> None:
    """One line per row: µs per unit, calls per unit, the name."""
    for key, count, us in rows:
        print(f"   {us:9.1f} µs {what}  {count:6.1f} calls/{unit}  {key[:100]}")


def write_json(path, results) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=1))


def cuda_kernels(averages):
    import torch

    return [a for a in averages if a.device_type == torch.autograd.DeviceType.CUDA]


def decode(args) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench_experts_roofline import measure_ceilings
    from bench_experts_vs_vllm import expert_bytes
    from moe_fsm.kernels.triton_moe import get_config
    from moe_fsm.kernels.triton_moe._runtime import device_name
    from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES, layer_fn, make_weights, replays_per_graph, routings, time_graph

    copy_gbps = measure_ceilings()["copy_GBps"]
    rows = []
    for series in args.series or list(NAMED_SHAPES):
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
            kernels = ranked(cuda_kernels(prof.key_averages()), lambda a: a.self_device_time_total, len(inputs), width=60)
            config = get_config(device_name(torch.device("cuda", 0)), shape.num_experts, shape.intermediate, shape.hidden,
                                shape.top_k, t, shape.dtype, shape.fp8)
            row = {"series": series, "tokens": t, "graph_us": graph_us, "roofline_us": roofline,
                   "kernels_us": {name: us for name, _, us in kernels},
                   "kernel_sum_us": sum(us for _, _, us in kernels), "config": config.to_json()}
            rows.append(row)
            print(f"{series:28s} T={t:3d} graph {graph_us:7.1f} µs  roofline {roofline:7.1f}  x{graph_us / roofline:5.2f}  "
                  f"kernels {row['kernel_sum_us']:7.1f}: " + ", ".join(f"{k[:34]} {v:.1f}" for k, v in row["kernels_us"].items()),
                  flush=True)
        del weights, fn
        torch.cuda.empty_cache()
    write_json(args.json, rows)


def forward(args) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench_transformers import build_model
    from moe_fsm.integrations.transformers import enable

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
        row = {"wall_ms": wall_ms, "syncs_per_forward": syncs,
               "top_self_cpu": ranked(averages, lambda a: a.self_cpu_time_total, args.forwards, args.top)}
        results["rows"][impl] = row
        print(f"== {impl}: {wall_ms:.3f} ms per forward (no profiler); syncing calls per forward: {syncs}")
        print_rows(row["top_self_cpu"], "self CPU", "forward")
    write_json(args.json, results)


class _InductorMessages(logging.Handler):
    """Keeps the records Inductor's CUDA-graph code logs (skips are logged, not raised)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "cudagraph" in message.lower() or "skipping" in message.lower():
            self.lines.append(message[:300])


def generate(args) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    from bench_transformers import build_model, register_free_experts
    from moe_fsm.integrations.transformers import enable

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    messages = _InductorMessages()
    for name in ("torch._inductor", "torch._inductor.cudagraph_trees", "torch._inductor.utils"):
        logging.getLogger(name).addHandler(messages)
    register_free_experts()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    model = build_model(args.shape, args.layers, torch.bfloat16 if cuda else torch.float32, device)
    with tempfile.TemporaryDirectory() as traces:
        enable(model, env={}, trace_dir=traces)
    compile_config = CompileConfig(fullgraph=True, mode=args.mode)
    compile_config._compile_all_devices = True  # transformers compiles only on accelerators unless told
    config = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                              cache_implementation="static", compile_config=compile_config,
                              pad_token_id=0, eos_token_id=None, bos_token_id=None)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt),
                           generator=torch.Generator().manual_seed(args.batch)).to(device)
    results = {"shape": args.shape, "layers": args.layers, "batch": args.batch, "new_tokens": args.new_tokens,
               "mode": args.mode, "device_name": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__, "rows": {}}
    for impl in args.impls:
        model.set_experts_implementation(impl)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        messages.lines.clear()
        for attr in ("_compiled_call", "_last_compile_config"):
            if hasattr(model, attr):
                delattr(model, attr)
        with torch.no_grad():
            model.generate(prompt, generation_config=config)  # compiles
            model.generate(prompt, generation_config=config)  # records the CUDA graphs
            sync()
            walls = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                model.generate(prompt, generation_config=config)
                sync()
                walls.append((time.perf_counter() - start) * 1e3)
            with profile(activities=activities) as prof:
                model.generate(prompt, generation_config=config)
                sync()
        inductor = {k: v for k, v in torch._dynamo.utils.counters["inductor"].items() if "cudagraph" in k}
        averages = prof.key_averages()
        kernels = cuda_kernels(averages)
        ms = statistics.median(walls)
        row = {"wall_ms": ms, "ms_per_token": ms / args.new_tokens, "tokens_per_s": args.batch * args.new_tokens / ms * 1e3,
               "inductor_cudagraph_counters": inductor, "cudagraph_messages": messages.lines[:10],
               "device_us_per_token": sum(a.self_device_time_total for a in kernels) / args.new_tokens,
               "host_calls_per_generate": {a.key: a.count for a in averages if a.key in LAUNCHES},
               "top_kernels": ranked(kernels, lambda a: a.self_device_time_total, args.new_tokens, args.top)}
        results["rows"][impl] = row
        print(f"== {impl}: {row['tokens_per_s']:.1f} tok/s, {row['ms_per_token'] * 1e3:.1f} µs wall per token, "
              f"{row['device_us_per_token']:.1f} µs of kernels per token; cudagraph counters {inductor}; "
              f"host calls {row['host_calls_per_generate']}")
        for line in row["cudagraph_messages"]:
            print(f"   log: {line}")
        print_rows(row["top_kernels"], "device", "token")
    write_json(args.json, results)


def main(argv: list[str] | None = None) -> None:
    from bench_transformers import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    d = commands.add_parser("decode", help="a decode layer call's kernels (CUDA)")
    d.add_argument("--series", nargs="*", default=None, help="named shapes of moe_fsm.kernels.triton_moe.tuning (default: all)")
    d.add_argument("--tokens", nargs="*", type=int, default=[1, 8, 32])
    f = commands.add_parser("forward", help="an eager model forward's host time")
    f.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    f.add_argument("--layers", type=int, default=4)
    f.add_argument("--tokens", type=int, default=1)
    f.add_argument("--device", default="cuda")
    f.add_argument("--impls", nargs="+", default=["batched_mm", "grouped_mm", "moe_fsm"])
    f.add_argument("--forwards", type=int, default=10)
    f.add_argument("--top", type=int, default=18)
    g = commands.add_parser("generate", help="a compiled generate()'s decoding step")
    g.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--new-tokens", type=int, default=64)
    g.add_argument("--prompt", type=int, default=16)
    g.add_argument("--mode", default="reduce-overhead")
    g.add_argument("--impls", nargs="+", default=["grouped_mm", "moe_fsm", "free_experts"])
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--top", type=int, default=12)
    g.add_argument("--device", default="cuda", help="cpu only checks that the script runs")
    for sub in (d, f, g):
        sub.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    {"decode": decode, "forward": forward, "generate": generate}[args.command](args)


if __name__ == "__main__":
    main()
