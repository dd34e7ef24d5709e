"""Weight-quantized Triton MoE (MXFP4, INT4) side by side with its peers, bf16 and the roofline, in one run.

Rows (experts only; random weights quantized on the GPU): gpt-oss-20b (E32, K=N=2880,
top-4) and gpt-oss-120b (E128) in MXFP4 with biases and SwiGLU-OAI clamped at 7;
Qwen3-30B-A3B GPTQ-Int4 g128 (E128, K2048, N768, top-8, symmetric). At each token
count, on the same inputs and routings:

* ``moe-fsm``: ``kernels.triton_wq.fused_wq_experts`` on the build-time re-laid
  weights (SPLIT nibbles, inline-PTX dequant), every candidate tile of
  ``CANDIDATES`` timed and the fastest kept (``--write-table`` writes those as the
  shipped config table); its output is checked against float64 on sampled tokens;
* the peer: OpenAI's ``triton_kernels`` ``matmul_ogs`` (MXFP4, Hopper swizzled
  weights and scales, fused SwiGLU, routing computed outside the graph, as vLLM 0.33
  runs it on SM90) or vLLM 0.33's ``fused_moe_kernel_gptq_awq`` (INT4, with its own
  default tile rules, its SiLU-and-mul as a one-pass Triton kernel, moe-fsm's
  alignment and top-k sum), both loaded at run time from vLLM 0.33.0's wheel
  (``prepare``) and never part of moe-fsm;
* ``bf16``: moe-fsm's bf16 Triton experts (``kernels.triton_moe.fused_experts``) on
  bf16 weights of the same shape (no biases);
* the roofline: max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both ceilings
  measured in this run; bytes are the quantized weights, scales and biases of the
  experts the batch hits, plus activations in and out.

Timing: CUDA-graph replays of R calls on R different routings (L2 flushed before
each replay, ``triton.testing.do_bench`` median), divided by R.

``prepare`` (no GPU): extracts the peers from the wheel into ``--extract``.
``run`` (GPU): writes ``<out>/wq.json`` and ``<out>/wq.md``.
``decode`` (GPU, one process, about 90 s on an H200): at 1/8/32 tokens on six decode shapes (INT4 g32 Kimi-K2-like
EP8 shard, INT4 g128 Mixtral-8x7B / Qwen3-235B-A22B / GLM-4.5-Air-like, MXFP4 gpt-oss-120b, NVFP4 weight-only),
the one-pass decode tile against the default tile now (split along K where the grid is small), with µs, weight
TB/s and % of the copy rate measured in the same run, and moe-fsm's bf16 experts beside them; writes
``<out>/wq_decode.json`` and ``<out>/wq_decode.md`` after every point.
``inflight`` (GPU, about 60 s on an H200 for six rows at three token counts): the decode tile moe-fsm serves beside
one-change variants of the weight bytes an SM keeps in flight (``inflight_variants``), each checked against float64,
with the read floor of the same bytes (``bench_read_floor.py``), bf16 and, for MXFP4, ``triton_kernels``; every tile
compiled first in ``--workers`` processes; writes ``<out>/wq_inflight.json`` and ``.md`` after every point. Its rows
include zero-point (AWQ) shapes left out of the zero-point decode tile's choice and the same shapes symmetric; at
decode counts the variants include the decode tile at 64 and 128 weight rows with their own K slices (``--no-floor``
skips the read floor where only tiles are compared).
``prefill`` (GPU, about 45 s on an H200): at 512/2048/8192 tokens on the three rows, the swap-AB kernel with the tile
moe-fsm takes there now against the bf16 Hopper path (``WqConfig.hopper_bf16``: dequantized scratch, then the bf16
TMA kernels), the dequantization pass alone (its tile picked from ``DEQUANT_TILES`` at the first count), moe-fsm's
bf16 experts and the peer; writes ``<out>/wq_prefill.json`` and ``.md`` after every point.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
import traceback
import types
import zipfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

VLLM_VERSION = "0.33.0"
FUSED_MOE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
TK_PREFIX = "vllm/third_party/triton_kernels/"
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
DECODE_ROWS = ("Kimi-K2-like EP8 INT4 g32", "Mixtral-8x7B INT4 g128", "Qwen3-235B-A22B INT4 g128",
               "GLM-4.5-Air-like INT4 g128", "gpt-oss-120b MXFP4", "Qwen3-235B-A22B NVFP4 W4A16",
               "Qwen3-235B-A22B INT4 g128 AWQ")
TARGETS = {"decode_TBps": 1.9, "faster_than_bf16_up_to": 512, "bf16_tflops_ratio_large": 0.8,
           "vs_peer_min": 1.0, "vs_peer_geomean": 1.2}


# ---------------------------------------------------------------- prepare (no GPU)


def prepare(wheel: Path, dest: Path) -> None:
    import ast

    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        count = 0
        for name in z.namelist():
            if name.startswith(TK_PREFIX) and name.endswith(".py"):
                target = dest / "triton_kernels" / name[len(TK_PREFIX):]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
                count += 1
        source = z.read(FUSED_MOE).decode()
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    keep = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in ("write_zeros_to_output", "fused_moe_kernel_gptq_awq"):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            keep[node.name] = "".join(lines[start:node.end_lineno])
    header = (f"# Extracted at run time from vllm {VLLM_VERSION} ({FUSED_MOE}) by bench/bench_weight_quantized.py prepare.\n"
              "# Not part of moe-fsm; never committed.\nimport triton\nimport triton.language as tl\n\n\n")
    (dest / "vllm_gptq_awq_kernel.py").write_text(header + "\n\n".join(keep[k] for k in ("write_zeros_to_output", "fused_moe_kernel_gptq_awq")))
    print(f"extracted triton_kernels ({count} files) and fused_moe_kernel_gptq_awq into {dest}")


# ---------------------------------------------------------------- GPU side


def _shapes():
    from bench_experts_roofline import Shape

    from moe_fsm.inputs.quant import QuantScheme

    return {
        "gpt-oss-20b MXFP4": (Shape("gpt-oss-20b", 32, 2880, 2880, 4), QuantScheme.mxfp4(), "swigluoai", 7.0, True),
        "gpt-oss-120b MXFP4": (Shape("gpt-oss-120b", 128, 2880, 2880, 4), QuantScheme.mxfp4(), "swigluoai", 7.0, True),
        "qwen3-30b-a3b GPTQ-Int4 g128": (Shape("qwen3-30b-a3b", 128, 2048, 768, 8), QuantScheme.int_wna16(4, 128), "silu", None, False),
    }


def candidates(tokens: int, top_k: int, experts: int):
    """Tiles tried at one point (block_m, block_n, block_k, warps, stages[, group_m])."""
    from moe_fsm.kernels.triton_wq.fused import WqConfig

    per_expert = tokens * top_k / experts
    if tokens == 1 or per_expert <= 4:
        tiles = [(16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 32, 128, 4, 4), (16, 64, 128, 4, 6),
                 (16, 64, 64, 4, 6), (16, 128, 128, 8, 4)]
    elif per_expert <= 24:
        tiles = [(16, 64, 128, 4, 4), (16, 64, 128, 4, 6), (32, 64, 128, 4, 4), (16, 128, 128, 4, 3),
                 (16, 64, 64, 4, 6)]
    elif per_expert <= 96:
        tiles = [(32, 64, 128, 4, 4), (64, 64, 128, 4, 3), (64, 128, 128, 8, 3), (16, 64, 128, 4, 4),
                 (64, 64, 128, 4, 4)]
    else:
        tiles = [(128, 64, 128, 4, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 64, 128, 4, 3),
                 (128, 64, 128, 4, 4)]
    configs = [WqConfig(*t, group_m=1 if per_expert <= 96 else 8) for t in tiles]
    if per_expert > 96:  # the bf16 Hopper path (its GEMM tiles are the bf16 experts')
        configs.append(WqConfig(128, 128, 64, 8, 3, group_m=8, hopper_bf16=True))
    return configs


class TritonKernelsPeer:
    """OpenAI's triton_kernels matmul_ogs (MXFP4 x bf16), prepared as vLLM 0.33 prepares it on SM90."""

    def __init__(self, w1q, w2q, scales, e, n, k, top_k):
        import torch
        import triton_kernels.matmul_ogs_details.opt_flags as opt_flags
        from triton_kernels.matmul_ogs import FlexCtx, FnSpecs, FusedActivation, PrecisionConfig, matmul_ogs
        from triton_kernels.numerics import InFlexData
        from triton_kernels.routing import routing
        from triton_kernels.swiglu import swiglu_fn
        from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
        from triton_kernels.tensor_details import layout

        from moe_fsm.quantize.weights import interleave_gate_up

        opt_flags.update_opt_flags_constraints({"split_k": 1})
        self.torch, self.matmul_ogs, self.routing_fn = torch, matmul_ogs, routing
        self.top_k, self.n, self.k = top_k, n, k

        def swizzle(q, s):
            pad = -s.shape[-1] % 4
            s = torch.nn.functional.pad(s, (0, pad))
            vl, vo = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
            sl, so = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
            qt = convert_layout(wrap_torch_tensor(q.transpose(-2, -1), dtype=FP4), vl, **vo)
            st = convert_layout(wrap_torch_tensor(s.transpose(-2, -1)), sl, **so)
            return qt, st

        self.w1, s1 = swizzle(interleave_gate_up(w1q), interleave_gate_up(scales.w1_scale))
        self.w2, s2 = swizzle(w2q, scales.w2_scale)
        self.b1 = interleave_gate_up(scales.w1_bias).float().contiguous()
        self.b2 = scales.w2_bias.float().contiguous()
        self.pc1 = PrecisionConfig(weight_scale=s1, flex_ctx=FlexCtx(rhs_data=InFlexData()))
        self.pc2 = PrecisionConfig(weight_scale=s2, flex_ctx=FlexCtx(rhs_data=InFlexData()))
        self.act = FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit")), (1.702, 7.0), 2)

    def route(self, logits):
        return self.routing_fn(logits, self.top_k)

    def __call__(self, x, rd, gi, si):
        torch = self.torch
        m = x.shape[0]
        inter = torch.empty((1, m * self.top_k, self.n), device=x.device, dtype=x.dtype)
        out = torch.empty((1, m, self.k), device=x.device, dtype=x.dtype)
        self.matmul_ogs(x, self.w1, self.b1, rd, gather_indx=gi, precision_config=self.pc1, fused_activation=self.act,
                        y=inter)
        self.matmul_ogs(inter.view(m * self.top_k, self.n), self.w2, self.b2, rd, scatter_indx=si,
                        precision_config=self.pc2, gammas=rd.gate_scal, y=out)
        return out.view(m, self.k)


class VllmGptqAwqPeer:
    """vLLM 0.33's fused_moe_kernel_gptq_awq run as its fused_experts_impl runs it (Triton path, default tiles)."""

    def __init__(self, extract: Path, w1q, w2q, scales, e, n, k, top_k, group):
        import torch
        import triton

        module = types.ModuleType("vllm_gptq_awq_kernel")
        path = extract / "vllm_gptq_awq_kernel.py"
        module.__file__ = str(path)
        sys.modules[module.__name__] = module
        exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
        from bench_experts_vs_vllm import silu_and_mul_kernel

        self.kernel, self.act, self.torch, self.triton = module.fused_moe_kernel_gptq_awq, silu_and_mul_kernel(), torch, triton
        self.w1, self.w2, self.s1, self.s2 = w1q, w2q, scales.w1_scale, scales.w2_scale
        self.e, self.n, self.k, self.top_k, self.group = e, n, k, top_k, group

    def config(self, m: int) -> dict:
        # get_default_config (int4_w4a16, Triton path) then get_moe_wna16_block_config
        bm = 16 if m <= 20 else (32 if m <= 40 else 64)
        bn, bk = (32, 64) if m == 1 else (64, 32)
        return {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": 1, "SPLIT_K": 1}

    def _gemm(self, a, b, s, c, g, routing, mul, top_k, cfg, em):
        sorted_ids, expert_ids, num_padded = routing
        grid = (self.triton.cdiv(em, cfg["BLOCK_SIZE_M"]) * self.triton.cdiv(b.size(1), cfg["BLOCK_SIZE_N"]),)
        import triton.language as tl

        self.kernel[grid](
            a, b, c, s, None, g, sorted_ids, expert_ids, num_padded,
            b.size(1), a.size(1), em, g.numel(),
            a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1), c.stride(1), c.stride(2),
            s.stride(0), s.stride(2), s.stride(1), 0, 0, 0,
            block_k_diviable=a.size(1) % cfg["BLOCK_SIZE_K"] == 0, group_size=self.group,
            MUL_ROUTED_WEIGHT=mul, top_k=top_k, compute_type=tl.bfloat16, has_zp=False,
            use_int4_w4a16=True, use_int8_w8a16=False, **cfg,
        )

    def __call__(self, x, g, ids):
        from moe_fsm.kernels.triton_moe.align import align_tokens
        from moe_fsm.kernels.triton_moe.fused import topk_sum

        torch = self.torch
        m = x.shape[0]
        cfg = self.config(m)
        r = align_tokens(ids, self.e, cfg["BLOCK_SIZE_M"])
        em = r.sorted_ids.size(0)
        if m < cfg["BLOCK_SIZE_M"]:
            em = min(em, m * self.top_k * cfg["BLOCK_SIZE_M"])
        routing = (r.sorted_ids, r.block_expert, r.num_padded)
        c1 = torch.empty((m, self.top_k, 2 * self.n), device=x.device, dtype=x.dtype)
        gf = g.reshape(-1)
        self._gemm(x, self.w1, self.s1, c1, gf, routing, False, self.top_k, cfg, em)
        h = torch.empty((m * self.top_k, self.n), device=x.device, dtype=x.dtype)
        self.act[(m * self.top_k, self.triton.cdiv(self.n, 1024))](c1.view(-1, 2 * self.n), h, self.n, 2 * self.n, self.n, BLOCK=1024)
        c2 = torch.empty((m, self.top_k, self.k), device=x.device, dtype=x.dtype)
        self._gemm(h, self.w2, self.s2, c2, gf, routing, True, 1, cfg, em)
        return topk_sum(c2.view(m * self.top_k, self.k), ids, self.e, torch.empty_like(x))


def _quantized(shape, scheme, bias, gen):
    """Random N(0, 1/K) / N(0, 1/N) experts quantized 16 at a time on the GPU."""
    import torch

    from moe_fsm.modular.interfaces import ExpertScales
    from moe_fsm.quantize.weights import quantize_weights

    e, k, n = shape.num_experts, shape.hidden, shape.intermediate
    parts = []
    for start in range(0, e, 16):
        c = min(16, e - start)
        w1 = torch.randn(c, 2 * n, k, device="cuda", generator=gen) * k**-0.5
        w2 = torch.randn(c, k, n, device="cuda", generator=gen) * n**-0.5
        parts.append(quantize_weights(w1, w2, scheme))
        del w1, w2
    w1q = torch.cat([p[0] for p in parts])
    w2q = torch.cat([p[1] for p in parts])
    fields = {}
    for f in vars(parts[0][2]):
        vals = [getattr(p[2], f) for p in parts]
        fields[f] = None if vals[0] is None else torch.cat(vals)
    scales = ExpertScales(**fields)
    if bias:
        scales = replace(scales, w1_bias=0.1 * torch.randn(e, 2 * n, device="cuda", generator=gen).to(torch.bfloat16),
                         w2_bias=0.1 * torch.randn(e, k, device="cuda", generator=gen).to(torch.bfloat16))
    return w1q, w2q, scales


def _reference(x, w1q, w2q, scales, scheme, g, ids, activation, limit, sample):
    """float64 output of the sampled tokens on the dequantized weights of the experts they hit."""
    import torch

    from moe_fsm.kernels.reference import moe_reference
    from moe_fsm.modular.interfaces import ExpertScales
    from moe_fsm.quantize.weights import dequantize_weights

    ids_s = ids[sample].long()
    used = torch.unique(ids_s)
    remap = torch.full((w1q.shape[0],), -1, dtype=torch.long, device=ids.device)
    remap[used] = torch.arange(used.numel(), device=ids.device)
    sub = {f: (v[used] if v is not None else None) for f, v in vars(scales).items()}
    w1f, w2f = dequantize_weights(w1q[used], w2q[used], ExpertScales(**sub), scheme, torch.float64)
    return moe_reference(x[sample], w1f, w2f, g[sample], remap[ids_s], activation=activation, swiglu_limit=limit,
                         w1_bias=sub["w1_bias"], w2_bias=sub["w2_bias"])


def chained_candidates(tokens: int, top_k: int, experts: int):
    """Swap-AB tiles of 33 or more pairs an expert with each K tile's dots chained onto the running sums
    (``chain_acc``), which ``prefill --candidates`` times beside what moe-fsm serves."""
    from moe_fsm.kernels.triton_wq.fused import WqConfig

    if tokens * top_k / experts <= 96:
        return [WqConfig(64, 128, 64, 8, 3, chain_acc=True)]
    return [WqConfig(128, 128, 64, 8, 3, group_m=8, chain_acc=True),
            WqConfig(128, 128, 128, 8, 3, group_m=8, chain_acc=True)]


def bench_row(name, shape, scheme, activation, limit, bias, ceilings, args, table, sink=None) -> list[dict]:
    import torch
    if args.compile_only:  # warm Triton's on-disk cache: one call per candidate, nothing timed
        def time_graph(fn, inputs, rep_ms):
            for a in inputs[:1]:
                fn(*a)
            torch.cuda.synchronize()
            return 1.0
    else:
        from bench_experts_roofline import time_graph

    from moe_fsm.kernels.triton_moe import fused_experts
    from moe_fsm.kernels.triton_wq import WeightQuant, fused_wq_experts
    from moe_fsm.kernels.triton_wq.fused import default_wq_config, relayout_nibbles, table_key

    e, k, n, top_k = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1q, w2q, scales = _quantized(shape, scheme, bias, gen)
    quant = WeightQuant.for_scheme(scheme)
    w1s, w2s = relayout_nibbles(w1q), relayout_nibbles(w2q)
    per_expert_q = sum(t.numel() * t.element_size() for t in (w1q, w2q, scales.w1_scale, scales.w2_scale,
                                                              scales.w1_bias, scales.w2_bias) if t is not None) / e
    w1b = torch.randn(e, 2 * n, k, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(k**-0.5)
    w2b = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(n**-0.5)
    peer, peer_name = None, None
    try:
        if quant.kind == "mxfp4":
            peer, peer_name = TritonKernelsPeer(w1q, w2q, scales, e, n, k, top_k), "triton_kernels matmul_ogs"
        else:
            peer, peer_name = VllmGptqAwqPeer(Path(args.extract), w1q, w2q, scales, e, n, k, top_k, quant.group), "vLLM fused_moe_kernel_gptq_awq"
    except Exception as exc:  # the peer is optional: report why it is missing
        print(f"{name}: peer unavailable: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
    rows = []
    for tokens in args.tokens:
        count = 8 if tokens <= 32 else (4 if tokens <= 512 else 2)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = [torch.randn(tokens, e, device="cuda", generator=gen) for _ in range(count)]
        routes = []
        for lg in logits:
            vals, ids = lg.topk(top_k, dim=1)
            routes.append((torch.softmax(vals, dim=1), ids.to(torch.int32)))
        active = sum(torch.unique(ids).numel() for _, ids in routes) / count

        def ours(cfg, scaled=False):
            def fn(g, ids):
                return fused_wq_experts(x, w1q if scaled else w1s, w2q if scaled else w2s, g, ids, quant=quant,
                                        w1_scale=scales.w1_scale,
                                        w2_scale=scales.w2_scale, w1_zero_point=scales.w1_zero_point,
                                        w2_zero_point=scales.w2_zero_point, w1_bias=scales.w1_bias,
                                        w2_bias=scales.w2_bias, activation=activation, swiglu_limit=limit,
                                        split=not scaled, scaled_dot=scaled, config=cfg)
            return fn

        tried = {}
        # the default tile's split along K where it splits (few tokens), beside the one-pass candidates
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        split_default = default_wq_config(tokens, top_k, e, n, k, sms, quant.kind, quant=quant)
        split_k_tiles = [split_default] if max(split_default.splits("w1"), split_default.splits("w2")) > 1 else []
        # MXFP4: both dequant paths, SPLIT nibbles + inline PTX and checkpoint order + tl.dot_scaled
        if args.served:  # only what moe-fsm runs at this point: the table's tile, else the default
            from moe_fsm.kernels.triton_moe._runtime import device_name
            from moe_fsm.kernels.triton_wq.fused import get_wq_config

            served = [get_wq_config(device_name(x.device), quant, e, n, k, top_k, tokens,
                                    sm_count=torch.cuda.get_device_properties(0).multi_processor_count)]
        both_paths = quant.kind == "mxfp4" and not args.served and not args.ptx_only
        for scaled in ((False, True) if both_paths else (False,)):
            for cfg in served if args.served else candidates(tokens, top_k, e) + split_k_tiles:
                try:
                    tried[(cfg, scaled)] = time_graph(ours(cfg, scaled), routes, args.rep_ms)
                except Exception as exc:
                    print(f"  {name} T={tokens} {cfg.to_json()} scaled_dot={scaled}: {type(exc).__name__}: "
                          f"{str(exc)[:300]}", flush=True)
        if not tried:
            continue
        # a table tile is only worth shipping if it beats the tile an untuned shape gets: time that one beside it
        default_us = None
        if args.served and served[0] != split_default:
            default_us = time_graph(ours(split_default), routes, args.rep_ms)
        for scaled in (False, True):  # the tuned table: the best tile of each path
            mine = {c: t for (c, sd), t in tried.items() if sd == scaled}
            if mine:
                table.setdefault(table_key(quant, e, n, k, top_k, scaled), {})[str(tokens)] = min(mine, key=mine.get).to_json()
        best_key = min(tried, key=tried.get)
        best, best_scaled = best_key
        us = tried[best_key]
        # numerics of the chosen tile: sampled tokens against float64, output poisoned first
        sample = torch.randperm(tokens, device="cuda", generator=gen)[:16]
        g0, ids0 = routes[0]
        out = ours(best, best_scaled)(g0, ids0)
        ref = _reference(x, w1q, w2q, scales, scheme, g0, ids0, activation, limit, sample)
        got = out[sample].double()
        err = float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")
        bf16_us = time_graph(lambda g, ids: fused_experts(x, w1b, w2b, g, ids, activation=activation,
                                                          swiglu_limit=limit), routes, args.rep_ms)
        peer_us, peer_err = None, None
        if peer is not None:
            try:
                if quant.kind == "mxfp4":
                    routed = [peer.route(lg) for lg in logits]
                    peer_us = time_graph(lambda rd, gi, si: peer(x, rd, gi, si), routed, args.rep_ms)
                    pout = peer(x, *routed[0])
                else:
                    peer_us = time_graph(lambda g, ids: peer(x, g, ids), routes, args.rep_ms)
                    pout = peer(x, g0, ids0)
                pgot = pout[sample].double()
                peer_err = float((pgot - ref).norm() / ref.norm())
            except Exception as exc:
                print(f"  {name} T={tokens} peer failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        io = 2 * tokens * k * 2
        flops = 2 * tokens * top_k * 3 * n * k
        compute_ms = flops / (ceilings["bf16_matmul_TFLOPs"] * 1e9)
        roof_us = 1e3 * max((active * per_expert_q + io) / (ceilings["copy_GBps"] * 1e6), compute_ms)
        row = {
            "row": name, "tokens": tokens, "active_experts": active, "moe_fsm_us": us, "config": best.to_json(),
            "dequant": "tl.dot_scaled" if best_scaled else "inline PTX, SPLIT nibbles",
            "candidates_us": {json.dumps({**c.to_json(), "scaled_dot": int(sd)}): t for (c, sd), t in tried.items()},
            "best_by_path_us": {p: min((t for (c, sd), t in tried.items() if sd == (p == "tl.dot_scaled")), default=None)
                                for p in ("inline PTX", "tl.dot_scaled")},
            "rel_err": err,
            "peer": peer_name, "peer_us": peer_us, "peer_rel_err": peer_err, "bf16_us": bf16_us,
            "roofline_us": roof_us, "of_roofline": roof_us / us, "weight_TBps": active * per_expert_q / us / 1e6,
            "tflops": flops / us / 1e6, "bf16_tflops": flops / bf16_us / 1e6,
            "vs_bf16": bf16_us / us, "vs_peer": (peer_us / us) if peer_us else None,
            "default_tile_us": default_us, "default_config": split_default.to_json() if default_us else None,
        }
        rows.append(row)
        if sink is not None:
            sink(row)
        print(f"{name:30s} T={tokens:5d} moe-fsm {us:8.1f} us ({row['weight_TBps']:.2f} TB/s, "
              f"{100 * row['of_roofline']:.0f}% roof, err {err:.1e})  peer {peer_us or float('nan'):8.1f}  "
              f"bf16 {bf16_us:8.1f}  roof {roof_us:7.1f}  cfg {best.to_json()} {row['dequant']} "
              f"by path {row['best_by_path_us']}"
              + (f"  default tile {split_default.to_json()} {default_us:.1f} us" if default_us else ""), flush=True)
    del w1q, w2q, w1s, w2s, w1b, w2b, scales, peer
    torch.cuda.empty_cache()
    return rows


def summarize(rows: list[dict]) -> dict:
    out = {}
    for name in dict.fromkeys(r["row"] for r in rows):
        rs = [r for r in rows if r["row"] == name]
        ratios = [r["vs_peer"] for r in rs if r["vs_peer"]]
        out[name] = {
            "decode_TBps_min_1_8": min((r["weight_TBps"] for r in rs if r["tokens"] <= 8), default=None),
            "vs_peer_min": min(ratios, default=None),
            "vs_peer_geomean": math.exp(statistics.fmean(math.log(x) for x in ratios)) if ratios else None,
            "vs_bf16_min_up_to_512": min((r["vs_bf16"] for r in rs if r["tokens"] <= 512), default=None),
            "bf16_tflops_ratio_2048_8192": min((r["tflops"] / r["bf16_tflops"] for r in rs if r["tokens"] >= 2048), default=None),
            "max_rel_err": max(r["rel_err"] for r in rs),
        }
    return out


def markdown(report: dict) -> str:
    c = report["ceilings"]
    lines = [
        "# Weight-quantized Triton MoE (MXFP4, INT4) vs its peers, bf16 and the roofline",
        "",
        f"{report['device']}; torch {report['torch']}, Triton {report['triton']}. Ceilings measured in the same run: "
        f"copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s. µs per layer call: "
        "CUDA-graph replays over R routings (L2 flushed), median. Peers loaded from vLLM 0.33.0's wheel at run time: "
        "MXFP4 rows `triton_kernels` matmul_ogs (as vLLM runs it on SM90), INT4 row vLLM's `fused_moe_kernel_gptq_awq`. "
        "`bf16` is moe-fsm's bf16 Triton experts on the same shape. `TB/s` is the weight bytes of the experts hit "
        "over moe-fsm's time; `err` moe-fsm's relative error against float64 (16 sampled tokens). "
        "Produced by `bench/bench_weight_quantized.py run`.",
        "",
        "| row | tokens | experts hit | moe-fsm µs | peer µs | bf16 µs | roofline µs | peer/moe-fsm | bf16/moe-fsm | "
        "% of roofline | weight TB/s | TFLOP/s (bf16's) | err | tile (m,n,k,warps,stages) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in report["rows"]:
        cfg = r["config"]
        tile = f"{cfg['block_m']},{cfg['block_n']},{cfg['block_k']},{cfg['num_warps']},{cfg['num_stages']}"
        if r.get("dequant") == "tl.dot_scaled":
            tile += " dot_scaled"
        if cfg.get("hopper_bf16"):
            tile = "bf16 Hopper path"
        if cfg.get("split_k", 1) > 1 or cfg.get("w2_split_k", 1) > 1:
            tile += f" split-K {cfg.get('split_k', 1)}/{cfg.get('w2_split_k') or cfg.get('split_k', 1)}"
        peer = f"{r['peer_us']:.1f}" if r["peer_us"] else "-"
        vs = f"{r['vs_peer']:.2f}" if r["vs_peer"] else "-"
        lines.append(
            f"| {r['row']} | {r['tokens']} | {r['active_experts']:.1f} | {r['moe_fsm_us']:.1f} | {peer} | "
            f"{r['bf16_us']:.1f} | {r['roofline_us']:.1f} | {vs} | {r['vs_bf16']:.2f} | {100 * r['of_roofline']:.0f}% | "
            f"{r['weight_TBps']:.2f} | {r['tflops']:.0f} ({r['bf16_tflops']:.0f}) | {r['rel_err']:.1e} | {tile} |"
        )
    lines += ["", "Summary against the targets (decode >= 1.9 TB/s at 1-8 tokens; faster than bf16 up to 512 tokens; "
              ">= 0.8x bf16's TFLOP/s at 2048-8192; >= 1.0x the peer everywhere, geomean >= 1.2x):", "",
              "| row | min TB/s at 1-8 | min bf16/moe-fsm up to 512 | min TFLOP/s ratio at 2048-8192 | min peer ratio | geomean peer ratio | max err |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for name, s in report["summary"].items():
        lines.append(f"| {name} | {f(s['decode_TBps_min_1_8'], '.2f')} | {f(s['vs_bf16_min_up_to_512'], '.2f')} | "
                     f"{f(s['bf16_tflops_ratio_2048_8192'], '.2f')} | {f(s['vs_peer_min'], '.2f')} | "
                     f"{f(s['vs_peer_geomean'], '.2f')} | {f(s['max_rel_err'], '.1e')} |")
    return "\n".join(lines) + "\n"


def run(args) -> None:
    import torch
    import triton
    from bench_experts_roofline import measure_ceilings

    sys.path.insert(0, str(Path(args.extract)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    ceilings = {"copy_GBps": 1.0, "bf16_matmul_TFLOPs": 1.0} if args.compile_only else measure_ceilings()
    shapes = _shapes()
    rows, table = [], {}

    def report() -> dict:
        return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                "ceilings": ceilings, "targets": TARGETS, "rows": rows, "summary": summarize(rows)}

    def sink(row: dict) -> None:  # written after every point: a run cut short keeps what it measured
        rows.append(row)
        if not args.compile_only:
            (out / "wq.json").write_text(json.dumps(report(), indent=1))
            (out / "wq.md").write_text(markdown(report()))
            if args.write_table:
                Path(args.write_table).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")

    for name in args.rows or shapes:
        bench_row(name, *shapes[name], ceilings, args, table, sink)
        print(f"[{time.time() - t0:.0f} s]", flush=True)
    if args.compile_only:
        print(f"compile-only pass done in {time.time() - t0:.0f} s")
        return
    report = report()
    print(markdown(report))


# ---------------------------------------------------------------- decode: one-pass tile vs split-K, 1-32 tokens


def _decode_shapes():
    """(shape, scheme, activation, swiglu limit, biases) of the decode comparison; the GLM row is a shape the tile
    rule was never looked at with."""
    from bench_experts_roofline import Shape

    from moe_fsm.inputs.quant import NVFP4_STATIC, QuantFamily, QuantScheme

    int4 = QuantScheme.int_wna16
    qwen3_235b = Shape("qwen3-235b-a22b", 128, 4096, 1536, 8)
    return dict(zip(DECODE_ROWS, (
        (Shape("kimi-k2-ep8", 48, 7168, 2048, 8), int4(4, 32), "silu", None, False),
        (Shape("mixtral-8x7b", 8, 4096, 14336, 2), int4(4, 128), "silu", None, False),
        (qwen3_235b, int4(4, 128), "silu", None, False),
        (Shape("glm-4.5-air", 128, 4096, 1408, 8), int4(4, 128), "silu", None, False),
        (Shape("gpt-oss-120b", 128, 2880, 2880, 4), QuantScheme.mxfp4(), "swigluoai", 7.0, True),
        (qwen3_235b, QuantScheme(QuantFamily.NVFP4, NVFP4_STATIC, None), "silu", None, False),
        (qwen3_235b, int4(4, 128, True, "awq"), "silu", None, False),  # zero points
    )))


def decode(args) -> None:
    """Per shape and token count: the one-pass decode tile (the default before split-K) against the default tile now
    (split along K where the grid is small), moe-fsm's bf16 experts beside them, the copy rate measured first. With
    ``--plain`` also the default tile with the plain Triton fp32 dequantization (``fast=False``; what INT4 with zero
    points ran before their inline-PTX decode), and its time over the default's."""
    import torch
    import triton
    from bench_experts_roofline import time_graph
    from triton.testing import do_bench

    from moe_fsm.kernels.triton_moe import fused_experts
    from moe_fsm.kernels.triton_wq import WeightQuant, fused_wq_experts
    from moe_fsm.kernels.triton_wq.fused import default_wq_config, relayout_nibbles

    t0 = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_bytes = 1 << 30
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), rep=100)
    del src, dst
    copy_tbps = 2 * n_bytes / copy_ms / 1e9  # bytes read + written, as the roofline's copy ceiling
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    device = torch.cuda.get_device_name()
    print(f"{device}, {sms} SMs; torch {torch.__version__}, Triton {triton.__version__}; copy rate {copy_tbps:.2f} TB/s "
          f"(1 GiB device copy, read + written)", flush=True)
    header = ("| row | tokens | experts hit | one-pass µs | TB/s | % copy | split-K tile µs | TB/s | % copy | "
              "splits w1/w2 | speed-up | bf16 µs | bf16 TB/s | bf16/split-K | err (split-K) |"
              + (" plain dequant µs | plain/split-K |" if args.plain else ""))
    lines = [header, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
             + (" ---: | ---: |" if args.plain else "")]
    print(header, flush=True)
    rows = []
    shapes = _decode_shapes()

    def one_row(name: str) -> None:
        """Quantize the row's experts, time its token counts; the weights are freed on return."""
        shape, scheme, activation, limit, bias = shapes[name]
        e, k, n, top_k = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k
        gen = torch.Generator(device="cuda").manual_seed(0)
        w1q, w2q, scales = _quantized(shape, scheme, bias, gen)
        quant = WeightQuant.for_scheme(scheme)
        w1s, w2s = relayout_nibbles(w1q), relayout_nibbles(w2q)
        per_expert_q = sum(t.numel() * t.element_size() for t in vars(scales).values() if t is not None) / e
        per_expert_q += (w1q.numel() + w2q.numel()) / e
        w1b = torch.randn(e, 2 * n, k, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(k**-0.5)
        w2b = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(n**-0.5)
        per_expert_b = 3 * n * k * 2
        for tokens in args.tokens:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            routes = []
            for _ in range(8):  # a graph of 8 calls on 8 routings: the weights come from memory, not L2
                vals, ids = torch.randn(tokens, e, device="cuda", generator=gen).topk(top_k, dim=1)
                routes.append((torch.softmax(vals, dim=1), ids.to(torch.int32)))
            active = sum(torch.unique(ids).numel() for _, ids in routes) / len(routes)

            def ours(cfg, fast=True):
                def fn(g, ids):
                    return fused_wq_experts(
                        x, w1s, w2s, g, ids, quant=quant, w1_scale=scales.w1_scale, w2_scale=scales.w2_scale,
                        w1_zero_point=scales.w1_zero_point, w2_zero_point=scales.w2_zero_point,
                        w1_global_scale=scales.w1_global_scale, w2_global_scale=scales.w2_global_scale,
                        w1_bias=scales.w1_bias, w2_bias=scales.w2_bias, activation=activation, swiglu_limit=limit,
                        split=True, fast=fast, config=cfg)
                return fn

            one_pass = default_wq_config(tokens, top_k, e, kind=quant.kind, quant=quant)
            split_k = default_wq_config(tokens, top_k, e, n, k, sms, quant.kind, quant=quant)
            one_us = time_graph(ours(one_pass), routes, args.rep_ms)
            unsplit = (split_k.splits("w1"), split_k.splits("w2")) == (1, 1)  # the same kernels: timed once
            split_us = one_us if unsplit else time_graph(ours(split_k), routes, args.rep_ms)
            bf16_us = time_graph(lambda g, ids: fused_experts(x, w1b, w2b, g, ids, activation=activation,
                                                              swiglu_limit=limit), routes, args.rep_ms)
            plain_us = time_graph(ours(split_k, fast=False), routes, args.rep_ms) if args.plain else None
            sweep = decode_sweep(ours, one_pass, routes, args.rep_ms, time_graph) if args.sweep else None
            sample = torch.arange(min(tokens, 2), device="cuda")  # float64 on the experts of two tokens
            g0, ids0 = routes[0]
            got = ours(split_k)(g0, ids0)[sample].double()
            ref = _reference(x, w1q, w2q, scales, scheme, g0, ids0, activation, limit, sample)
            err = float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")
            tb = lambda us, per_expert: active * per_expert / us / 1e6  # noqa: E731
            row = {"row": name, "tokens": tokens, "active_experts": active, "one_pass_us": one_us,
                   "split_k_us": split_us, "one_pass_TBps": tb(one_us, per_expert_q),
                   "split_k_TBps": tb(split_us, per_expert_q), "bf16_us": bf16_us, "bf16_TBps": tb(bf16_us, per_expert_b),
                   "copy_TBps": copy_tbps, "splits": [split_k.splits("w1"), split_k.splits("w2")],
                   "split_k_config": split_k.to_json(), "rel_err": err, "plain_dequant_us": plain_us,
                   "sweep": sweep}
            rows.append(row)
            line = (f"| {name} | {tokens} | {active:.1f} | {one_us:.1f} | {row['one_pass_TBps']:.2f} | "
                    f"{100 * row['one_pass_TBps'] / copy_tbps:.0f}% | {split_us:.1f} | {row['split_k_TBps']:.2f} | "
                    f"{100 * row['split_k_TBps'] / copy_tbps:.0f}% | {row['splits'][0]}/{row['splits'][1]} | "
                    f"{one_us / split_us:.2f} | {bf16_us:.1f} | {row['bf16_TBps']:.2f} | {bf16_us / split_us:.2f} | {err:.1e} |"
                    + (f" {plain_us:.1f} | {plain_us / split_us:.2f} |" if args.plain else ""))
            lines.append(line)
            print(line, flush=True)
            if sweep:
                print(f"  sweep {name} T={tokens}: " + ", ".join(
                    f"{label} {v['us']:.1f}" + (f" ({', '.join(f'{k} {t:.1f}' for k, t in v['kernels_us'].items())})"
                                                if v.get("kernels_us") else "")
                    for label, v in sweep.items()), flush=True)
            report = {"device": device, "sms": sms, "torch": torch.__version__, "triton": triton.__version__,
                      "copy_TBps": copy_tbps, "rows": rows}
            (out_dir / "wq_decode.json").write_text(json.dumps(report, indent=1))
            (out_dir / "wq_decode.md").write_text("\n".join(lines) + "\n")

    for name in args.rows or shapes:
        try:
            one_row(name)
        except Exception as exc:  # report and go on: the other rows still measure
            print(f"{name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            traceback.print_exc()
        torch.cuda.empty_cache()
        print(f"[{time.time() - t0:.0f} s]", flush=True)


# Decode tiles beside the default one (16 x 64 x 128, 4 warps, 4 stages) that ``decode --sweep`` times: a wider K
# step (128 weight bytes a row a step), 32 weight rows (twice the programs), three stages.
SWEEP_TILES = ((16, 64, 256, 4, 3), (16, 32, 128, 4, 4), (16, 64, 128, 4, 3))
SWEEP_SPLITS = (2, 3, 4, 6)


def kernel_times(fn, inputs, calls: int = 5) -> dict:
    """Mean device µs per layer call of each kernel ``fn`` launches (eager, torch.profiler), by kernel name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for a in inputs[:1]:
        fn(*a)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            for a in inputs:
                fn(*a)
        torch.cuda.synchronize()
    totals: dict = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time
    return {name: us / (calls * len(inputs)) for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def decode_sweep(ours, one_pass, routes, rep_ms: float, time_graph) -> dict:
    """The one-pass decode tile with each GEMM split along K alone (w1 by 2-6 slices with w2 in one pass, and the
    reverse) and the tiles of ``SWEEP_TILES`` in one pass: whole-layer µs, and for the one-pass tile and the
    splits the mean device µs of each kernel (what the K slices buy on one GEMM against the extra pass)."""
    found = {}
    variants = [("one pass", one_pass)]
    variants += [(f"w1/{s}", replace(one_pass, split_k=s, w2_split_k=1)) for s in SWEEP_SPLITS]
    variants += [(f"w2/{s}", replace(one_pass, split_k=1, w2_split_k=s)) for s in SWEEP_SPLITS]
    variants += [("tile " + ",".join(map(str, t)), replace(one_pass, block_m=t[0], block_n=t[1], block_k=t[2],
                                                           num_warps=t[3], num_stages=t[4])) for t in SWEEP_TILES]
    for label, cfg in variants:
        try:
            found[label] = {"us": time_graph(ours(cfg), routes, rep_ms), "config": cfg.to_json()}
            if not label.startswith("tile"):
                found[label]["kernels_us"] = {k.split("_kernel")[0][:24]: v
                                              for k, v in kernel_times(ours(cfg), routes).items()}
        except Exception as exc:  # a tile that does not compile here is reported, the others still measure
            print(f"  sweep {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    return found


# ---------------------------------------------------------------- inflight: what bounds the decode loop


# The held-out decode rows of ``inflight`` beside ``DECODE_ROWS``: a tensor-parallel shard (N = 1440, not a multiple of
# 64) that no decode rule was looked at with; zero-point (AWQ) shapes left out of the choice of the zero-point decode
# tile (made on "Qwen3-235B-A22B INT4 g128 AWQ" alone), and the same shapes symmetric, to see whether plain INT4 wants
# the same tile.
AWQ_HELD_OUT_ROWS = ("Qwen3-30B-A3B INT4 g128 AWQ", "Mixtral-8x7B INT4 g128 AWQ", "Kimi-K2-like EP8 INT4 g32 AWQ",
                     "Qwen3-235B-A22B TP4 INT4 g128 AWQ")
INFLIGHT_ROWS = DECODE_ROWS + ("gpt-oss-120b TP2 MXFP4",) + AWQ_HELD_OUT_ROWS + (
    "Qwen3-30B-A3B INT4 g128", "Qwen3-235B-A22B TP4 INT4 g128")


def _inflight_shapes():
    from bench_experts_roofline import Shape

    from moe_fsm.inputs.quant import QuantScheme

    int4 = QuantScheme.int_wna16
    qwen3_30b, mixtral = Shape("qwen3-30b-a3b", 128, 2048, 768, 8), Shape("mixtral-8x7b", 8, 4096, 14336, 2)
    kimi, qwen3_235b_tp4 = Shape("kimi-k2-ep8", 48, 7168, 2048, 8), Shape("qwen3-235b-a22b-tp4", 128, 4096, 384, 8)
    return {**_decode_shapes(),
            "gpt-oss-120b TP2 MXFP4": (Shape("gpt-oss-120b-tp2", 128, 2880, 1440, 4), QuantScheme.mxfp4(),
                                       "swigluoai", 7.0, True),
            "Qwen3-30B-A3B INT4 g128 AWQ": (qwen3_30b, int4(4, 128, True, "awq"), "silu", None, False),
            "Mixtral-8x7B INT4 g128 AWQ": (mixtral, int4(4, 128, True, "awq"), "silu", None, False),
            "Kimi-K2-like EP8 INT4 g32 AWQ": (kimi, int4(4, 32, True, "awq"), "silu", None, False),
            "Qwen3-235B-A22B TP4 INT4 g128 AWQ": (qwen3_235b_tp4, int4(4, 128, True, "awq"), "silu", None, False),
            "Qwen3-30B-A3B INT4 g128": (qwen3_30b, int4(4, 128), "silu", None, False),
            "Qwen3-235B-A22B TP4 INT4 g128": (qwen3_235b_tp4, int4(4, 128), "silu", None, False)}


def inflight_variants(default, labels=None, decode_tile=None):
    """(label, config) of the decode tile ``default`` (the tile moe-fsm serves) with ONE thing changed that sets how
    many weight bytes an SM keeps in flight or how much shared memory it holds (the rest of its 256 KB is L1, which
    the pipeliner's 8-byte ``cp.async.ca`` copies of the weight bytes pass through): a deeper or shallower cp.async
    ring of raw 4-bit tiles (stages; the pipeliner loads each weight tile into shared memory ``num_stages - 1`` K
    steps ahead of its dequantization), wider tiles (twice the bytes a stage, half the programs), more or fewer
    split-K slices. ``decode_tile`` (block_n -> the decode tile of that width with the split rule's slices for it;
    given at decode counts): also "rows 64" and "rows 128", the choice the zero-point decode rule makes, and
    "w1 block_n 128" (w2 kept). ``labels``: only these beside the default (None: all); a variant equal to one
    listed before it (the default first) is left out. Two more knobs were timed the same way and taken out, slower everywhere
    (docs/perf/weight_quantized.md): a register cap for more programs an SM, and the next K tile loaded into
    registers instead of the ring."""
    s1, s2 = default.splits("w1"), default.splits("w2")
    found = [("default", default)]
    if decode_tile is not None:
        found += [("rows 64", decode_tile(64)), ("rows 128", decode_tile(128)),
                  ("w1 block_n 128", replace(default, block_n=128, w2_block_n=default.gemm("w2")[0]))]
    found += [("stages 2", replace(default, num_stages=2)),
             ("stages 4", replace(default, num_stages=4)), ("stages 5", replace(default, num_stages=5)),
             ("block_n 128", replace(default, block_n=128)),
             ("block_n 128, 8 warps", replace(default, block_n=128, num_warps=8)),
             ("w2 block_n 128", replace(default, w2_block_n=128)),
             ("block_k 256", replace(default, block_k=256)),
             ("slices x2", replace(default, split_k=2 * s1, w2_split_k=2 * s2))]
    if max(s1, s2) > 1:
        found.append(("stages 5, slices / 2", replace(default, num_stages=5, split_k=max(1, s1 // 2),
                                                       w2_split_k=max(1, s2 // 2))))
    kept = []
    for label, cfg in found:
        if (label == "default" or labels is None or label in labels) and cfg not in [c for _, c in kept]:
            kept.append((label, cfg))
    return kept


def _inflight_layer(name: str, num_experts: int | None, seed: int):
    """(shape, scheme, activation, limit, quant, weights as the kernel takes them, quantized weights, scales) of an
    ``inflight`` row, with ``num_experts`` experts (None: the row's own)."""
    import torch

    from moe_fsm.kernels.triton_wq import WeightQuant
    from moe_fsm.kernels.triton_wq.fused import relayout_nibbles

    shape, scheme, activation, limit, bias = _inflight_shapes()[name]
    if num_experts is not None:
        shape = replace(shape, num_experts=num_experts)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w1q, w2q, scales = _quantized(shape, scheme, bias, gen)
    return shape, scheme, activation, limit, WeightQuant.for_scheme(scheme), (relayout_nibbles(w1q),
                                                                               relayout_nibbles(w2q)), w1q, w2q, scales


def _inflight_call(layer, x):
    """fn(g, ids) running the layer ``_inflight_layer`` built on ``x`` with a given tile: fn(config)(g, ids)."""
    from moe_fsm.kernels.triton_wq import fused_wq_experts

    shape, scheme, activation, limit, quant, (w1s, w2s), w1q, w2q, scales = layer

    def with_config(cfg):
        def fn(g, ids):
            return fused_wq_experts(
                x, w1s, w2s, g, ids, quant=quant, w1_scale=scales.w1_scale, w2_scale=scales.w2_scale,
                w1_zero_point=scales.w1_zero_point, w2_zero_point=scales.w2_zero_point,
                w1_global_scale=scales.w1_global_scale, w2_global_scale=scales.w2_global_scale,
                w1_bias=scales.w1_bias, w2_bias=scales.w2_bias, activation=activation, swiglu_limit=limit,
                split=True, config=cfg)
        return fn
    return with_config


def _inflight_compile(jobs: list) -> list[str]:
    """Worker: each (row, tokens, config JSONs) run once on a copy of the row with top_k experts (the kernels
    specialize on the tile, the token count's path and the strides' alignment, not on the expert count), so Triton's
    on-disk cache holds them before the timing process asks."""
    import torch

    from moe_fsm.kernels.triton_wq.fused import WqConfig

    failures = []
    for name, tokens, configs in jobs:
        top_k = _inflight_shapes()[name][0].top_k
        layer = _inflight_layer(name, top_k, seed=1)
        x = torch.randn(tokens, layer[0].hidden, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(top_k, device="cuda") for _ in range(tokens)]).to(torch.int32)
        g = torch.full(ids.shape, 1.0 / top_k, device="cuda")
        for cfg in configs:
            try:
                _inflight_call(layer, x)(WqConfig.from_json(cfg))(g, ids)
                torch.cuda.synchronize()
            except Exception as exc:  # reported; the timing process reports it again where it times the tile
                failures.append(f"{name} T={tokens} {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
        del layer
        torch.cuda.empty_cache()
    return failures


def _decode_widths(tokens: int, top_k: int, num_experts: int, n: int, k: int, sms: int):
    """block_n -> the decode tile of that width (``fused.decode_tile``, its own split slices) where the count takes
    the decode tile (up to 16 pairs an expert), else None."""
    from moe_fsm.kernels.triton_wq.fused import decode_tile

    if tokens * top_k > 16 * num_experts:
        return None
    return lambda block_n: decode_tile(tokens, top_k, num_experts, n, k, sms, block_n)


def inflight(args) -> None:
    """Per row and token count: the decode tile moe-fsm serves against ``inflight_variants`` (one change each to the
    weight bytes an SM keeps in flight), each checked against float64, beside the read floor of the same bytes
    (``bench_read_floor``: kernels that only read them, 16-byte loads), moe-fsm's bf16 experts and, for MXFP4,
    ``triton_kernels`` (``--extract``); the copy rate measured first. Every tile is compiled first in ``--workers``
    processes. Writes ``<out>/wq_inflight.json`` and ``.md`` after every point."""
    import multiprocessing as mp

    import torch
    import triton
    from bench_experts_roofline import time_graph
    from bench_read_floor import read_floor
    from triton.testing import do_bench

    from moe_fsm.kernels.triton_moe import fused_experts
    from moe_fsm.kernels.triton_wq import WeightQuant
    from moe_fsm.kernels.triton_wq.fused import default_wq_config

    t0 = time.time()
    sys.path.insert(0, str(Path(args.extract)))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = _inflight_shapes()
    points = [(name, t) for name in args.rows for t in args.tokens]
    jobs = []
    for name, tokens in points:
        shape, scheme = shapes[name][:2]
        quant = WeightQuant.for_scheme(scheme)
        default = default_wq_config(tokens, shape.top_k, shape.num_experts, shape.intermediate, shape.hidden, sms,
                                    quant.kind, quant=quant)
        widths = _decode_widths(tokens, shape.top_k, shape.num_experts, shape.intermediate, shape.hidden, sms)
        jobs.append((name, tokens, [c.to_json() for _, c in inflight_variants(default, args.variants, widths)]))
    if args.workers > 0:
        chunks = [c for c in (jobs[i::args.workers] for i in range(args.workers)) if c]
        with mp.get_context("spawn").Pool(len(chunks)) as pool:
            for line in itertools.chain.from_iterable(pool.map(_inflight_compile, chunks)):
                print("  compile: " + line, flush=True)
        print(f"[compiled in {time.time() - t0:.0f} s]", flush=True)
    if args.compile_only:
        return
    n_bytes = 1 << 30
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_tbps = 2 * n_bytes / do_bench(lambda: dst.copy_(src), rep=100) / 1e9
    del src, dst
    device = torch.cuda.get_device_name()
    print(f"{device}, {sms} SMs; torch {torch.__version__}, Triton {triton.__version__}; copy rate {copy_tbps:.2f} TB/s",
          flush=True)
    header = "| row | tokens | tile | µs | % copy | default / tile | err | read floor 1 / 2 kernels µs (% copy) | bf16 µs | peer µs |"
    lines = [header, "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    rows = []
    for name in args.rows:
        try:
            layer = _inflight_layer(name, None, seed=0)
        except Exception as exc:
            print(f"{name}: failed to build: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        shape, scheme, activation, limit, quant, _, w1q, w2q, scales = layer
        e, k, n, top_k = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k
        per_expert_q = (w1q.numel() + w2q.numel()
                        + sum(t.numel() * t.element_size() for t in vars(scales).values() if t is not None)) / e
        gen = torch.Generator(device="cuda").manual_seed(2)
        w1b = torch.randn(e, 2 * n, k, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(k**-0.5)
        w2b = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(n**-0.5)
        peer = None
        if quant.kind == "mxfp4":
            try:
                peer = TritonKernelsPeer(w1q, w2q, scales, e, n, k, top_k)
            except Exception as exc:  # the peer is optional: say why it is missing
                print(f"{name}: triton_kernels unavailable: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        for tokens in args.tokens:
            if time.time() - t0 > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {name} T={tokens} and later points not timed", flush=True)
                break
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            logits = [torch.randn(tokens, e, device="cuda", generator=gen) for _ in range(8)]
            routes = []
            for lg in logits:
                vals, ids = lg.topk(top_k, dim=1)
                routes.append((torch.softmax(vals, dim=1), ids.to(torch.int32)))
            active = sum(torch.unique(ids).numel() for _, ids in routes) / len(routes)
            call = _inflight_call(layer, x)
            sample = torch.arange(min(tokens, 2), device="cuda")
            g0, ids0 = routes[0]
            ref = _reference(x, w1q, w2q, scales, scheme, g0, ids0, activation, limit, sample)
            default = default_wq_config(tokens, top_k, e, n, k, sms, quant.kind, quant=quant)
            floor = (read_floor(int(active * per_expert_q), 2 * tokens * k * 2, len(routes), rep_ms=args.rep_ms)
                     if not args.no_floor else {"one_kernel_us": None, "two_kernels_us": None})
            bf16_us = time_graph(lambda g, ids: fused_experts(x, w1b, w2b, g, ids, activation=activation,
                                                              swiglu_limit=limit), routes, args.rep_ms)
            peer_us = None
            if peer is not None:
                try:
                    peer_us = time_graph(lambda rd, gi, si: peer(x, rd, gi, si), [peer.route(lg) for lg in logits],
                                         args.rep_ms)
                except Exception as exc:
                    print(f"  {name} T={tokens} peer failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            tiles = {}
            for label, cfg in inflight_variants(default, args.variants, _decode_widths(tokens, top_k, e, n, k, sms)):
                try:
                    out = call(cfg)(g0, ids0)
                    got = out[sample].double()
                    err = float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")
                    tiles[label] = {"us": time_graph(call(cfg), routes, args.rep_ms), "err": err,
                                    "config": cfg.to_json()}
                except Exception as exc:  # a tile that does not build here is reported; the others still measure
                    print(f"  {name} T={tokens} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            tb = lambda us: active * per_expert_q / us / 1e6  # noqa: E731
            row = {"row": name, "tokens": tokens, "active_experts": active, "weight_bytes": active * per_expert_q,
                   "copy_TBps": copy_tbps, "floor_one_kernel_us": floor["one_kernel_us"],
                   "floor_two_kernels_us": floor["two_kernels_us"], "bf16_us": bf16_us, "peer_us": peer_us,
                   "tiles": tiles}
            rows.append(row)
            base = tiles.get("default", {}).get("us")
            floor_text = "not timed" if args.no_floor else (
                f"{floor['one_kernel_us']:.1f} / {floor['two_kernels_us']:.1f} "
                f"({100 * tb(floor['one_kernel_us']) / copy_tbps:.0f}% / "
                f"{100 * tb(floor['two_kernels_us']) / copy_tbps:.0f}%)")
            for label, found in tiles.items():
                line = (f"| {name} | {tokens} | {label} | {found['us']:.1f} | {100 * tb(found['us']) / copy_tbps:.0f}% | "
                        f"{base / found['us'] if base else float('nan'):.2f} | {found['err']:.1e} | "
                        f"{floor_text} | {bf16_us:.1f} | {peer_us if peer_us else float('nan'):.1f} |")
                lines.append(line)
                print(line, flush=True)
            report = {"device": device, "sms": sms, "torch": torch.__version__, "triton": triton.__version__,
                      "copy_TBps": copy_tbps, "rows": rows}
            (out_dir / "wq_inflight.json").write_text(json.dumps(report, indent=1))
            (out_dir / "wq_inflight.md").write_text("\n".join(lines) + "\n")
        del layer, w1q, w2q, scales, w1b, w2b, peer
        torch.cuda.empty_cache()
        print(f"[{time.time() - t0:.0f} s]", flush=True)


# ---------------------------------------------------------------- prefill: the bf16 Hopper path vs the swap-AB kernel


def prefill_compare(args) -> None:
    """Per row and token count (512 / 2048 / 8192 by default): the swap-AB kernel with the tile moe-fsm takes there
    now (the shipped table's, else the default), the same call on the bf16 Hopper path (``WqConfig.hopper_bf16``:
    the hit experts dequantized into a 16-bit scratch, then the bf16 TMA kernels), the dequantization pass alone,
    moe-fsm's bf16 experts and the peer, all on the same inputs and routings; the Hopper path's error against float64
    on 16 sampled tokens. Writes ``<out>/wq_prefill.json`` and ``.md`` after every point."""
    import torch
    import triton
    from bench_experts_roofline import measure_ceilings, time_graph

    from moe_fsm.kernels.triton_moe import fused_experts
    from moe_fsm.kernels.triton_moe._runtime import device_name
    from moe_fsm.kernels.triton_wq import WeightQuant, fused_wq_experts, prefill
    from moe_fsm.kernels.triton_wq.fused import _kernels, get_wq_config, relayout_nibbles

    shapes = {**_shapes(), **_decode_shapes()}  # the decode rows too: other formats (NVFP4, INT4 g32) and shapes
    unknown = [name for name in args.rows or () if name not in shapes]
    if unknown:
        raise SystemExit(f"prefill --rows: no row named {', '.join(map(repr, unknown))}; the rows: "
                         f"{', '.join(map(repr, shapes))}")
    sys.path.insert(0, str(Path(args.extract)))
    t0 = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings()
    device = torch.cuda.get_device_name()
    header = ("| row | tokens | swap-AB µs | Hopper bf16 path µs | of which dequant µs | bf16 µs | peer µs | "
              "path / swap-AB speed-up | bf16 / path | peer / path | TFLOP/s path (bf16) | err (path) | swap-AB tile |")
    lines = [f"{device}; torch {torch.__version__}, Triton {triton.__version__}; copy {ceilings['copy_GBps']:.0f} GB/s, "
             f"bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s (measured in this run)", "",
             header, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    print("\n".join(lines), flush=True)
    rows = []
    kern = _kernels()
    for name in args.rows or _shapes():
        shape, scheme, activation, limit, bias = shapes[name]
        e, k, n, top_k = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k
        gen = torch.Generator(device="cuda").manual_seed(0)
        w1q, w2q, scales = _quantized(shape, scheme, bias, gen)
        quant = WeightQuant.for_scheme(scheme)
        w1s, w2s = relayout_nibbles(w1q), relayout_nibbles(w2q)
        w1b = torch.randn(e, 2 * n, k, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(k**-0.5)
        w2b = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(n**-0.5)
        peer = None
        try:
            if quant.kind == "mxfp4":
                peer = TritonKernelsPeer(w1q, w2q, scales, e, n, k, top_k)
            elif quant.kind == "int4" and not quant.zero_point:
                peer = VllmGptqAwqPeer(Path(args.extract), w1q, w2q, scales, e, n, k, top_k, quant.group)
            else:
                print(f"{name}: no peer timed for {quant.kind}{' with zero points' if quant.zero_point else ''}", flush=True)
        except Exception as exc:  # the peer is optional: say why it is missing
            print(f"{name}: peer unavailable: {type(exc).__name__}: {exc}", flush=True)
        for tokens in args.tokens:
            count = 4 if tokens <= 512 else 2
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            logits = [torch.randn(tokens, e, device="cuda", generator=gen) for _ in range(count)]
            routes = []
            for lg in logits:
                vals, ids = lg.topk(top_k, dim=1)
                routes.append((torch.softmax(vals, dim=1), ids.to(torch.int32)))
            swap = replace(get_wq_config(device_name(x.device), quant, e, n, k, top_k, tokens), hopper_bf16=False)
            sample_rows = torch.randperm(tokens, device="cuda", generator=gen)[:16]

            def ours(cfg):
                return lambda g, ids: fused_wq_experts(
                    x, w1s, w2s, g, ids, quant=quant, w1_scale=scales.w1_scale, w2_scale=scales.w2_scale,
                    w1_zero_point=scales.w1_zero_point, w2_zero_point=scales.w2_zero_point,
                    w1_global_scale=scales.w1_global_scale, w2_global_scale=scales.w2_global_scale,
                    w1_bias=scales.w1_bias, w2_bias=scales.w2_bias, activation=activation, swiglu_limit=limit,
                    split=True, config=cfg)

            hit = torch.ones(e + 1, dtype=torch.int32, device="cuda")
            k_in = k + (prefill.bias_columns(k) if bias else 0)
            scratch = torch.empty(e * max(2 * n * k_in, k * n), dtype=torch.bfloat16, device="cuda")
            group = quant.columns_per_scale

            def dequant_both(tile):
                def fn(_g, _ids):
                    prefill._dequantize(kern, w1s, scales.w1_scale, scales.w1_zero_point, None, scales.w1_bias, hit,
                                        scratch[: e * 2 * n * k_in].view(e, 2 * n, k_in), rows=2 * n, cols=k,
                                        group=group(k), kind=KIND_CODES[quant.kind],
                                        zero_code=8 if quant.kind == "int4" else 128, split=True, deinterleave=False,
                                        tile=tile)
                    prefill._dequantize(kern, w2s, scales.w2_scale, scales.w2_zero_point, None, None, hit,
                                        scratch[: e * k * n].view(e, k, n), rows=k, cols=n, group=group(n),
                                        kind=KIND_CODES[quant.kind], zero_code=8 if quant.kind == "int4" else 128,
                                        split=True, deinterleave=False, tile=tile)
                return fn

            if args.dequant_tile:  # fixed by the caller (the search below takes five timings)
                prefill.DEQUANT_TILE = tuple(args.dequant_tile)
            elif tokens == args.tokens[0]:  # the pass's tile, once a row: the fastest is what the path then runs
                tiles = {t: time_graph(dequant_both(t), routes[:1], args.rep_ms) for t in DEQUANT_TILES}
                prefill.DEQUANT_TILE = min(tiles, key=tiles.get)
                print(f"  {name}: dequant pass µs by (rows, bytes, warps): "
                      + ", ".join(f"{t}: {us:.1f}" for t, us in tiles.items()), flush=True)
            dequant_us = time_graph(dequant_both(None), routes[:1], args.rep_ms)
            del scratch
            swap_us = time_graph(ours(swap), routes, args.rep_ms)
            path_us = time_graph(ours(replace(swap, hopper_bf16=True)), routes, args.rep_ms)
            candidates_us = {}
            ref = _reference(x, w1q, w2q, scales, scheme, *routes[0], activation, limit, sample_rows)
            for cfg in (chained_candidates(tokens, top_k, e) if args.candidates else []):
                label = json.dumps(cfg.to_json())
                try:
                    candidates_us[label] = time_graph(ours(cfg), routes, args.rep_ms)
                    # the allocator's next blocks hold NaN: an output the kernel leaves unwritten shows
                    torch.full((1 << 29,), float("nan"), dtype=torch.bfloat16, device="cuda")
                    got = ours(cfg)(*routes[0])[sample_rows].double()
                    err = float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")
                    print(f"  {name} T={tokens} {label}: {candidates_us[label]:.1f} µs, err {err:.1e}", flush=True)
                    candidates_us[label + " err"] = err
                except Exception as exc:  # report and go on: the other candidates still run
                    print(f"  {name} T={tokens} {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            bf16_us = time_graph(lambda g, ids: fused_experts(x, w1b, w2b, g, ids, activation=activation,
                                                              swiglu_limit=limit), routes, args.rep_ms)
            peer_us = None
            if peer is not None:
                try:
                    if quant.kind == "mxfp4":
                        routed = [peer.route(lg) for lg in logits]
                        peer_us = time_graph(lambda rd, gi, si: peer(x, rd, gi, si), routed, args.rep_ms)
                    else:
                        peer_us = time_graph(lambda g, ids: peer(x, g, ids), routes, args.rep_ms)
                except Exception as exc:
                    print(f"  {name} T={tokens} peer failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            sample = sample_rows
            g0, ids0 = routes[0]
            torch.full((1 << 29,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison the allocator's blocks
            got = ours(replace(swap, hopper_bf16=True))(g0, ids0)[sample].double()
            err = float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")
            flops = 2 * tokens * top_k * 3 * n * k
            row = {"row": name, "tokens": tokens, "swap_ab_us": swap_us, "hopper_bf16_us": path_us,
                   "dequant_us": dequant_us, "dequant_tile": list(prefill.DEQUANT_TILE), "bf16_us": bf16_us, "peer_us": peer_us, "rel_err": err,
                   "swap_ab_config": swap.to_json(), "candidates_us": candidates_us, "tflops": flops / path_us / 1e6,
                   "bf16_tflops": flops / bf16_us / 1e6}
            rows.append(row)
            peer_txt = f"{peer_us:.1f}" if peer_us else "-"
            vs_peer = f"{peer_us / path_us:.2f}" if peer_us else "-"
            c = swap.to_json()
            line = (f"| {name} | {tokens} | {swap_us:.1f} | {path_us:.1f} | {dequant_us:.1f} | {bf16_us:.1f} | "
                    f"{peer_txt} | {swap_us / path_us:.2f} | {bf16_us / path_us:.2f} | {vs_peer} | "
                    f"{row['tflops']:.0f} ({row['bf16_tflops']:.0f}) | {err:.1e} | "
                    f"{c['block_m']},{c['block_n']},{c['block_k']},{c['num_warps']},{c['num_stages']} |")
            lines.append(line)
            print(line, flush=True)
            report = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
                      "ceilings": ceilings, "rows": rows}
            (out_dir / "wq_prefill.json").write_text(json.dumps(report, indent=1))
            (out_dir / "wq_prefill.md").write_text("\n".join(lines) + "\n")
        del w1q, w2q, w1s, w2s, w1b, w2b, scales, peer
        torch.cuda.empty_cache()
        print(f"[{time.time() - t0:.0f} s]", flush=True)
    if args.resources:
        from moe_fsm.kernels.triton_moe._hopper_kernels import moe_gemm_tma_kernel

        report["resources"] = compiled_resources({"wq_dequant_kernel": kern.wq_dequant_kernel,
                                                  "moe_gemm_tma_kernel": moe_gemm_tma_kernel})
        for r in report["resources"]:
            print(f"  {r['kernel']}: {r['regs_per_thread']} registers a thread x {r['num_warps']} warps = "
                  f"{r['regs_per_program']} a program, {r['spills']} spills, {r['shared_bytes']} B shared", flush=True)
        (out_dir / "wq_prefill.json").write_text(json.dumps(report, indent=1))


def compiled_resources(kernels: dict) -> list[dict]:
    """Registers a thread, spills, shared memory and warps of every variant of ``kernels`` (name -> Triton kernel)
    compiled in this process: whether two kernels' programs can share an SM at once (an SM holds 64K registers and
    228 KB of shared memory)."""
    found = []
    for name, fn in kernels.items():
        for device, entry in getattr(fn, "device_caches", {}).items():
            for compiled in entry[0].values():
                meta = compiled.metadata
                warps = getattr(meta, "num_warps", None)
                regs = getattr(compiled, "n_regs", None)
                found.append({"kernel": name, "device": str(device), "regs_per_thread": regs,
                              "spills": getattr(compiled, "n_spills", None), "shared_bytes": getattr(meta, "shared", None),
                              "num_warps": warps, "regs_per_program": regs * 32 * warps if regs and warps else None})
    return found


KIND_CODES = {"mxfp4": 0, "int4": 1, "int8": 2, "nvfp4": 3}
DEQUANT_TILES = ((16, 128, 4), (32, 128, 4), (16, 256, 4), (32, 256, 8), (64, 128, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--wheel", required=True)
    p.add_argument("--extract", default=str(ROOT / ".xfer" / "wq_peers"))
    r = sub.add_parser("run")
    r.add_argument("--extract", default=str(ROOT / ".xfer" / "wq_peers"))
    r.add_argument("--out", default=str(ROOT / "bench-out"))
    r.add_argument("--rows", nargs="*")
    r.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    r.add_argument("--rep-ms", type=float, default=60.0)
    r.add_argument("--write-table")
    r.add_argument("--served", action="store_true",
                   help="time only the tile moe-fsm serves at each point (its table's, else default_wq_config), "
                        "not the candidate grid")
    r.add_argument("--ptx-only", action="store_true",
                   help="MXFP4: the inline-PTX path's candidates only (not tl.dot_scaled's, slower everywhere)")
    r.add_argument("--compile-only", action="store_true",
                   help="call every candidate, peer and bf16 once (fills Triton's cache for a timed run); no report")
    d = sub.add_parser("decode", help="one-pass decode tile vs split-K tile vs bf16 at 1-32 tokens (GPU, ~90 s)")
    d.add_argument("--out", default=str(ROOT / "bench-out"))
    d.add_argument("--rows", nargs="*", choices=list(DECODE_ROWS))
    d.add_argument("--tokens", nargs="*", type=int, default=[1, 8, 32])
    d.add_argument("--rep-ms", type=float, default=20.0)
    d.add_argument("--sweep", action="store_true",
                   help="also time each GEMM split along K alone (2-6 slices), three other decode tiles, and the "
                        "device µs of each kernel (torch.profiler)")
    d.add_argument("--plain", action="store_true",
                   help="also time the default tile with the plain Triton fp32 dequantization (fast=False)")
    f = sub.add_parser("prefill", help="swap-AB kernel vs the bf16 Hopper path vs bf16 vs the peer at 512-8192 tokens (GPU)")
    f.add_argument("--extract", default=str(ROOT / ".xfer" / "wq_peers"))
    f.add_argument("--out", default=str(ROOT / "bench-out"))
    f.add_argument("--rows", nargs="*", help="row names of run or decode (default: run's three)")
    f.add_argument("--tokens", nargs="*", type=int, default=[512, 2048, 8192])
    f.add_argument("--rep-ms", type=float, default=40.0)
    f.add_argument("--candidates", action="store_true",
                   help="also time the chained swap-AB tiles (chained_candidates), with their error")
    f.add_argument("--resources", action="store_true",
                   help="print the registers, spills and shared memory of the Hopper path's compiled kernels")
    f.add_argument("--dequant-tile", nargs=3, type=int, metavar=("ROWS", "BYTES", "WARPS"),
                   help="the dequantization pass's tile (default: the fastest of DEQUANT_TILES, timed first)")
    i = sub.add_parser("inflight", help="the decode tile against one-change variants of its bytes in flight, the "
                                        "read floor, bf16 and triton_kernels at 1-32 tokens (GPU)")
    i.add_argument("--extract", default=str(ROOT / ".xfer" / "wq_peers"))
    i.add_argument("--out", default=str(ROOT / "bench-out"))
    i.add_argument("--rows", nargs="*", choices=list(INFLIGHT_ROWS), default=list(INFLIGHT_ROWS))
    i.add_argument("--tokens", nargs="*", type=int, default=[1, 8])
    i.add_argument("--rep-ms", type=float, default=15.0)
    i.add_argument("--workers", type=int, default=12, help="processes compiling the tiles first (0: none)")
    i.add_argument("--budget-s", type=float, default=240.0, help="no new point starts after this many seconds")
    i.add_argument("--compile-only", action="store_true", help="only fill Triton's cache (the workers' pass)")
    i.add_argument("--variants", nargs="*", help="labels of inflight_variants to time beside the default (default: all)")
    i.add_argument("--no-floor", action="store_true", help="skip the read floor (a run that compares tiles only)")
    args = parser.parse_args()
    if args.cmd == "inflight":
        inflight(args)
    elif args.cmd == "prefill":
        prefill_compare(args)
    elif args.cmd == "prepare":
        prepare(Path(args.wheel), Path(args.extract))
    elif args.cmd == "decode":
        decode(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
