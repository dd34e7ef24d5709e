"""moe-fsm's Triton MoE layer against vLLM 0.33.0's ``fused_moe_kernel``, side by side on one GPU.

Two steps, because the GPU machine has neither network nor vLLM:

``prepare`` (here, with network or the wheel cached): finds the vllm 0.33.0 wheel in
the cache directory (``pip download vllm==0.33.0 --no-deps`` into it when absent) and
extracts, from the wheel's own source, vLLM's Triton ``fused_moe_kernel`` (with the
``write_zeros_to_output`` helper it calls), ``get_default_config``, and its tuned
config JSONs for H100 and H200, into an ignored folder (``.vllm_extract/``). Nothing
of vLLM is committed; the folder is carried to the GPU machine.

``run`` (on the GPU): executes the extracted kernel source as a module (its only
imports are triton and triton.language) and ``get_default_config`` with vLLM's
platform and env lookups stubbed (CUDA, batch invariance off). For each layer shape,
dtype and token count both pipelines get the same weights, routings and inputs, the
same alignment (moe-fsm's ``align_tokens`` in place of vLLM's CUDA
``moe_align_block_size``, whose output it matches in layout; vLLM's naive one-block-
per-pair assignment where vLLM itself takes it, M * top_k * 4 <= E), the same FP8
activation quantizer (moe-fsm's), the same top-k sum kernel. vLLM's side then runs as
vLLM's ``fused_experts_impl`` does: w1 GEMM into [M, top_k, 2N], SiLU-and-mul (a
one-pass Triton kernel standing in for vLLM's CUDA op), re-quantization, w2 GEMM with
the router weight, sum. vLLM's config is its tuned table for the device when it ships
one for (E, N, dtype), else its ``get_default_config``; moe-fsm's is its own lookup
(user table, shipped table, default).

A third column, FlashInfer's CUTLASS fused MoE (``--columns ...,flashinfer``), runs through
moe-fsm's own adapter (``FlashInferCutlassExperts`` in a ``ModularKernel``, as ``moe_fsm.runtime.build``
makes it for a FLASHINFER_CUTLASS layer) on the same weights, routings and inputs: bf16 layers as
they are, FP8 per-tensor layers with static activation scales calibrated on the first input (the
layout FlashInfer takes; moe-fsm's Triton side quantizes per tensor dynamically), block-FP8 layers
through FlashInfer's DeepSeek block-scale path. FlashInfer's autotuner picks its tactic for each
shape and token count once, before timing. On Hopper it needs the module ``moe-fsm flashinfer
build`` installs. A column whose kernel is missing here (no ``.vllm_extract``, no FlashInfer
module) is left out with a line that says why.

Another column, ``other`` (``--columns ours,vllm,other``), times moe-fsm's layer with the row layout its rule
(``align.pair_blocks_pay``) did not pick: sorted where it leaves the pairs unsorted (one row block each, no
alignment launch), unsorted where it sorts, at the points past one token with at most one pair per expert
(more pairs would read each expert's weights several times over); ``other / ours`` > 1 means the rule's layout
was the faster.

Columns ``sum_apart`` and ``sum_in_w2`` time moe-fsm's layer at up to 8 tokens with the top-k sum forced to its
own launch after w2, or into the w2 GEMM (``fused_experts``'s ``sum_in_w2``; ``config.sums_slots_in_w2`` is the
rule ``ours`` follows): each is timed where the rule picked the other, and ``<column>_rel_diff`` is its distance to
ours on the first input.

``run --untuned`` takes both sides off their tables: moe-fsm's ``default_config`` against vLLM's
``get_default_config``, what each runs on a shape no table holds.

Each point is timed as CUDA-graph replays of R calls on R different routings, divided
by R, with L2 flushed before each replay (``triton.testing.do_bench``, median), in
``ROUNDS`` rounds that take the columns in turn, the order reversed each round: the median
round is reported. At 8192 tokens the card runs at its power limit (700 W on the H100,
docs/perf/hopper.md) and its clock follows its temperature, so a column timed right
after another inherits its heat; turns and rounds spread that over every column. At one
token the eager (no graph) call is timed too, for the host cost. Writes JSON, Markdown
and PNG (default ``bench-out/vs_vllm_<gpu>.*``; docs/perf/vs_vllm.md shows the latest tables).
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

VLLM_VERSION = "0.33.0"
WHEEL = f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
FUSED_MOE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
CONFIG_DIR = "vllm/model_executor/layers/fused_moe/configs/"
KERNEL_FUNCTIONS = ("write_zeros_to_output", "fused_moe_kernel")
DEFAULT_EXTRACT = ROOT / ".vllm_extract"
# timing rounds per point, the columns taken in turn (module docstring)
ROUNDS = 3
# the top-k sum columns and what each forces (``fused_experts``'s ``sum_in_w2``)
SUM_COLUMNS = {"sum_apart": False, "sum_in_w2": True}


# ---------------------------------------------------------------- prepare (no GPU, no torch)


def find_or_download_wheel(cache: Path) -> Path:
    """The cached wheel, downloaded with pip (no dependencies) when it is not there."""
    wheel = cache / WHEEL
    if wheel.is_file():
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", f"vllm=={VLLM_VERSION}", "--no-deps", "--only-binary=:all:", "-d", str(cache)],
        check=True,
    )
    found = sorted(cache.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not found:
        sys.exit(f"pip download put no vllm {VLLM_VERSION} wheel into {cache}")
    return found[0]


def _function_sources(source: str, names: tuple[str, ...]) -> dict[str, str]:
    """The source text of each named top-level function, decorators included."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            out[node.name] = "".join(lines[start : node.end_lineno])
    missing = set(names) - set(out)
    if missing:
        sys.exit(f"{FUSED_MOE} of vllm {VLLM_VERSION} has no function {sorted(missing)}")
    return out


def prepare(cache: Path, dest: Path) -> None:
    wheel = find_or_download_wheel(cache)
    with zipfile.ZipFile(wheel) as z:
        source = z.read(FUSED_MOE).decode()
        kernels = _function_sources(source, KERNEL_FUNCTIONS)
        default = _function_sources(source, ("get_default_config",))["get_default_config"]
        if dest.exists():
            shutil.rmtree(dest)
        (dest / "configs").mkdir(parents=True)
        header = (
            f"# Extracted at run time from vllm {VLLM_VERSION} ({FUSED_MOE}) by bench/bench_experts_vs_vllm.py prepare.\n"
            "# Not part of moe-fsm; never committed.\n"
            "import triton\nimport triton.language as tl\n\n\n"
        )
        (dest / "vllm_fused_moe_kernel.py").write_text(header + "\n\n".join(kernels[n] for n in KERNEL_FUNCTIONS))
        (dest / "vllm_default_config.py").write_text(
            f"# get_default_config of vllm {VLLM_VERSION} ({FUSED_MOE}); envs/current_platform/next_power_of_2 are\n"
            "# stubbed by the loader.\n" + default
        )
        configs = [
            n for n in z.namelist()
            if n.startswith(CONFIG_DIR) and n.endswith(".json") and ("H100" in n or "H200" in n)
        ]
        for name in configs:
            (dest / "configs" / Path(name).name).write_bytes(z.read(name))
    (dest / "manifest.json").write_text(json.dumps(
        {"vllm": VLLM_VERSION, "wheel": wheel.name, "functions": list(KERNEL_FUNCTIONS) + ["get_default_config"],
         "configs": len(configs)}, indent=1) + "\n")
    print(f"extracted vLLM {VLLM_VERSION}'s kernel, default config and {len(configs)} H100/H200 tables into {dest}")


# ---------------------------------------------------------------- vLLM side (GPU)


class VllmTriton:
    """vLLM's kernel, default-config rule and tuned tables, loaded from the extracted files."""

    def __init__(self, extract: Path, device_name: str, capability: tuple[int, int], use_tables: bool = True):
        import triton

        self.extract = extract
        self.use_tables = use_tables
        module = types.ModuleType("vllm_fused_moe_kernel")
        path = extract / "vllm_fused_moe_kernel.py"
        module.__file__ = str(path)
        sys.modules[module.__name__] = module  # triton.jit reads the source through the module
        exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
        self.kernel = module.fused_moe_kernel
        platform = types.SimpleNamespace(is_rocm=lambda: False, is_cuda=lambda: True)
        namespace = {
            "envs": types.SimpleNamespace(VLLM_BATCH_INVARIANT=False),
            "current_platform": platform,
            "next_power_of_2": triton.next_power_of_2,
            "should_moe_wna16_use_cuda": lambda *a, **k: False,
        }
        exec(compile((extract / "vllm_default_config.py").read_text(), "vllm_default_config.py", "exec"), namespace)
        self.default_config = namespace["get_default_config"]
        file_device = device_name.replace(" ", "_")
        self.file_device = "NVIDIA_H200" if "H200" in file_device.split("_") else file_device
        self.swap_ab_ok = capability == (9, 0)

    def table_name(self, e: int, n: int, fp8: Optional[str]) -> str:
        dtype = ",dtype=fp8_w8a8" if fp8 else ""
        block = ",block_shape=[128,128]" if fp8 == "block" else ""
        return f"E={e},N={n},device_name={self.file_device}{dtype}{block}.json"

    @functools.lru_cache(maxsize=None)
    def table(self, e: int, n: int, fp8: Optional[str]) -> Optional[dict]:
        path = self.extract / "configs" / self.table_name(e, n, fp8)
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        data.pop("triton_version", None)
        return {int(k): v for k, v in data.items()}

    def config(self, m: int, e: int, n: int, k: int, top_k: int, fp8: Optional[str]) -> tuple[dict, str]:
        """(config, where from) as try_get_optimal_moe_config picks it (its default rule alone without tables)."""
        table = self.table(e, n, fp8) if self.use_tables else None
        if table:
            return dict(table[min(table, key=lambda x: abs(x - m))]), "tuned"
        dtype = "fp8_w8a8" if fp8 else None
        block = [128, 128] if fp8 == "block" else None
        return dict(self.default_config(m, e, n, k, top_k, dtype, block)), "default"


def silu_and_mul_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, out_ptr, N, stride_x, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
        y = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    return kernel


class VllmPipeline:
    """vLLM's fused_experts_impl step by step around its Triton kernel (see the module docstring)."""

    def __init__(self, vllm: VllmTriton, shape, weights):
        import torch

        from moe_fsm.kernels.triton_moe.tuning import FP8_ACTIVATION

        self.torch = torch
        self.vllm, self.shape = vllm, shape
        self.w1, self.w2, self.s1, self.s2 = weights
        self.act_granularity = FP8_ACTIVATION[shape.fp8] if shape.fp8 else None
        self.act = silu_and_mul_kernel()
        self.configs: dict[int, tuple[dict, str]] = {}
        self.force_naive: Optional[bool] = None  # the precompile workers' two-expert copies set vLLM's choice

    def config(self, m: int) -> tuple[dict, str]:
        if m not in self.configs:
            s = self.shape
            self.configs[m] = self.vllm.config(m, s.num_experts, s.intermediate, s.hidden, s.top_k, s.fp8)
        return self.configs[m]

    def _gemm(self, a, a_scale, b, b_scale, c, topk_weights, routing, mul_routed_weight, top_k, config, compute_type, naive):
        import triton

        fp8 = self.shape.fp8
        sorted_ids, expert_ids, num_padded = routing
        m = a.size(0)
        bm = config["BLOCK_SIZE_M"]
        if sorted_ids is not None:
            em = sorted_ids.size(0)
            if m < bm:
                em = min(em, m * top_k * bm)
        else:
            em = topk_weights.numel() * bm
        cfg = {k: v for k, v in config.items() if k not in ("BLOCK_SIZE_K", "SPLIT_K")}
        block_k = config["BLOCK_SIZE_K"]
        if fp8 == "block":
            block_k = min(block_k, 128)
        swap_ab = bool(fp8) and self.vllm.swap_ab_ok and bm < 64 and config["BLOCK_SIZE_N"] >= 64
        if a_scale is not None and a_scale.ndim == 0:
            a_scale = a_scale.reshape(1)
        grid = (triton.cdiv(em, bm) * triton.cdiv(b.size(1), config["BLOCK_SIZE_N"]),)
        self.vllm.kernel[grid](
            a, b, c, None, a_scale, b_scale, topk_weights, sorted_ids, expert_ids, num_padded,
            b.size(1), b.size(2), em, topk_weights.numel(),
            a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1), c.stride(1), c.stride(2),
            a_scale.stride(0) if a_scale is not None and a_scale.ndim == 2 else 0,
            a_scale.stride(1) if a_scale is not None and a_scale.ndim == 2 else 0,
            b_scale.stride(0) if b_scale is not None else 0,
            b_scale.stride(2) if b_scale is not None and b_scale.ndim == 3 else 0,
            b_scale.stride(1) if b_scale is not None and b_scale.ndim >= 2 and b_scale.size(1) > 1 else 0,
            0, 0,
            128 if fp8 == "block" else 0, 128 if fp8 == "block" else 0,
            MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k, compute_type=compute_type,
            use_fp8_w8a8=bool(fp8), use_int8_w8a8=False, use_int8_w8a16=False,
            per_channel_quant=fp8 == "channel", naive_block_assignment=naive, HAS_BIAS=False,
            BLOCK_SIZE_K=block_k, SWAP_AB=swap_ab, USE_TD=False, SPLIT_K=1, **cfg,
        )

    def __call__(self, x, topk_weights, topk_ids):
        import triton.language as tl

        from moe_fsm.kernels.triton_moe import align_tokens, quantize_activation, topk_sum

        torch = self.torch
        s = self.shape
        m, top_k = topk_ids.shape
        config, _ = self.config(m)
        naive = m * top_k * 4 <= s.num_experts if self.force_naive is None else self.force_naive
        if naive:
            routing = (None, topk_ids.view(-1), torch.full((1,), topk_ids.numel() * config["BLOCK_SIZE_M"], dtype=torch.int32, device=x.device))
        else:
            r = align_tokens(topk_ids, s.num_experts, config["BLOCK_SIZE_M"])
            routing = (r.sorted_ids, r.block_expert, r.num_padded)
        if s.fp8:
            a, a_scale = quantize_activation(x, self.act_granularity)
        else:
            a, a_scale = x, None
        n, k = s.intermediate, s.hidden
        cache13 = torch.empty(m * top_k * max(2 * n, k), device=x.device, dtype=x.dtype)
        cache1 = cache13[: m * top_k * 2 * n].view(m, top_k, 2 * n)
        cache3 = cache13[: m * top_k * k].view(m, top_k, k)
        cache2 = torch.empty(m * top_k, n, device=x.device, dtype=x.dtype)
        compute_type = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
        self._gemm(a, a_scale, self.w1, self.s1, cache1, topk_weights, routing, False, top_k, config, compute_type, naive)
        block = min(1024, triton_next_pow2(n))
        self.act[(m * top_k, -(-n // block))](cache1, cache2, n, 2 * n, n, BLOCK=block)
        if s.fp8:
            a2, a2_scale = quantize_activation(cache2, self.act_granularity)
        else:
            a2, a2_scale = cache2, None
        self._gemm(a2, a2_scale, self.w2, self.s2, cache3, topk_weights, routing, True, 1, config, compute_type, naive)
        out = torch.empty_like(x)
        return topk_sum(cache3.view(m * top_k, k), topk_ids, s.num_experts, out)


def triton_next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


# ---------------------------------------------------------------- the benchmark (GPU)


def expert_bytes(shape) -> int:
    k, n = shape.hidden, shape.intermediate
    if shape.fp8 is None:
        return 3 * n * k * 2
    scales = {"tensor": 2, "channel": 2 * n + k, "block": -(-2 * n // 128) * -(-k // 128) + -(-k // 128) * -(-n // 128)}[shape.fp8]
    return 3 * n * k + 4 * scales


def precompile_worker(jobs: list[tuple]) -> list[str]:
    """Worker: run both pipelines once per (series, tokens) on a two-expert copy so every kernel compiles."""
    import torch

    from moe_fsm.kernels.triton_moe import MoEConfig
    from moe_fsm.kernels.triton_moe.tuning import LayerShape, layer_fn, make_weights

    failures = []
    for extract, series, shape_fields, tokens, ours_json, vllm_cfg, naive, layouts, sums in jobs:
        shape = LayerShape(*shape_fields)
        small = shape.with_experts(2)
        try:
            weights = make_weights(small, init=False)
            x = torch.randn(tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
            ids = torch.randint(0, 2, (tokens, shape.top_k), device="cuda", dtype=torch.int32)
            g = torch.full(ids.shape, 1.0 / shape.top_k, device="cuda")
            for unsorted in layouts:  # the full shape's layouts (two experts alone would always sort)
                layer_fn(small, weights, MoEConfig.from_json(ours_json), unsorted)(x, g, ids)
            for sum_in_w2 in sums:  # the forced top-k sum columns, in the rule's layout
                layer_fn(small, weights, MoEConfig.from_json(ours_json), layouts[0], sum_in_w2)(x, g, ids)
            if extract is not None:
                vllm = VllmTriton(Path(extract), torch.cuda.get_device_name(), torch.cuda.get_device_capability())
                pipe = VllmPipeline(vllm, small, weights)
                pipe.configs[tokens] = (vllm_cfg, "given")
                pipe.force_naive = naive
                pipe(x, g, ids)
            torch.cuda.synchronize()
        except Exception as exc:
            failures.append(f"{series} T={tokens}: {type(exc).__name__}: {str(exc)[:200]}")
    return failures


class FlashInferColumn:
    """FlashInfer's CUTLASS fused MoE through moe-fsm's adapter, for one layer shape's weights."""

    def __init__(self, shape, weights):
        from moe_fsm.experts.flashinfer_experts import FlashInferCutlassExperts
        from moe_fsm.inputs.layer import MoELayer
        from moe_fsm.inputs.quant import QuantScheme
        from moe_fsm.modular.kernel import ModularKernel
        from moe_fsm.prepare_finalize.local import LocalPrepareFinalize

        quant = {None: QuantScheme.unquantized(), "tensor": QuantScheme.fp8("tensor", "tensor", static_activation=True),
                 "block": QuantScheme.fp8("block", "group")}
        if shape.fp8 not in quant:
            raise ValueError(f"moe-fsm's FlashInfer adapter has no FP8 {shape.fp8} layout")
        self.layer = MoELayer(quant=quant[shape.fp8], num_experts=shape.num_experts, top_k=shape.top_k,
                              hidden_size=shape.hidden, intermediate_size=shape.intermediate, dtype=shape.dtype)
        self.kernel = ModularKernel(LocalPrepareFinalize(), FlashInferCutlassExperts(self.layer), self.layer)
        self.shape, (self.w1, self.w2, self.s1, self.s2) = shape, weights
        self.scales = None

    def calibrate(self, x):
        """Static per-tensor activation scales from one input: a1 from x, a2 from a float32 pass of the intermediate."""
        import torch

        from moe_fsm.modular.interfaces import ExpertScales

        if self.shape.fp8 is None:
            return
        if self.shape.fp8 == "block":
            self.scales = ExpertScales(w1_scale=self.s1, w2_scale=self.s2)
            return
        n = self.shape.intermediate
        a1 = (x.float().abs().amax() / 448).reshape(())
        a2 = torch.zeros((), device=x.device)
        for e in range(self.shape.num_experts):  # every expert, so any routing stays inside the static range
            w1 = self.w1[e].float() * self.s1[e]
            h = x.float() @ w1.T
            a2 = torch.maximum(a2, (torch.nn.functional.silu(h[:, :n]) * h[:, n:]).abs().amax() / 448)
        self.scales = ExpertScales(w1_scale=self.s1, w2_scale=self.s2, a1_scale=a1, a2_scale=a2.reshape(()))

    def __call__(self, x, topk_weights, topk_ids):
        return self.kernel(x, self.w1, self.w2, topk_weights, topk_ids, scales=self.scales)

    def autotune(self, inputs):
        from flashinfer.autotuner import autotune

        with autotune(True):
            self(*inputs[0])
        import torch

        torch.cuda.synchronize()


def main_run(args) -> None:
    import multiprocessing as mp

    import torch
    import triton

    from bench_experts_roofline import measure_ceilings, versions
    from bench_read_floor import read_floor
    from moe_fsm.kernels.triton_moe import get_config
    from moe_fsm.kernels.triton_moe.align import pair_blocks_pay
    from moe_fsm.kernels.triton_moe.config import default_config, sums_slots_in_w2
    from moe_fsm.kernels.triton_moe._runtime import device_name
    from dataclasses import astuple

    from moe_fsm.kernels.triton_moe.tuning import layer_fn, make_weights, replays_per_graph, routings, time_graph

    if not torch.cuda.is_available():
        sys.exit("bench_experts_vs_vllm.py run needs a CUDA device")
    dev_name = torch.cuda.get_device_name()
    columns = [c.strip() for c in args.columns.split(",") if c.strip()]
    vllm = None
    if "vllm" in columns:
        if (args.extract / "fused_moe_kernel.py").exists() or any(args.extract.glob("*.py")):
            vllm = VllmTriton(args.extract, dev_name, torch.cuda.get_device_capability(), use_tables=not args.untuned)
        else:
            print(f"no vLLM column: {args.extract} holds no extracted kernel (bench_experts_vs_vllm.py prepare)", flush=True)
    shapes = series_shapes(args)
    series_list = list(shapes)
    start = time.time()

    def other_layout_timed(shape, t):
        return "other" in columns and 1 < t and t * shape.top_k <= shape.num_experts

    def sum_columns(shape, t):
        """The forced top-k sum columns timed at this point: those whose choice differs from the rule's."""
        if t > 8:
            return []
        rule = sums_slots_in_w2(pair_blocks_pay(t, shape.top_k, shape.num_experts, shape.expert_bytes),
                                ours_config(shape, t), t, shape.hidden)
        return [c for c, forced in SUM_COLUMNS.items() if c in columns and forced != rule]

    def ours_config(shape, t):
        if args.untuned:
            return default_config(shape.num_experts, shape.intermediate, shape.hidden, shape.top_k, t,
                                  block_fp8=shape.fp8 == "block", fp8=shape.fp8 is not None, device=dev_name)
        return get_config(device_name(torch.device("cuda", 0)), shape.num_experts, shape.intermediate, shape.hidden,
                          shape.top_k, t, shape.dtype, shape.fp8)

    if args.workers > 0:
        jobs = []
        for series in series_list:
            shape = shapes[series]
            for t in args.tokens:
                cfg = vllm.config(t, shape.num_experts, shape.intermediate, shape.hidden, shape.top_k, shape.fp8)[0] if vllm else None
                rule = pair_blocks_pay(t, shape.top_k, shape.num_experts, shape.expert_bytes)
                layouts = (rule, not rule) if other_layout_timed(shape, t) else (rule,)
                jobs.append((str(args.extract) if vllm else None, series, astuple(shape), t, ours_config(shape, t).to_json(), cfg,
                             t * shape.top_k * 4 <= shape.num_experts, layouts,
                             [SUM_COLUMNS[c] for c in sum_columns(shape, t)]))
        chunks = [c for c in (jobs[i::args.workers] for i in range(args.workers)) if c]
        with mp.get_context("spawn").Pool(len(chunks)) as pool:
            failures = [f for fs in pool.map(precompile_worker, chunks) for f in fs]
        print(f"precompiled {len(jobs)} points in {time.time() - start:.0f} s; {len(failures)} failed", flush=True)
        for f in failures:
            print("  " + f, flush=True)

    ceilings = measure_ceilings()
    print(json.dumps(ceilings), flush=True)
    report = {"machine": versions(), "ceilings": ceilings, "vllm": VLLM_VERSION if vllm else None,
              "columns": ["ours"] + (["vllm"] if vllm else []) + [c for c in columns if c in ("flashinfer", "other", *SUM_COLUMNS)],
              "results": [], "eager": [], "flashinfer_missing": {}, "untuned": args.untuned}
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    for series in series_list:
        shape = shapes[series]
        weights = make_weights(shape)
        ours_fns = layer_fn(shape, weights, None)
        theirs = VllmPipeline(vllm, shape, weights) if vllm else None
        fi = None
        if "flashinfer" in columns:
            try:
                fi = FlashInferColumn(shape, weights)
            except Exception as exc:  # the column is left out for this series, with the reason
                report["flashinfer_missing"][series] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"{series}: no FlashInfer column: {report['flashinfer_missing'][series]}", flush=True)
        for t in args.tokens:
            routes = routings(t, shape.num_experts, shape.top_k, replays_per_graph(t), seed=t)
            gen = torch.Generator(device="cuda").manual_seed(t + 1)
            xs = [torch.randn(t, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in routes]
            inputs = [(x, g, ids) for x, (g, ids) in zip(xs, routes)]
            hit = statistics.mean(int(torch.unique(ids).numel()) for _, ids in routes)
            n_bytes = hit * expert_bytes(shape) + 2 * t * shape.hidden * 2
            flops = 2 * t * shape.top_k * 3 * shape.intermediate * shape.hidden
            rate = ceilings["fp8_matmul_TFLOPs"] if shape.fp8 else ceilings["bf16_matmul_TFLOPs"]
            roofline_us = max(n_bytes / ceilings["copy_GBps"] / 1e3, flops / rate / 1e6)
            row = {"series": series, "E": shape.num_experts, "N": shape.intermediate, "K": shape.hidden, "top_k": shape.top_k,
                   "quant": shape.fp8 or "bf16", "tokens": t, "hit_experts": hit, "bytes": n_bytes, "flops": flops,
                   "roofline_us": roofline_us, "ours_config": ours_config(shape, t).to_json()}
            source = "-"
            ours_t = layer_fn(shape, weights, ours_config(shape, t)) if args.untuned else ours_fns
            a = ours_t(*inputs[0]).float()
            if theirs is not None:
                vcfg, source = theirs.config(t)
                row.update(vllm_config=vcfg, vllm_config_source=source)
                # correctness on the first input: both pipelines compute the same layer
                b = theirs(*inputs[0]).float()
                row["rel_diff"] = float((a - b).norm() / b.norm().clamp(min=1e-30))
            fns = [("vllm", theirs), ("ours", ours_t)] if theirs is not None else [("ours", ours_t)]
            if other_layout_timed(shape, t):
                row["ours_unsorted"] = pair_blocks_pay(t, shape.top_k, shape.num_experts, shape.expert_bytes)
                other = layer_fn(shape, weights, ours_config(shape, t), not row["ours_unsorted"])
                row["other_rel_diff"] = float((other(*inputs[0]).float() - a).norm() / a.norm().clamp(min=1e-30))
                fns.append(("other", other))
            for column in sum_columns(shape, t):
                forced = layer_fn(shape, weights, ours_config(shape, t) if args.untuned else None, None, SUM_COLUMNS[column])
                row[f"{column}_rel_diff"] = float((forced(*inputs[0]).float() - a).norm() / a.norm().clamp(min=1e-30))
                fns.append((column, forced))
            if fi is not None:
                try:
                    fi.calibrate(inputs[0][0])
                    fi.autotune(inputs)
                    c = fi(*inputs[0]).float()
                    row["fi_rel_diff"] = float((c - a).norm() / a.norm().clamp(min=1e-30))
                    fns.append(("fi", fi))
                except Exception as exc:
                    torch.cuda.synchronize()
                    row["fi_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rep = args.rep_ms or (100.0 if t <= 2048 else 60.0)
            rounds: dict[str, list[float]] = {name: [] for name, _ in fns}
            for turn in range(ROUNDS):
                for name, fn in fns if turn % 2 == 0 else fns[::-1]:
                    if f"{name}_error" in row:
                        continue
                    try:
                        rounds[name].append(time_graph(fn, inputs, rep))
                    except Exception as exc:
                        torch.cuda.synchronize()
                        row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            for name, times in rounds.items():
                if f"{name}_error" not in row:
                    row[f"{name}_us"] = statistics.median(times)
                    row[f"{name}_rounds_us"] = times
            if "ours_us" in row and "vllm_us" in row:
                row["speedup"] = row["vllm_us"] / row["ours_us"]
                row["ours_TFLOPs"] = flops / row["ours_us"] / 1e6
                row["ours_x_roofline"] = row["ours_us"] / roofline_us
            if "other_us" in row and "ours_us" in row:
                row["other_over_ours"] = row["other_us"] / row["ours_us"]
            for column in sum_columns(shape, t):
                if f"{column}_us" in row and "ours_us" in row:
                    row[f"{column}_over_ours"] = row[f"{column}_us"] / row["ours_us"]
            if "fi_us" in row and "ours_us" in row:
                row["fi_speedup_over_ours"] = row["ours_us"] / row["fi_us"]
                row["fi_TFLOPs"] = flops / row["fi_us"] / 1e6
            if "ours_us" in row and "ours_TFLOPs" not in row:
                row["ours_TFLOPs"] = flops / row["ours_us"] / 1e6
                row["ours_x_roofline"] = row["ours_us"] / roofline_us
            if t <= 32 and "ours_us" in row and not args.skip_floors:
                floor = read_floor(int(hit * expert_bytes(shape)), 2 * t * shape.hidden * 2, len(inputs))
                row.update(floor_one_kernel_us=floor["one_kernel_us"], floor_two_kernels_us=floor["two_kernels_us"],
                           ours_x_floor=row["ours_us"] / floor["two_kernels_us"])
            if t == 1:
                for name, fn in [f for f in fns if f[0] in ("vllm", "ours")]:
                    fn(*inputs[0])
                    torch.cuda.synchronize()
                    row[f"{name}_eager_us"] = float(triton.testing.do_bench(lambda: fn(*inputs[0]), warmup=20, rep=100, return_mode="median")) * 1e3
            report["results"].append(row)
            nan = float("nan")
            print(f"{series:28s} T={t:5d} vllm {row.get('vllm_us', nan):9.1f} ({source[:3]})  ours {row.get('ours_us', nan):9.1f}  "
                  f"x{row.get('speedup', nan):5.2f}  roof x{row.get('ours_x_roofline', nan):5.2f}  "
                  f"floor {row.get('floor_two_kernels_us', nan):7.1f} (x{row.get('ours_x_floor', nan):5.2f})  "
                  f"diff {row.get('rel_diff', nan):.1e}  flashinfer {row.get('fi_us', nan):9.1f} "
                  f"(ours/fi x{row.get('fi_speedup_over_ours', nan):5.2f}, diff {row.get('fi_rel_diff', nan):.1e})"
                  + (f"  {row['fi_error'][:120]}" if "fi_error" in row else "")
                  + (f"  {'unsorted' if row['ours_unsorted'] else 'sorted'}; other layout {row['other_us']:.1f} "
                     f"(other/ours x{row['other_over_ours']:.3f})" if "other_over_ours" in row else "")
                  + "".join(f"  {c} {row[f'{c}_us']:.1f} (x{row[f'{c}_over_ours']:.3f})"
                            for c in SUM_COLUMNS if f"{c}_over_ours" in row), flush=True)
            del xs, routes, inputs
        del weights, ours_fns, theirs, fi
        torch.cuda.empty_cache()
        write_report(out_dir, args.name, report)
    bf16 = [shape for shape in shapes.values() if shape.fp8 is None]
    report["engine_eager"] = engine_eager(bf16[0]) if bf16 else None
    write_report(out_dir, args.name, report)
    print(json.dumps(report["summary"], indent=1))
    print(f"done in {time.time() - start:.0f} s")


def parse_shape(spec: str):
    """``NAME=E,N,K,TOP_K[,QUANT]`` (QUANT: bf16, tensor, channel or block) -> (name, LayerShape)."""
    from moe_fsm.kernels.triton_moe.tuning import LayerShape

    name, _, sizes = spec.partition("=")
    fields = sizes.split(",")
    quant = fields[4] if len(fields) == 5 else "bf16"
    if not name or len(fields) not in (4, 5) or not all(f.isdigit() for f in fields[:4]) or quant not in (
            "bf16", "tensor", "channel", "block"):
        sys.exit(f"--shape {spec!r}: expected NAME=E,N,K,TOP_K[,QUANT] with QUANT bf16, tensor, channel or block")
    e, n, k, top_k = map(int, fields[:4])
    return name, LayerShape(e, n, k, top_k, "bfloat16", None if quant == "bf16" else quant)


def series_shapes(args) -> dict:
    """The series to run, name -> LayerShape: --series (named shapes), --shape specs and --sweep-shapes, in that
    order; the named shapes when none is given."""
    from moe_fsm.kernels.triton_moe.tuning import NAMED_SHAPES, LayerShape

    shapes = {name: NAMED_SHAPES[name] for name in args.series or []}
    shapes.update(parse_shape(spec) for spec in args.shape or [])
    if args.sweep_shapes:
        import sweep_default_rules

        for part in args.sweep_shapes:
            for name, e, n, k, top_k, fp8 in getattr(sweep_default_rules, part.upper()):
                shapes[name] = LayerShape(e, n, k, top_k, "bfloat16", fp8)
    shapes = shapes or dict(NAMED_SHAPES)
    if args.only:
        unknown = sorted(set(args.only) - set(shapes))
        if unknown:
            sys.exit(f"--only {' '.join(unknown)}: not among the chosen shapes ({', '.join(shapes)})")
        shapes = {name: shape for name, shape in shapes.items() if name in args.only}
    return shapes


def engine_eager(shape) -> dict:
    """Eager vs graph time of one layer call through the Decision-built modular kernel at 1 token."""
    import torch
    import triton.testing

    from moe_fsm.experts.triton_experts import TritonExperts
    from moe_fsm.inputs.layer import MoELayer
    from moe_fsm.inputs.quant import QuantScheme
    from moe_fsm.kernels.triton_moe.tuning import make_weights, routings, time_graph
    from moe_fsm.modular.kernel import ModularKernel
    from moe_fsm.prepare_finalize.local import LocalPrepareFinalize

    layer = MoELayer(quant=QuantScheme.unquantized(), num_experts=shape.num_experts, top_k=shape.top_k,
                     hidden_size=shape.hidden, intermediate_size=shape.intermediate, dtype="bfloat16")
    kernel = ModularKernel(LocalPrepareFinalize(), TritonExperts(layer), layer)
    w1, w2, _, _ = make_weights(shape)
    (g, ids), = routings(1, shape.num_experts, shape.top_k, 1, seed=5)
    x = torch.randn(1, shape.hidden, device="cuda", dtype=torch.bfloat16)
    fn = lambda x, g, ids: kernel(x, w1, w2, g, ids)  # noqa: E731
    fn(x, g, ids)
    torch.cuda.synchronize()
    eager = float(triton.testing.do_bench(lambda: fn(x, g, ids), warmup=20, rep=100, return_mode="median")) * 1e3
    graph = time_graph(fn, [(x, g, ids)], 50.0)
    return {"layer": "modular kernel (LocalPrepareFinalize + TritonExperts)", "tokens": 1, "eager_us": eager, "graph_us": graph,
            "host_us": eager - graph}


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summarize(report: dict) -> dict:
    rows = [r for r in report["results"] if "speedup" in r]
    losing = [f"{r['series']}/{r['tokens']}: x{r['speedup']:.2f}" for r in rows if r["speedup"] < 1.0]
    ours_rows = [r for r in report["results"] if "ours_TFLOPs" in r]
    prefill = {f"{r['series']}/{r['tokens']}": round(r["ours_TFLOPs"], 1) for r in ours_rows if r["tokens"] >= 2048}
    decode = {f"{r['series']}/{r['tokens']}": round(r["ours_x_roofline"], 3) for r in ours_rows if r["tokens"] <= 32}
    floors = {f"{r['series']}/{r['tokens']}": {"one_kernel_x_roofline": round(r["floor_one_kernel_us"] / r["roofline_us"], 3),
                                               "two_kernels_x_roofline": round(r["floor_two_kernels_us"] / r["roofline_us"], 3),
                                               "ours_x_two_kernels": round(r["ours_x_floor"], 3)}
              for r in ours_rows if "ours_x_floor" in r}
    eager = {r["series"]: {"ours_graph_us": round(r["ours_us"], 1), "ours_eager_us": round(r["ours_eager_us"], 1),
                           "ours_host_us": round(r["ours_eager_us"] - r["ours_us"], 1),
                           "vllm_host_us": round(r["vllm_eager_us"] - r["vllm_us"], 1)}
             for r in rows if "ours_eager_us" in r}
    fi_rows = [r for r in report["results"] if "fi_speedup_over_ours" in r]
    flashinfer = {
        "points": len(fi_rows),
        "faster_than_ours": [f"{r['series']}/{r['tokens']}: x{r['fi_speedup_over_ours']:.2f}" for r in fi_rows
                             if r["fi_speedup_over_ours"] > 1.0],
        "geomean_over_ours": round(geomean([r["fi_speedup_over_ours"] for r in fi_rows]), 3) if fi_rows else None,
        "max_rel_diff_vs_ours": max((r["fi_rel_diff"] for r in fi_rows), default=None),
        "prefill_TFLOPs": {f"{r['series']}/{r['tokens']}": round(r["fi_TFLOPs"], 1) for r in fi_rows if r["tokens"] >= 2048},
        "missing": report.get("flashinfer_missing", {}),
        "errors": {f"{r['series']}/{r['tokens']}": r["fi_error"] for r in report["results"] if "fi_error" in r},
    }
    layout_rows = [r for r in report["results"] if "other_over_ours" in r]
    other_layout = {
        "points": len(layout_rows),
        "geomean_other_over_ours": round(geomean([r["other_over_ours"] for r in layout_rows]), 3) if layout_rows else None,
        "rule_slower": [f"{r['series']}/{r['tokens']} ({'unsorted' if r['ours_unsorted'] else 'sorted'}): "
                        f"x{r['other_over_ours']:.3f}" for r in layout_rows if r["other_over_ours"] < 1.0],
        "max_rel_diff_vs_ours": max((r["other_rel_diff"] for r in layout_rows), default=None),
    }
    sums = {}
    for column in SUM_COLUMNS:
        timed = [r for r in report["results"] if f"{column}_over_ours" in r]
        if timed:
            sums[column] = {
                "points": len(timed),
                "geomean_over_ours": round(geomean([r[f"{column}_over_ours"] for r in timed]), 3),
                "over_ours": {f"{r['series']}/{r['tokens']}": round(r[f"{column}_over_ours"], 3) for r in timed},
                "max_rel_diff_vs_ours": max(r[f"{column}_rel_diff"] for r in timed),
            }
    return {
        "flashinfer": flashinfer,
        "other_layout": other_layout,
        "topk_sum": sums,
        "points": len(rows),
        "geomean_speedup": round(geomean([r["speedup"] for r in rows]), 3),
        "min_speedup": round(min((r["speedup"] for r in rows), default=float("nan")), 3),
        "points_losing": losing,
        "max_rel_diff": max((r["rel_diff"] for r in rows), default=float("nan")),
        "prefill_TFLOPs": prefill,
        "decode_x_roofline": decode,
        "decode_read_floors": floors,
        "eager_1_token": eager,
        "engine_eager_1_token": report.get("engine_eager"),
    }


def write_report(out_dir: Path, name: str, report: dict) -> None:
    report["summary"] = summarize(report)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    write_markdown(out_dir / f"{name}.md", report)
    try:
        write_plot(out_dir / f"{name}.png", report)
    except ImportError as exc:
        print(f"no plot: {exc}")


def _cfg(c: dict) -> str:
    if "w1" in c:
        def f(g: dict) -> str:
            flags = "".join(f"/{short}" for name, short in (("swap_ab", "swap"), ("persistent", "pers"),
                                                            ("warp_specialize", "ws"), ("paired", "paired"),
                                                            ("flatten", "flat")) if g.get(name))
            return f"{g['block_n']}x{g['block_k']}/g{g['group_m']}/w{g['num_warps']}s{g['num_stages']}{flags}"

        # the kernel family: Triton's pointer loads, its TMA kernel (hopper), or the Gluon block-FP8 kernel
        family = "".join(f" {name}" for name in ("hopper", "gather_input", "gluon", "fold_topk") if c.get(name))
        return f"M{c['block_m']} w1 {f(c['w1'])} w2 {f(c['w2'])}{family}"
    return f"M{c['BLOCK_SIZE_M']} N{c['BLOCK_SIZE_N']} K{c['BLOCK_SIZE_K']}/g{c['GROUP_SIZE_M']}/w{c.get('num_warps', 4)}s{c.get('num_stages', 3)}"


def write_markdown(path: Path, report: dict) -> None:
    m, c, s = report["machine"], report["ceilings"], report["summary"]
    has_vllm = report.get("vllm") is not None
    has_fi = "flashinfer" in report.get("columns", [])
    title = (f"# moe-fsm Triton MoE vs vLLM {report['vllm']} fused_moe_kernel" if has_vllm else "# moe-fsm Triton MoE")
    title += " and FlashInfer CUTLASS fused MoE, side by side" if has_fi else ", side by side"
    lines = [
        title,
        "",
        f"Machine: {m['gpu']} (sm_{m['capability'].replace('.', '')}, {m['sm_count']} SMs), torch {m['torch']}, Triton {m['triton']}, {m['date']}.",
        f"Ceilings in this run: copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s, FP8 matmul {c['fp8_matmul_TFLOPs']:.0f} TFLOP/s.",
        "",
        f"µs: median per layer call, CUDA-graph replays of R calls on R routings / R, L2 flushed per replay; the median of "
        f"{ROUNDS} rounds taking the columns in turn. "
        "All columns: same weights, routing and inputs (bench/bench_experts_vs_vllm.py docstring).",
    ]
    if report.get("untuned"):
        lines += ["", "**Untuned** (`--untuned`): both sides on their default rules, as for a shape no table holds: "
                  "moe-fsm's `default_config`, vLLM's `get_default_config`; neither side's tuned tables are read."]
    if has_vllm:
        lines += ["x = vLLM µs / ours (> 1: ours faster). vLLM cfg: `tuned` = vLLM's shipped table for this GPU, "
                  "`default` = get_default_config.", "",
                  f"**Geometric mean x{s['geomean_speedup']}** over {s['points']} points; slowest point x{s['min_speedup']}; "
                  f"points where vLLM is faster: {len(s['points_losing'])}"
                  f"{(' (' + ', '.join(s['points_losing']) + ')') if s['points_losing'] else ''}."]
    if has_fi:
        f = s["flashinfer"]
        lines += ["", "FlashInfer: moe-fsm's adapter (FlashInferCutlassExperts in a ModularKernel), autotuned per shape and "
                  "token count before timing; FP8 per-tensor with static activation scales calibrated on the first input. "
                  "FI x = ours µs / FlashInfer µs (> 1: FlashInfer faster); FI diff = relative difference from ours.", "",
                  f"**FlashInfer over moe-fsm's Triton: geometric mean x{f['geomean_over_ours']}** over {f['points']} points; "
                  f"faster at {len(f['faster_than_ours'])}"
                  f"{(' (' + ', '.join(f['faster_than_ours']) + ')') if f['faster_than_ours'] else ''}."]
        for series, why in f["missing"].items():
            lines.append(f"- {series}: no FlashInfer column: {why}")
    lines.append("")
    nan = float("nan")
    series = list(dict.fromkeys(r["series"] for r in report["results"]))
    for name in series:
        rows = [r for r in report["results"] if r["series"] == name]
        r0 = rows[0]
        head = ["tokens"] + (["vLLM µs", "vLLM cfg"] if has_vllm else []) + ["ours µs"] + (["x"] if has_vllm else [])
        head += ["ours / roofline", "ours TFLOP/s"] + (["rel diff"] if has_vllm else [])
        head += ["FlashInfer µs", "FI x", "FI TFLOP/s", "FI diff"] if has_fi else []
        head += ["ours config"] + (["vLLM config"] if has_vllm else [])
        lines += [f"## {name} (E={r0['E']}, N={r0['N']}, K={r0['K']}, top-{r0['top_k']}, {r0['quant']})", "",
                  "| " + " | ".join(head) + " |", "|" + "|".join(":--" if "config" in h or h == "vLLM cfg" else "---:" for h in head) + "|"]
        for r in rows:
            cells = [str(r["tokens"])]
            if has_vllm:
                cells += [f"{r.get('vllm_us', nan):.1f}", r.get("vllm_config_source", "-")]
            cells.append(f"{r.get('ours_us', nan):.1f}")
            if has_vllm:
                cells.append(f"{r.get('speedup', nan):.2f}")
            cells += [f"{r.get('ours_x_roofline', nan):.2f}", f"{r.get('ours_TFLOPs', nan):.0f}"]
            if has_vllm:
                cells.append(f"{r.get('rel_diff', nan):.1e}")
            if has_fi:
                if "fi_error" in r:
                    cells += ["error", "-", "-", r["fi_error"][:80].replace("|", "/")]
                else:
                    cells += [f"{r.get('fi_us', nan):.1f}", f"{r.get('fi_speedup_over_ours', nan):.2f}",
                              f"{r.get('fi_TFLOPs', nan):.0f}", f"{r.get('fi_rel_diff', nan):.1e}"]
            cells.append(_cfg(r["ours_config"]))
            if has_vllm:
                cells.append(_cfg(r["vllm_config"]) if "vllm_config" in r else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Headlines", "", f"- prefill TFLOP/s (ours): {s['prefill_TFLOPs']}", f"- decode, ours / memory roofline: {s['decode_x_roofline']}",
              f"- decode, read-only kernels over the same bytes (bench/bench_read_floor.py) / roofline, and ours / the two-kernel floor: "
              f"{s.get('decode_read_floors', {})}"]
    if has_fi:
        lines.append(f"- prefill TFLOP/s (FlashInfer): {s['flashinfer']['prefill_TFLOPs']}")
    if has_vllm:
        lines += [f"- eager at 1 token (fused_experts): {s['eager_1_token']}", f"- eager at 1 token (modular kernel): {s['engine_eager_1_token']}"]
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = list(dict.fromkeys(r["series"] for r in report["results"]))
    fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.8), squeeze=False)
    for ax, name in zip(axes[0], series):
        rows = [r for r in report["results"] if r["series"] == name and "speedup" in r]
        if rows:
            ax.plot([r["tokens"] for r in rows], [r["speedup"] for r in rows], "o-", label="vLLM µs / ours")
        fi_rows = [r for r in report["results"] if r["series"] == name and "fi_speedup_over_ours" in r]
        if fi_rows:
            ax.plot([r["tokens"] for r in fi_rows], [r["ours_us"] / r["fi_us"] for r in fi_rows], "s--",
                    label="ours µs / FlashInfer")
            ax.legend(fontsize=7)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_title(name, fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("time ratio (> 1: the other is slower)")
    m = report["machine"]
    title = f"moe-fsm Triton MoE, {m['gpu']}"
    if report.get("vllm"):
        title += f"; vs vLLM {report['vllm']} geomean x{report['summary']['geomean_speedup']}"
    if "flashinfer" in report.get("columns", []):
        title += f"; FlashInfer / ours geomean x{report['summary']['flashinfer']['geomean_over_ours']}"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare", help="extract vLLM's kernel and configs from the cached (or downloaded) wheel")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("VLLM_WHEEL_CACHE", "/work/cache/vllm")))
    p.add_argument("--extract", type=Path, default=DEFAULT_EXTRACT)
    r = sub.add_parser("run", help="run the side-by-side benchmark on this GPU")
    r.add_argument("--extract", type=Path, default=DEFAULT_EXTRACT)
    r.add_argument("--series", nargs="*", default=None, help="named shapes (tuning.NAMED_SHAPES)")
    r.add_argument("--shape", nargs="*", default=None, metavar="NAME=E,N,K,TOP_K[,QUANT]",
                   help="layer shapes of your own (QUANT: bf16, tensor, channel, block; default bf16)")
    r.add_argument("--sweep-shapes", nargs="+", choices=("fit", "held_out", "check"), default=None,
                   help="the FIT, HELD_OUT and/or CHECK shapes of bench/sweep_default_rules.py")
    r.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="of the shapes chosen, run these (one process per GPU, each with its share of the shapes)")
    r.add_argument("--rep-ms", type=float, default=None, help="do_bench's rep per timing (default 100, 60 at 8192 tokens)")
    r.add_argument("--tokens", nargs="*", type=int, default=[1, 8, 32, 128, 512, 2048, 8192])
    r.add_argument("--workers", type=int, default=12, help="processes compiling every kernel first (0: none)")
    r.add_argument("--out-dir", type=Path, default=ROOT / "bench-out")
    r.add_argument("--name", default=None)
    r.add_argument("--columns", default="ours,vllm,flashinfer",
                   help="which kernels to time beside moe-fsm's Triton (ours): vllm, flashinfer (default all three) and "
                        "other (ours with the row layout its rule did not pick); sum_apart and sum_in_w2 (ours with the "
                        "top-k sum forced to its own launch or into w2, where the rule picked the other; up to 8 tokens)")
    r.add_argument("--skip-floors", action="store_true",
                   help="no read floors at up to 32 tokens (bench_read_floor.py: 16 timings a point); a run before "
                        "on the same shapes and tokens read the same bytes")
    r.add_argument("--untuned", action="store_true",
                   help="both sides on their default rules (moe-fsm's default_config, vLLM's get_default_config), "
                        "no table of either: the case of a shape no table holds")
    args = parser.parse_args()
    if args.step == "prepare":
        prepare(args.cache, args.extract)
        return
    if args.name is None:
        import torch

        gpu = "h200" if "H200" in torch.cuda.get_device_name() else "h100"
        args.name = f"vs_vllm_{gpu}" if "vllm" in args.columns else f"flashinfer_vs_triton_{gpu}"
        args.name += "_untuned" if args.untuned else ""
    main_run(args)


if __name__ == "__main__":
    main()
