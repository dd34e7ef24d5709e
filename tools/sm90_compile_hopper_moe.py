"""Compile the Hopper TMA grouped GEMMs for sm_90a exactly as ``hopper.py`` launches them, without a GPU.

Needs Triton (its bundled ptxas and cuobjdump) and a CPU build of torch; no CUDA device. Each case (a layer
shape, an FP8 layout and a ``MoEConfig``) first goes through ``validate_config`` (a refusal is printed as
such), then runs the host side of the Hopper layer (``fused._hopper_layer``) on CPU tensors with two experts,
the kernels replaced by recorders: every launch it makes (gather, w1 GEMM, w2 GEMM) is bound by Triton's own
binder, so a launch whose arguments do not match the kernel's parameters fails here as it would on the GPU,
and then compiled for sm_90 with the same signature, constexprs, alignment attributes and options. Reported
per GEMM: registers, spills (stack bytes), shared memory (flagged past the H100's 227 KiB), warps after
warp specialization (Triton 3.6's Hopper pass turns a 4-warp loop into 12 warps: a producer and two consumer
warpgroups), whether the tensor-core instructions are wgmma, whether ptxas serializes them (its C751x notes), and
the copy-engine (TMA) and cp.async counts. The cases labelled ``gluon`` are the Gluon block-FP8 kernel
(``MoEConfig.gluon``, ``_gluon_kernels.py``), launched the same way.

    python tools/sm90_compile_hopper_moe.py [--quick | --ws-grid] [--only SUBSTR ...] [--force] [--list]

``--force`` compiles the cases ``validate_config`` refuses too (to see why they are refused); ``--ws-grid``
maps the warp-specialized tile shapes instead (what ``config._check_warp_specialization`` refuses).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from moe_fsm.errors import KernelInputError  # noqa: E402
from moe_fsm.kernels.triton_moe import _gluon_kernels, _hopper_kernels, fused, hopper  # noqa: E402
from moe_fsm.kernels.triton_moe.align import AlignedRouting, max_padded_rows  # noqa: E402
from moe_fsm.kernels.triton_moe.config import (  # noqa: E402
    FP8_GROUP, GemmConfig, MoEConfig, gluon_pair_config, validate_config,
)
from moe_fsm.kernels.triton_moe.fused import Fp8Spec  # noqa: E402
from moe_fsm.kernels.triton_moe.quant import FP8_DTYPE  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
H100_SMEM = 232448  # bytes of shared memory one block may opt into on sm_90
SM_COUNT = 132


@dataclass(frozen=True)
class Layer:
    name: str
    n: int
    k: int
    top_k: int
    fp8: Optional[str] = None  # None, "tensor", "channel", "block"
    static: bool = False  # FP8 tensor: static input and intermediate scales (the intermediate's OUT_MODE 1)
    activation: str = "silu"
    swiglu_limit: Optional[float] = None


QWEN = Layer("qwen3", 768, 2048, 8)
MIXTRAL = Layer("mixtral", 14336, 4096, 2)
MIXTRAL_FP8 = Layer("mixtral-fp8t", 14336, 4096, 2, "tensor")
MIXTRAL_FP8_STATIC = Layer("mixtral-fp8t-static", 14336, 4096, 2, "tensor", static=True)
QWEN_FP8 = Layer("qwen3-fp8c", 768, 2048, 8, "channel")
DSV3 = Layer("dsv3-fp8b", 2048, 7168, 8, "block")


def cfg(bm, w1, w2, *, pers=False, gather=False, paired=False, ws=False, fold=False, flat=False,
        gluon=False) -> MoEConfig:
    """w1/w2: (block_n, block_k, group_m, warps, stages)."""
    g1 = GemmConfig(*w1, persistent=pers, warp_specialize=ws, paired=paired, flatten=flat)
    g2 = GemmConfig(*w2, persistent=pers, warp_specialize=ws, flatten=flat)
    return MoEConfig(bm, g1, g2, fold, True, gather, gluon)


# the H100 table's 2048/8192-token tiles of each shape (as bench_hopper_prefill.py's "shipped+tma"), the sweep's tiles,
# and 4-warp tiles for warp specialization
BF16_SHIPPED = (128, (128, 64, 8, 8, 4), (256, 64, 8, 8, 4))
BF16_S3 = (128, (128, 64, 8, 8, 3), (256, 64, 8, 8, 3))
BF16_W4 = (64, (64, 64, 8, 4, 4), (128, 64, 8, 4, 4))
BF16_W4_BM128 = (128, (128, 64, 8, 4, 3), (128, 64, 8, 4, 3))
FP8_SHIPPED = (128, (128, 128, 16, 8, 4), (256, 128, 16, 8, 4))
FP8_W4 = (64, (64, 128, 8, 4, 4), (128, 128, 8, 4, 4))
BLOCK_SHIPPED = (64, (128, 128, 8, 8, 4), (256, 128, 8, 8, 4))
BLOCK_DEFAULT = (64, (64, 128, 32, 4, 3), (128, 128, 32, 4, 3))
BLOCK_SWEEP = [(64, (128, 128, 16, 8, 3), (256, 128, 16, 8, 3)), (64, (64, 128, 8, 4, 4), (128, 128, 8, 4, 4)),
               (64, (128, 128, 8, 8, 3), (128, 128, 8, 8, 3))]


def ws_grid() -> list[tuple[str, Layer, MoEConfig]]:
    """Every warp-specialized tile shape per dtype (4 warps, gathered input, persistent): plain, and with the
    two options the warp-specialized loop cannot take (w1 paired, w2 folding the top-k sum); the map behind
    ``config._check_warp_specialization``."""
    out = []
    for layer in (QWEN, MIXTRAL_FP8, QWEN_FP8, DSV3):
        bk = 128 if layer.fp8 else 64
        for bm in (64, 128, 256):
            for bn in (32, 64, 128, 256):
                for extra in (False, True):
                    config = cfg(bm, (bn, bk, 8, 4, 3), (bn, bk, 8, 4, 3), pers=True, gather=True, paired=extra,
                                 fold=extra, ws=True)
                    out.append((f"ws-grid {layer.name} bm{bm} bn{bn} {'paired+fold' if extra else 'plain'}", layer,
                                config))
    return out


def cases(quick: bool) -> list[tuple[str, Layer, MoEConfig]]:
    out = []

    def add(layer, tiles, label, **flags):
        bm, w1, w2 = tiles
        out.append((f"{layer.name} bm{bm} w1 {w1[0]}x{w1[1]} w{w1[3]}s{w1[4]} w2 {w2[0]} {label}", layer,
                    cfg(bm, w1, w2, **flags)))

    add(QWEN, BF16_SHIPPED, "plain")
    add(QWEN, BF16_SHIPPED, "pers+gather+paired", pers=True, gather=True, paired=True)
    add(DSV3, BLOCK_SHIPPED, "plain")
    add(DSV3, BLOCK_DEFAULT, "gather+ws", gather=True, ws=True)
    add(MIXTRAL_FP8, FP8_SHIPPED, "pers+fold", pers=True, fold=True)
    add(QWEN, BF16_W4, "ws (no gather)", ws=True)
    if quick:
        return out
    add(QWEN, BF16_SHIPPED, "pers", pers=True)
    add(QWEN, BF16_SHIPPED, "gather", gather=True)
    add(QWEN, BF16_SHIPPED, "paired", paired=True)
    add(QWEN, BF16_SHIPPED, "pers+fold", pers=True, fold=True)
    add(QWEN, BF16_S3, "pers+gather", pers=True, gather=True)
    add(QWEN, BF16_W4, "plain")
    add(QWEN, BF16_W4, "gather+ws", gather=True, ws=True)
    add(QWEN, BF16_W4, "pers+gather+ws", pers=True, gather=True, ws=True)
    add(QWEN, BF16_W4, "gather+paired+ws", gather=True, paired=True, ws=True)
    add(QWEN, BF16_W4_BM128, "gather+ws", gather=True, ws=True)
    add(QWEN, BF16_W4_BM128, "pers+gather+paired+ws (paired)", pers=True, gather=True, paired=True, ws=True)
    add(QWEN, BF16_W4_BM128, "pers+gather+ws+fold (fold)", pers=True, gather=True, ws=True, fold=True)
    add(QWEN, (64, (256, 64, 8, 4, 3), (128, 64, 8, 4, 3)), "gather+ws (bm64 bn256)", gather=True, ws=True)
    add(QWEN, BF16_SHIPPED, "gather+ws (8 warps)", gather=True, ws=True)
    # the persistent tile loop flattened into the K loop: shared memory grows (a flattened w2 with the folded
    # top-k sum is past the H100's, which validate_config refuses; --force compiles it)
    add(QWEN, BF16_SHIPPED, "pers+flat+paired", pers=True, flat=True, paired=True)
    add(QWEN, BF16_S3, "pers+flat+gather", pers=True, flat=True, gather=True)
    add(QWEN, BF16_S3, "pers+flat+gather+fold (fold)", pers=True, flat=True, gather=True, fold=True)
    add(MIXTRAL, BF16_SHIPPED, "pers+flat+gather+paired", pers=True, flat=True, gather=True, paired=True)
    add(DSV3, BLOCK_SWEEP[0], "pers+flat+paired", pers=True, flat=True, paired=True)
    add(MIXTRAL, BF16_SHIPPED, "pers", pers=True)
    add(MIXTRAL, BF16_SHIPPED, "pers+gather+paired", pers=True, gather=True, paired=True)
    add(MIXTRAL, BF16_W4, "pers+gather+ws", pers=True, gather=True, ws=True)
    add(MIXTRAL_FP8, FP8_SHIPPED, "pers+gather+paired+fold", pers=True, gather=True, paired=True, fold=True)
    add(MIXTRAL_FP8_STATIC, FP8_SHIPPED, "pers+gather", pers=True, gather=True)
    add(MIXTRAL_FP8, FP8_W4, "gather+ws", gather=True, ws=True)
    add(QWEN_FP8, FP8_SHIPPED, "pers", pers=True)
    add(QWEN_FP8, FP8_SHIPPED, "gather+paired", gather=True, paired=True)
    add(QWEN_FP8, FP8_W4, "gather+ws", gather=True, ws=True)
    add(DSV3, BLOCK_SHIPPED, "pers", pers=True)
    add(DSV3, BLOCK_SHIPPED, "gather", gather=True)
    add(DSV3, BLOCK_SHIPPED, "paired", paired=True)
    add(DSV3, BLOCK_SHIPPED, "pers+gather+paired", pers=True, gather=True, paired=True)
    add(DSV3, BLOCK_DEFAULT, "plain")
    add(DSV3, BLOCK_DEFAULT, "pers+gather+ws", pers=True, gather=True, ws=True)
    add(DSV3, BLOCK_DEFAULT, "ws (no gather)", ws=True)
    add(DSV3, (128, (128, 128, 8, 4, 3), (128, 128, 8, 4, 3)), "gather+ws (group quant by rows)", gather=True, ws=True)
    add(DSV3, (64, (128, 128, 8, 4, 3), (128, 128, 8, 4, 3)), "pers+gather+ws", pers=True, gather=True, ws=True)
    for tiles in BLOCK_SWEEP:
        add(DSV3, tiles, "pers", pers=True)
    out += gluon_cases()
    return out


def gluon_cases() -> list[tuple[str, Layer, MoEConfig]]:
    """The Gluon block-FP8 kernel (``MoEConfig.gluon``): the tuner's tiles, the one-role program, and the
    widths and depths ``validate_config`` refuses (a 256-wide wgmma spills and is serialized; 7 stages of 128
    rows are past the shared memory)."""
    out = []
    for bm, warps, w1, w2, stages, ws, pers, note in [
        (128, 8, 64, 128, 4, True, True, ""), (128, 8, 64, 128, 5, True, False, ""), (64, 4, 64, 128, 4, True, True, ""),
        (64, 4, 64, 128, 4, False, False, ""), (128, 8, 32, 64, 6, True, True, ""),
        (64, 4, 128, 256, 3, False, False, " (256-wide wgmma)"), (128, 8, 64, 128, 6, True, True, ""),
        (128, 8, 64, 128, 7, True, True, " (smem)"),
    ]:
        flags = "+ws" * ws + "+pers" * pers
        out.append((f"{DSV3.name} bm{bm} w1 {w1} w{warps}s{stages} w2 {w2} gluon{flags}{note}", DSV3,
                    cfg(bm, (w1, 128, 8, warps, stages), (w2, 128, 8, warps, stages), pers=pers, gather=True, ws=ws,
                        gluon=True)))
    out.append((f"{DSV3.name} bm64 w1 128 w8s5 w2 256 w8s4 gluon+ws+pers (two warpgroups side by side)", DSV3,
                gluon_pair_config()))
    return out


class _Recorder:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kwargs)`` is recorded, not run."""

    def __init__(self, fn, calls: list):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, grid, args, kwargs))


@contextlib.contextmanager
def recording(calls: list):
    saved = {
        (_hopper_kernels, "moe_gemm_tma_kernel"): _hopper_kernels.moe_gemm_tma_kernel,
        (_hopper_kernels, "gather_rows_kernel"): _hopper_kernels.gather_rows_kernel,
        (_hopper_kernels, "pair_slots_kernel"): _hopper_kernels.pair_slots_kernel,
        (_hopper_kernels, "quantize_real_rows_kernel"): _hopper_kernels.quantize_real_rows_kernel,
        (hopper, "_sm_count"): hopper._sm_count,
        (fused, "quantize_activation"): fused.quantize_activation,
        (fused, "topk_sum"): fused.topk_sum,
        (_gluon_kernels, "moe_block_fp8_gemm_kernel"): _gluon_kernels.moe_block_fp8_gemm_kernel,
        (fused, "gluon_usable"): fused.gluon_usable,
        (fused, "expert_runs"): fused.expert_runs,
    }

    def fake_quantize(x, granularity, static=None):
        scale_shape = {"group": (*x.shape[:-1], -(-x.shape[-1] // FP8_GROUP)), "token": (*x.shape[:-1], 1)}
        return torch.empty(x.shape, dtype=FP8_DTYPE), torch.empty(scale_shape.get(granularity, (1,)))

    _hopper_kernels.moe_gemm_tma_kernel = _Recorder(saved[(_hopper_kernels, "moe_gemm_tma_kernel")], calls)
    _hopper_kernels.gather_rows_kernel = _Recorder(saved[(_hopper_kernels, "gather_rows_kernel")], calls)
    _hopper_kernels.pair_slots_kernel = _Recorder(saved[(_hopper_kernels, "pair_slots_kernel")], calls)
    _hopper_kernels.quantize_real_rows_kernel = _Recorder(saved[(_hopper_kernels, "quantize_real_rows_kernel")],
                                                          calls)
    hopper._sm_count = lambda index: SM_COUNT
    fused.quantize_activation = fake_quantize
    fused.topk_sum = lambda y, ids, num_experts, out, row_of_pair=None: out
    _gluon_kernels.moe_block_fp8_gemm_kernel = _Recorder(saved[(_gluon_kernels, "moe_block_fp8_gemm_kernel")], calls)
    # on a CPU tensor the Gluon path is never usable: take it wherever the config asks for it
    fused.gluon_usable = lambda config, *args, **kwargs: config.gluon
    fused.expert_runs = lambda routing: (routing.block_expert, routing.block_expert)
    try:
        yield
    finally:
        for (mod, name), value in saved.items():
            setattr(mod, name, value)


def host_launches(layer: Layer, config: MoEConfig, num_tokens: int = 256) -> list:
    """Every kernel launch the Hopper layer makes for this layer and config, recorded on CPU tensors."""
    e, n, k, top_k = 2, layer.n, layer.k, layer.top_k
    wdt = FP8_DTYPE if layer.fp8 else torch.bfloat16
    w1, w2 = torch.empty(e, 2 * n, k, dtype=wdt), torch.empty(e, k, n, dtype=wdt)
    spec = {None: None, "tensor": Fp8Spec("tensor", "tensor"), "channel": Fp8Spec("channel", "token"),
            "block": Fp8Spec("block", "group")}[layer.fp8]
    s1 = s2 = a_scale = a2 = None
    a = torch.empty(num_tokens, k, dtype=wdt)
    if layer.fp8 == "tensor":
        s1, s2, a_scale = torch.ones(e), torch.ones(e), torch.ones(1)
        a2 = torch.ones(1) if layer.static else None
    elif layer.fp8 == "channel":
        s1, s2, a_scale = torch.ones(e, 2 * n), torch.ones(e, k), torch.ones(num_tokens, 1)
    elif layer.fp8 == "block":
        s1 = torch.ones(e, -(-2 * n // FP8_GROUP), -(-k // FP8_GROUP))
        s2 = torch.ones(e, -(-k // FP8_GROUP), -(-n // FP8_GROUP))
        a_scale = torch.ones(num_tokens, -(-k // FP8_GROUP))
    pairs = num_tokens * top_k
    rows = max(max_padded_rows(pairs, e, config.block_m), config.block_m)
    blocks = -(-rows // config.block_m)
    routing = AlignedRouting(
        torch.zeros(blocks * config.block_m, dtype=torch.int32), torch.zeros(blocks, dtype=torch.int32),
        torch.full((1,), blocks * config.block_m, dtype=torch.int32), config.block_m, pairs, top_k,
    )
    ids = torch.zeros(num_tokens, top_k, dtype=torch.int32)
    out = torch.empty(num_tokens, k, dtype=torch.bfloat16)
    calls: list = []
    with recording(calls):
        fused._hopper_layer(
            a, a_scale, w1, w2, s1, s2, a2, routing, torch.ones(pairs), ids, out, spec=spec,
            activation=layer.activation, swiglu_limit=layer.swiglu_limit, apply_router_weight_on_input=False,
            config=config, result_dtype=torch.bfloat16,
        )
    return calls


_BACKEND = None


def compile_launch(fn, args, kwargs):
    """Bind a recorded launch as Triton's JIT does, then compile that specialization for sm_90."""
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, _BACKEND)
    kwargs = dict(kwargs, debug=False)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(_BACKEND, kwargs, bound, specialization, options)
    source = GluonASTSource if fn.is_gluon() else ASTSource
    return triton.compile(source(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def resources(kernel) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        res = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        # ptxas says when it serializes the wgmmas (C7510-C7515: registers, or an accumulator read in flight)
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        log = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "again.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    ptx = kernel.asm["ptx"]
    return {"regs": int(regs.group(1)) if regs else None, "stack": int(stack.group(1)) if stack else None,
            "smem": kernel.metadata.shared, "warps": kernel.metadata.num_warps, "wgmma": "wgmma.mma_async" in ptx,
            "tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)), "cp_async": len(re.findall(r"cp\.async\.cg", ptx)),
            "serialized": "wgmma.mma_async instructions are serialized" in log}


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[-1] if text else type(exc).__name__)[:220]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="six cases: one per dtype plus the refused ones")
    ap.add_argument("--only", nargs="*", default=[], help="cases whose label contains every one of these strings")
    ap.add_argument("--force", action="store_true", help="compile what validate_config refuses as well")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--ws-grid", action="store_true",
                    help="instead: every warp-specialized tile shape per dtype (96 cases; with --force, 192 compiles)")
    args = ap.parse_args()
    selected = [c for c in (ws_grid() if args.ws_grid else cases(args.quick)) if all(s in c[0] for s in args.only)]
    if args.list:
        for label, _, config in selected:
            print(label, config.to_json())
        return
    failures = refused = flagged = 0
    for label, layer, config in selected:
        try:
            validate_config(config, block_fp8=layer.fp8 == "block")
        except KernelInputError as exc:
            refused += 1
            print(f"{label:62s} refused: {exc}", flush=True)
            if not args.force:
                continue
        try:
            launches = host_launches(layer, config)
        except Exception as exc:  # the host side itself failed: that is the report
            failures += 1
            print(f"{label:62s} HOST FAILED: {type(exc).__name__}: {_last_line(exc)}", flush=True)
            continue
        gemms = [c for c in launches if c[0].__name__ in ("moe_gemm_tma_kernel", "moe_block_fp8_gemm_kernel")]
        for fn, grid, a, kw in launches:
            gemm = fn.__name__ in ("moe_gemm_tma_kernel", "moe_block_fp8_gemm_kernel")
            part = ("w1" if kw.get("GATED") else "w2") if gemm else fn.__name__.removesuffix("_kernel")[:6]
            t0 = time.time()
            try:
                kernel = compile_launch(fn, a, kw)
            except Exception as exc:  # a compile failure is the report
                failures += 1
                print(f"{label:62s} {part:6s} FAILED: {_last_line(exc)}", flush=True)
                continue
            if not gemm:  # the gather, the pair-to-slot inverse, the quantizer: compiled, nothing to report
                continue
            r = resources(kernel)
            flags = [f for f, bad in (("SPILL", (r["stack"] or 0) > 0), ("SMEM>227K", r["smem"] > H100_SMEM),
                                      ("NO-WGMMA", not r["wgmma"]), ("NO-TMA", r["tma"] == 0),
                                      ("WGMMA-SERIALIZED", r["serialized"])) if bad]
            flagged += bool(flags)
            print(f"{label:62s} {part:6s} regs={r['regs']} stack={r['stack']} smem={r['smem']} warps={r['warps']} "
                  f"wgmma={r['wgmma']} tma={r['tma']} cp.async={r['cp_async']} grid={grid[0]} "
                  f"({time.time() - t0:.1f}s){' ' + ' '.join(flags) if flags else ''}", flush=True)
        if len(gemms) != 2:
            failures += 1
            print(f"{label:62s} expected two GEMM launches, got {len(gemms)}", flush=True)
    print(f"{len(selected)} cases: {failures} failed, {refused} refused by validate_config, {flagged} GEMMs flagged")


if __name__ == "__main__":
    main()
