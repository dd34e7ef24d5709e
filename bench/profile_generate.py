"""Where a compiled ``generate()`` decoding step spends its time, per experts implementation (torch.profiler).

``bench_transformers.py --generate`` gives tokens/s; this says why: for each implementation it compiles
transformers' decoding step (static cache, ``fullgraph=True``, ``--mode``), reports whether Inductor took CUDA
graphs or skipped them (and why: its ``cudagraph_skips`` counter and the skip messages it logs), the wall time
of a ``generate()`` call, and under the profiler the CUDA-graph launches per call, the device time of all
kernels per generated token and the kernels that take most of it.

    python bench/profile_generate.py --shape qwen3-30b-a3b --layers 4 --batch 1
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench_transformers import SHAPES, build_model, register_free_experts
from moe_fsm.integrations.transformers import enable


class _Messages(logging.Handler):
    """Keeps the records Inductor's CUDA-graph code logs (skips are logged, not raised)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "cudagraph" in message.lower() or "skipping" in message.lower():
            self.lines.append(message[:300])


def main() -> None:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--mode", default="reduce-overhead")
    parser.add_argument("--impls", nargs="+", default=["grouped_mm", "moe_fsm", "free_experts"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--device", default="cuda", help="cpu only checks that the script runs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    messages = _Messages()
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
        kernels = [a for a in averages if a.device_type == torch.autograd.DeviceType.CUDA]
        device_us = sum(a.self_device_time_total for a in kernels)
        launches = {a.key: a.count for a in averages if a.key in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel",
                                                                 "cudaMemcpyAsync", "cudaStreamSynchronize")}
        top = sorted(kernels, key=lambda a: a.self_device_time_total, reverse=True)[: args.top]
        ms = statistics.median(walls)
        row = {"wall_ms": ms, "ms_per_token": ms / args.new_tokens, "tokens_per_s": args.batch * args.new_tokens / ms * 1e3,
               "inductor_cudagraph_counters": inductor, "cudagraph_messages": messages.lines[:10],
               "device_us_per_token": device_us / args.new_tokens, "host_calls_per_generate": launches,
               "top_kernels": [(a.key[:120], a.count / args.new_tokens, a.self_device_time_total / args.new_tokens)
                               for a in top]}
        results["rows"][impl] = row
        print(f"== {impl}: {row['tokens_per_s']:.1f} tok/s, {row['ms_per_token'] * 1e3:.1f} µs wall per token, "
              f"{row['device_us_per_token']:.1f} µs of kernels per token; cudagraph counters {inductor}; "
              f"host calls {launches}")
        for line in row["cudagraph_messages"]:
            print(f"   log: {line}")
        for key, count, us in row["top_kernels"]:
            print(f"   {us:8.1f} µs/token {count:5.1f} calls/token  {key[:100]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
