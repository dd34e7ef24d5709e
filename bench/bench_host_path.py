"""Where the host time of one eager MoE layer call goes (1 token, Qwen3-30B-A3B dimensions, one GPU).

The device work of a one-token call is tens of µs; whatever the host spends above that is what an eager
forward waits for. Prints the host µs per call (median of ``--rounds`` loops of ``--calls`` calls with no
synchronization inside, few enough that the launch queue never fills, so the figure is host time and not
device time) of each layer of the call path, outermost first: transformers' experts module call, moe-fsm's
``experts_forward``, ``ops.call``, ``EagerGraphs.call`` (pinned and copying graphs); then the floor of a copying
replay (the three torch operations it is made of, on a bare captured graph) and one torch operation for scale; then the path without
graph replay and transformers' ``batched_mm``; then the whole MoE block (router and experts): replayed from one graph
(``integrations/block_graphs.py``), its own forward (transformers' router, then the experts call above), and under
``batched_mm``. Ends with a cProfile of the module call. ``--json`` writes the rows.

    python bench/bench_host_path.py [--calls 100] [--rounds 7] [--json host_path.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_transformers import build_model, experts_inputs  # noqa: E402
from moe_fsm.integrations.block_graphs import installed  # noqa: E402
from moe_fsm.integrations.transformers import enable, experts_forward  # noqa: E402
from moe_fsm.kernels.triton_moe import fused_experts  # noqa: E402
from moe_fsm.modular import ops  # noqa: E402
from moe_fsm.modular.eager_graphs import EagerGraphs  # noqa: E402


def host_us(fn, calls: int, rounds: int) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = build_model("qwen3-30b-a3b", 1, torch.bfloat16, torch.device("cuda"))
    with tempfile.TemporaryDirectory() as traces:
        enabled = enable(model, env={}, trace_dir=traces)
    (module, x, ids, weights), = experts_inputs(model, 1, torch.device("cuda"), torch.bfloat16)
    prepared = next(iter(enabled.modules.values()))
    w1, w2 = module.gate_up_proj, module.down_proj
    model.set_experts_implementation("moe_fsm")
    rows = {}

    def row(name, fn):
        rows[name] = host_us(fn, args.calls, args.rounds)
        print(f"{rows[name]:8.1f} µs  {name}", flush=True)

    with torch.no_grad():
        row("transformers experts module call (moe_fsm, graph replay)", lambda: module(x, ids, weights))
        row("moe_fsm experts_forward", lambda: experts_forward(module, x, ids, weights))
        row("ops.call(graphs=True)", lambda: ops.call(prepared.handle, prepared.kernel, x, w1, w2, weights, ids, None, graphs=True))
        pinned = EagerGraphs(pinned_max_tokens=256)
        row("EagerGraphs.call (pinned graph: inputs where they are; up to 256 tokens)",
            lambda: pinned.call(prepared.handle, prepared.kernel, x, w1, w2, weights, ids, None))
        copying = EagerGraphs(pinned_max_tokens=0)
        row("EagerGraphs.call (copying graph: inputs copied in, output copied out)",
            lambda: copying.call(prepared.handle, prepared.kernel, x, w1, w2, weights, ids, None))
        static = [x.clone(), weights.clone(), ids.clone()]
        out = torch.empty_like(x)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.capture_begin()
            out.copy_(prepared.kernel(*static[:1], w1, w2, static[1], static[2], check_values=False))
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)

        def floor():
            torch._foreach_copy_(static, [x, weights, ids])
            graph.replay()
            return out.clone()

        row("floor: _foreach_copy_ + replay + clone on a bare graph", floor)
        row("floor: replay alone", graph.replay)
        row("copy in: torch._foreach_copy_ of the three inputs", lambda: torch._foreach_copy_(static, [x, weights, ids]))
        row("copy in: three Tensor.copy_", lambda: [s.copy_(t) for s, t in zip(static, (x, weights, ids))])
        row("one torch op for scale: x.clone()", x.clone)
        row("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing)
        prepared.eager_graphs = False
        row("transformers experts module call (moe_fsm, no graph replay)", lambda: module(x, ids, weights))
        prepared.eager_graphs = True
        row("fused_experts (kernels launched, no modular kernel)", lambda: fused_experts(x, w1, w2, weights, ids))
        model.set_experts_implementation("batched_mm")
        row("transformers experts module call (batched_mm)", lambda: module(x, ids, weights))
        model.set_experts_implementation("moe_fsm")
        block = model.model.layers[0].mlp
        block_input = x.view(1, 1, -1)
        row("MoE block call, replayed from one graph (router and experts)", lambda: block(block_input))
        row("MoE block call, its own forward (transformers' router, moe_fsm experts graph)",
            lambda: installed(block).forward(block_input))
        model.set_experts_implementation("batched_mm")
        row("MoE block call (transformers' router, batched_mm)", lambda: block(block_input))
        model.set_experts_implementation("moe_fsm")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(1000):
            module(x, ids, weights)
        profile.disable()
        torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(16)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "calls": args.calls, "rounds": args.rounds, "rows_us": rows}, indent=1))


if __name__ == "__main__":
    main()
