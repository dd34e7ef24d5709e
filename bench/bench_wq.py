"""Benchmark the weight-quantized Triton MoE (MXFP4, INT4) against bf16 Triton experts and the roofline.

Rows: gpt-oss-20b experts in MXFP4 (biases, SwiGLU-OAI clamped at 7) and
Qwen3-30B-A3B experts in GPTQ INT4 (groups of 128), at several token counts.
Each row times, in the same run and on the same routings:

* ``wq``: ``kernels.triton_wq.fused_wq_experts`` on the quantized weights;
* ``bf16``: ``kernels.triton_moe.fused_experts`` (moe-fsm's bf16 Triton experts)
  on bf16 weights of the same shape (no biases: that kernel has none);
* the roofline: max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both
  ceilings measured in this run (bench_gpu.measure_ceilings). Bytes are those of
  the experts the batch hits (quantized weights, scales, biases) plus the
  activations read and written; FLOPs 2 * T * top_k * 3 * N * K.

Timing: median of ``triton.testing.do_bench`` (L2 flushed before each run), eager
calls cycling over 8 routings so no call finds its experts left in L2.

Writes ``<out>/wq.json`` and ``<out>/wq.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_gpu import Shape, do_bench, measure_ceilings, routings  # noqa: E402

from moe_fsm.inputs.quant import QuantScheme  # noqa: E402
from moe_fsm.kernels.triton_moe import fused_experts  # noqa: E402
from moe_fsm.kernels.triton_wq import WeightQuant, fused_wq_experts  # noqa: E402
from moe_fsm.quantize.weights import quantize_weights  # noqa: E402

TOKENS = (1, 8, 32, 128, 512, 2048)
ROWS = {
    "gpt-oss-20b MXFP4": (Shape("gpt-oss-20b", 32, 2880, 2880, 4), QuantScheme.mxfp4(), "swigluoai", 7.0, True),
    "qwen3-30b-a3b GPTQ INT4 g128": (Shape("qwen3-30b-a3b", 128, 2048, 768, 8), QuantScheme.int_wna16(4, 128), "silu", None, False),
}


def _tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def bench_row(name: str, shape: Shape, scheme: QuantScheme, activation: str, limit, bias: bool, ceilings: dict) -> list[dict]:
    e, k, n = shape.num_experts, shape.hidden, shape.intermediate
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(e, 2 * n, k, device="cuda", generator=gen) * k**-0.5
    w2 = torch.randn(e, k, n, device="cuda", generator=gen) * n**-0.5
    w1q, w2q, scales = quantize_weights(w1, w2, scheme)
    if bias:
        scales = replace(scales, w1_bias=0.1 * torch.randn(e, 2 * n, device="cuda", generator=gen, dtype=torch.bfloat16),
                         w2_bias=0.1 * torch.randn(e, k, device="cuda", generator=gen, dtype=torch.bfloat16))
    w1b, w2b = w1.to(torch.bfloat16), w2.to(torch.bfloat16)
    del w1, w2
    quant = WeightQuant.for_scheme(scheme)
    per_expert_q = _tensor_bytes(w1q, w2q, scales.w1_scale, scales.w2_scale, scales.w1_zero_point, scales.w2_zero_point,
                                 scales.w1_bias, scales.w2_bias) / e
    per_expert_bf16 = _tensor_bytes(w1b, w2b) / e
    rows = []
    for tokens in TOKENS:
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        routes = routings(tokens, shape, 8, seed=tokens)
        active = sum(torch.unique(ids).numel() for _, ids in routes) / len(routes)
        cycle = itertools.cycle(routes)

        def wq():
            g, ids = next(cycle)
            return fused_wq_experts(x, w1q, w2q, g, ids, quant=quant, w1_scale=scales.w1_scale, w2_scale=scales.w2_scale,
                                    w1_zero_point=scales.w1_zero_point, w2_zero_point=scales.w2_zero_point,
                                    w1_bias=scales.w1_bias, w2_bias=scales.w2_bias, activation=activation, swiglu_limit=limit)

        def bf16():
            g, ids = next(cycle)
            return fused_experts(x, w1b, w2b, g, ids, activation=activation, swiglu_limit=limit)

        wq_ms, bf16_ms = do_bench(wq), do_bench(bf16)
        io = 2 * tokens * k * 2
        flops = 2 * tokens * shape.top_k * 3 * n * k
        compute_ms = flops / (ceilings["bf16_matmul_TFLOPs"] * 1e9)
        roof_q = max((active * per_expert_q + io) / (ceilings["copy_GBps"] * 1e6), compute_ms)
        roof_b = max((active * per_expert_bf16 + io) / (ceilings["copy_GBps"] * 1e6), compute_ms)
        rows.append({
            "row": name, "tokens": tokens, "active_experts": active, "wq_ms": wq_ms, "bf16_ms": bf16_ms,
            "speedup_vs_bf16": bf16_ms / wq_ms, "wq_roofline_ms": roof_q, "bf16_roofline_ms": roof_b,
            "wq_of_roofline": roof_q / wq_ms, "bf16_of_roofline": roof_b / bf16_ms,
            "wq_weight_GBps": active * per_expert_q / wq_ms / 1e6,
        })
        print(f"{name:30s} T={tokens:5d} wq {wq_ms:.3f} ms  bf16 {bf16_ms:.3f} ms  x{bf16_ms / wq_ms:.2f}  "
              f"roofline {roof_q:.3f} ms ({100 * roof_q / wq_ms:.0f}%)", flush=True)
    return rows


def markdown(rows: list[dict], ceilings: dict, device: str) -> str:
    lines = [
        "# Weight-quantized Triton MoE (MXFP4, INT4) vs bf16 Triton experts and the roofline",
        "",
        f"{device}; torch {torch.__version__}. Ceilings measured in the same run: copy "
        f"{ceilings['copy_GBps']:.0f} GB/s, bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s. "
        "Median ms of eager calls (L2 flushed), 8 routings cycled. `bf16` is moe-fsm's bf16 Triton experts on the "
        "same shape; `roofline` is max(bytes/copy BW, FLOPs/matmul rate) for the quantized weights the batch touches.",
        "Produced by `bench/bench_wq.py`.",
        "",
        "| row | tokens | experts hit | wq ms | bf16 ms | bf16/wq | wq roofline ms | wq % of roofline | bf16 % of its roofline | wq weight GB/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['row']} | {r['tokens']} | {r['active_experts']:.1f} | {r['wq_ms']:.3f} | {r['bf16_ms']:.3f} | "
            f"{r['speedup_vs_bf16']:.2f} | {r['wq_roofline_ms']:.3f} | {100 * r['wq_of_roofline']:.0f}% | "
            f"{100 * r['bf16_of_roofline']:.0f}% | {r['wq_weight_GBps']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "perf"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings()
    device = torch.cuda.get_device_name()
    rows = []
    for name, (shape, scheme, activation, limit, bias) in ROWS.items():
        rows += bench_row(name, shape, scheme, activation, limit, bias, ceilings)
    (out / "wq.json").write_text(json.dumps({"device": device, "ceilings": ceilings, "rows": rows}, indent=1))
    (out / "wq.md").write_text(markdown(rows, ceilings, device))


if __name__ == "__main__":
    main()
