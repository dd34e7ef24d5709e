"""Compile the Hopper TMA grouped GEMM's variants for sm_90a without a GPU and print the resource report.

Needs only Triton (its bundled ptxas and cuobjdump): no CUDA device, no torch. For each variant (w1 or w2,
bf16 / FP8 tensor / FP8 128-block, tile, persistent, warp-specialized) it compiles ``moe_gemm_tma_kernel`` as
``hopper.py`` launches it and reports registers, spills (stack bytes), shared memory, and whether the
tensor-core instructions are warpgroup ones (wgmma) fed by the copy engine (cp.async.bulk.tensor).

    python bench/hopper_compile_check.py [--quick]

Compile errors, spills and a missing wgmma or TMA show here in seconds, before a GPU call.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "src" / "moe_fsm" / "kernels" / "triton_moe" / "_hopper_kernels.py"
TARGET = GPUTarget("cuda", 90, 32)
PTR_ARGS = ("a_ptr", "a_scale_ptr", "w_scale_ptr", "out_ptr", "out_scale_ptr", "out_static_scale_ptr",
            "row_weight_ptr", "sorted_ids_ptr", "block_expert_ptr", "num_padded_ptr")


def _load():
    spec = importlib.util.spec_from_file_location("hopper_kernels_standalone", KERNELS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def variant(gated: bool, dtype: str, block_m: int, block_n: int, block_k: int, warps: int, stages: int,
            persistent: bool, ws: bool, n: int = 768, k: int = 2048):
    """(signature, constexprs, options) of one launch as ``hopper._launch`` makes it."""
    fp8 = dtype != "bf16"
    el = "fp8e4nv" if fp8 else "bf16"
    out_el = ("fp8e4nv" if dtype == "block" else "bf16") if gated else ("fp32" if False else "bf16")
    sig = {"a_ptr": f"*{el}", "a_desc": f"tensordesc<{el}[{block_m}, {block_k}]>", "a_scale_ptr": "*fp32",
           "w_desc": f"tensordesc<{el}[{block_n}, {block_k}]>", "w_scale_ptr": "*fp32", "out_ptr": f"*{out_el}",
           "out_desc": f"tensordesc<{out_el}[{block_m}, {block_n}]>", "out_scale_ptr": "*fp32",
           "out_static_scale_ptr": "*fp32", "row_weight_ptr": "*fp32", "sorted_ids_ptr": "*i32",
           "block_expert_ptr": "*i32", "num_padded_ptr": "*i32"}
    if not gated:
        sig["a_desc"] = f"tensordesc<{el}[{block_m}, {block_k}]>"
        sig["out_desc"] = sig["w_desc"]
    else:
        sig["a_desc"] = sig["w_desc"]
    ints = ("N", "K", "w_rows_per_expert", "num_valid_rows", "num_experts", "stride_am", "stride_om", "stride_asm",
            "stride_ask", "stride_wse", "stride_wsn", "stride_wsk", "stride_osm", "stride_osn")
    for a in ints:
        sig[a] = "i32"
    sig["swiglu_limit"] = "fp32"
    a_mode, w_mode = {"bf16": (0, 0), "tensor": (1, 1), "block": (3, 3)}[dtype]
    out_mode = (2 if dtype == "block" else (1 if dtype == "tensor" else 0)) if gated else 0
    const = dict(A_ROW_DIV=8 if gated else 1, A_SORTED=not gated, OUT_ROW_DIV=1, GATED=gated, PAIRED=False, ACTIVATION=0,
                 HAS_LIMIT=False, WEIGHT_ROWS=not gated, A_SCALE=a_mode, W_SCALE=w_mode, OUT_MODE=out_mode,
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, PERSISTENT=persistent,
                 NUM_PROGRAMS=132, WARP_SPECIALIZE=ws)
    for c in const:
        sig[c] = "constexpr"
    divisible = ["N", "K", "w_rows_per_expert", "stride_am", "stride_om"]
    return sig, const, {"num_warps": warps, "num_stages": stages}, divisible


def compile_one(mod, sig, const, options, divisible):
    fn = mod.moe_gemm_tma_kernel
    names = fn.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in PTR_ARGS + tuple(divisible)}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET, options=options)


def resources(kernel) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        res = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    ptx = kernel.asm["ptx"]
    return {"regs": int(regs.group(1)) if regs else None, "stack": int(stack.group(1)) if stack else None,
            "shared": kernel.metadata.shared, "wgmma": "wgmma.mma_async" in ptx,
            "tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)), "cp_async": len(re.findall(r"cp\.async\.cg", ptx))}


def matrix(quick: bool):
    tiles = {"bf16": [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4)],
             "tensor": [(128, 128, 128, 8, 4), (128, 256, 128, 8, 3)],
             "block": [(64, 128, 128, 4, 4), (128, 128, 128, 8, 3), (64, 128, 128, 8, 4)]}
    out = []
    for dtype, ts in tiles.items():
        for tile in ts[:1] if quick else ts:
            for gated in (True, False):
                bn = tile[1] // 2 if gated and tile[1] == 256 else tile[1]
                for persistent, ws in ((False, False), (True, False), (True, True)):
                    out.append((gated, dtype, tile[0], bn, tile[2], tile[3], tile[4], persistent, ws))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    mod = _load()
    failures = 0
    for v in matrix(args.quick):
        gated, dtype, bm, bn, bk, warps, stages, persistent, ws = v
        name = f"{'w1' if gated else 'w2'} {dtype:6s} {bm}x{bn}x{bk} w{warps}s{stages}{' pers' if persistent else ''}{' ws' if ws else ''}"
        t0 = time.time()
        try:
            kernel = compile_one(mod, *variant(*v))
        except Exception as exc:  # a compile failure is the report
            failures += 1
            print(f"{name:40s} FAILED: {str(exc).splitlines()[-1][:200] if str(exc) else type(exc).__name__}")
            continue
        r = resources(kernel)
        print(f"{name:40s} regs={r['regs']} stack={r['stack']} smem={r['shared']} wgmma={r['wgmma']} "
              f"tma={r['tma']} cp.async={r['cp_async']} ({time.time() - t0:.1f}s)")
    print(f"{failures} failed")


if __name__ == "__main__":
    main()
