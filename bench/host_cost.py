"""Where the host time of one eager MoE layer call goes (1 token, Qwen3-30B-A3B, H100): cProfile of N calls.

The device work of a one-token call is ~35 µs; anything the host spends above that
is visible to eager callers (no CUDA graph). Prints per-call wall time of a
host-bound loop (no synchronization inside; the launch queue absorbs the kernels)
for ``fused_experts`` and the Decision-built modular kernel, then the top entries
of a cProfile of the latter.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moe_fsm.decision import select  # noqa: E402
from moe_fsm.inputs.layer import MoELayer  # noqa: E402
from moe_fsm.kernels.triton_moe import fused_experts  # noqa: E402
from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES, make_weights, routings  # noqa: E402
from moe_fsm.runtime import build  # noqa: E402


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    shape = NAMED_SHAPES["qwen3-30b-a3b"]
    w1, w2, _, _ = make_weights(shape)
    (g, ids), = routings(1, shape.num_experts, shape.top_k, 1, seed=3)
    x = torch.randn(1, shape.hidden, device="cuda", dtype=torch.bfloat16)
    layer = MoELayer(num_experts=shape.num_experts, top_k=shape.top_k, hidden_size=shape.hidden,
                     intermediate_size=shape.intermediate, dtype="bfloat16")
    kernel = build(select(layer, backend="triton"))
    print(f"fused_experts host us/call: {per_call_us(lambda: fused_experts(x, w1, w2, g, ids)):.1f}")
    print(f"modular kernel host us/call: {per_call_us(lambda: kernel(x, w1, w2, g, ids)):.1f}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(1000):
        kernel(x, w1, w2, g, ids)
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
