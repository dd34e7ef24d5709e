"""Prefill against the best Triton peer that runs on the GPU machine: OpenAI's ``triton_kernels`` ``matmul_ogs`` in bf16.

Issue 21 asks for 560 TFLOP/s bf16 on the Qwen3-30B-A3B and Mixtral-8x7B layers at 8192 tokens. This puts the
same layers, weights, routings and inputs through moe-fsm's Triton experts (the runtime's own config) and through
``matmul_ogs`` as vLLM 0.33 drives it (the w1 GEMM gathering token rows with the gated activation fused, the w2
GEMM scattering back with the router weights; routing computed outside the timed graph, as vLLM does), both with
the gpt-oss activation (``swigluoai``, limit 7) because that is the gated activation ``matmul_ogs`` fuses (same
FLOPs as SiLU-and-mul). Timed with ``tuning.time_graph`` (CUDA-graph replays over R routings, L2 flushed);
TFLOP/s = 6 x pairs x N x K / time; "diff" = the two outputs' relative Frobenius difference.

    python bench/bench_weight_quantized.py prepare --wheel vllm-0.33.0-...whl --extract .vllm_extract/tk   # no GPU
    python bench/bench_prefill_vs_triton_kernels.py --extract .vllm_extract/tk [--tokens 2048 8192] [--json PATH]  # GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

LIMIT = 7.0
ALPHA = 1.702


class MatmulOgsBf16:
    """``triton_kernels`` matmul_ogs on bf16 experts: weights [E, K, 2N] with gate/up interleaved, and [E, N, K]."""

    def __init__(self, w1, w2, top_k: int):
        import torch
        import triton_kernels.matmul_ogs as ogs
        from triton_kernels.matmul_ogs import FnSpecs, FusedActivation, PrecisionConfig, matmul_ogs
        from triton_kernels.routing import routing
        from triton_kernels.swiglu import swiglu_fn

        from moe_fsm.quantize.weights import interleave_gate_up

        self.torch, self.matmul_ogs, self.routing_fn, self.top_k = torch, matmul_ogs, routing, top_k
        self.w1 = interleave_gate_up(w1).transpose(-2, -1).contiguous()
        self.w2 = w2.transpose(-2, -1).contiguous()
        self.n, self.k = w2.shape[2], w2.shape[1]
        self.pc = PrecisionConfig()
        self.act = FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit")), (ALPHA, LIMIT), 2)
        # the tiles matmul_ogs picks per GEMM (its opt_flags), recorded for the report
        self.flags: list[dict] = []
        choose = ogs.make_opt_flags

        def recording(*args, **kwargs):
            flags = choose(*args, **kwargs)
            self.flags.append({f: getattr(flags, f) for f in ("block_m", "block_n", "block_k", "num_warps", "num_stages",
                                                              "group_m", "split_k", "is_persistent", "fused_scatter",
                                                              "epilogue_subtile")})
            return flags

        ogs.make_opt_flags = recording

    def route(self, logits):
        return self.routing_fn(logits, self.top_k)

    def __call__(self, x, rd, gi, si):
        m = x.shape[0]
        inter = self.torch.empty((1, m * self.top_k, self.n), device=x.device, dtype=x.dtype)
        out = self.torch.empty((1, m, self.k), device=x.device, dtype=x.dtype)
        self.matmul_ogs(x, self.w1, None, rd, gather_indx=gi, precision_config=self.pc, fused_activation=self.act, y=inter)
        self.matmul_ogs(inter.view(m * self.top_k, self.n), self.w2, None, rd, scatter_indx=si, precision_config=self.pc,
                        gammas=rd.gate_scal, y=out)
        return out.view(m, self.k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extract", type=Path, default=ROOT / ".vllm_extract" / "tk")
    ap.add_argument("--shapes", nargs="*", default=["qwen3-30b-a3b", "mixtral-8x7b"])
    ap.add_argument("--tokens", nargs="*", type=int, default=[2048, 8192])
    ap.add_argument("--rep-ms", type=float, default=60.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(args.extract))

    import torch

    from moe_fsm.kernels.triton_moe import fused_experts, get_config
    from moe_fsm.kernels.triton_moe._runtime import device_name
    from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES, make_weights, replays_per_graph, time_graph

    rows = []
    for name in args.shapes:
        shape = NAMED_SHAPES[name]
        e, n, k, top_k = shape.num_experts, shape.intermediate, shape.hidden, shape.top_k
        w1, w2, _, _ = make_weights(shape)
        try:
            peer = MatmulOgsBf16(w1, w2, top_k)
        except Exception:  # the peer is optional: say why it is missing
            traceback.print_exc()
            peer = None
        for tokens in args.tokens:
            gen = torch.Generator(device="cuda").manual_seed(tokens)
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            logits = [torch.randn(tokens, e, device="cuda", generator=gen) for _ in range(replays_per_graph(tokens))]
            routes = []
            for lg in logits:
                vals, ids = lg.topk(top_k, dim=1)
                routes.append((torch.softmax(vals, dim=1), ids.to(torch.int32)))

            def ours(g, ids):
                return fused_experts(x, w1, w2, g, ids, activation="swigluoai", swiglu_limit=LIMIT)

            flops = 6 * tokens * top_k * n * k
            config = get_config(device_name(x.device), e, n, k, top_k, tokens, "bfloat16", None)
            row = {"shape": name, "tokens": tokens, "ours_config": config.to_json()}
            row["ours_us"] = time_graph(ours, routes, args.rep_ms)
            row["ours_TFLOPs"] = flops / row["ours_us"] / 1e6
            if peer is not None:
                try:
                    routed = [peer.route(lg) for lg in logits]
                    peer.flags.clear()
                    peer(x, *routed[0])
                    row["peer_opt_flags"] = {"w1": peer.flags[0], "w2": peer.flags[1]}
                    row["peer_us"] = time_graph(lambda rd, gi, si: peer(x, rd, gi, si), routed, args.rep_ms)
                    row["peer_TFLOPs"] = flops / row["peer_us"] / 1e6
                    a, b = ours(*routes[0]).double(), peer(x, *routed[0]).double()
                    row["diff"] = float((a - b).norm() / b.norm())
                except Exception as exc:
                    torch.cuda.synchronize()
                    row["peer_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            nan = float("nan")
            print(f"{name:16s} T={tokens:5d} ours {row['ours_us']:9.1f} us {row['ours_TFLOPs']:6.1f} TF/s  "
                  f"matmul_ogs {row.get('peer_us', nan):9.1f} us {row.get('peer_TFLOPs', nan):6.1f} TF/s  "
                  f"ours/peer speed x{row.get('peer_us', nan) / row['ours_us']:.3f}  diff {row.get('diff', nan):.1e}"
                  + (f"  {row['peer_error']}" if "peer_error" in row else ""), flush=True)
            if "peer_opt_flags" in row:
                print(f"  matmul_ogs tiles: {row['peer_opt_flags']}", flush=True)
        del w1, w2, peer
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
