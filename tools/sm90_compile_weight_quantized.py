"""Compile the weight-quantized MoE kernel's variants for sm_90 without a GPU and print the resource report.

Needs only Triton (its bundled ptxas and cuobjdump): no CUDA device, no torch. For each variant
(weight kind, nibble layout, inline-PTX dequant, gated or not, one token or sorted blocks, tile) it
compiles ``wq_gemm_kernel`` exactly as ``fused_wq_experts`` launches it and reports registers,
spills, shared memory and whether the tensor-core instructions are warpgroup ones (wgmma on sm_90a).

    python tools/sm90_compile_weight_quantized.py [--quick] [--only TEXT] [--dump DIR] [--loop]

Compile errors, spills and a missing wgmma show here in seconds, before a GPU call. ``--loop`` adds the
K loop's cost from the SASS: instructions one warp issues per loop iteration, and thread-instructions per
weight byte (all warps' instructions over the weight bytes one iteration reads), the dequantization's
budget at decode, where the weights stream.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "src" / "moe_fsm" / "kernels" / "triton_wq" / "_kernels.py"
TARGET = GPUTarget("cuda", 90, 32)


def _load():
    spec = importlib.util.spec_from_file_location("wq_kernels_standalone", KERNELS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PTR_ARGS = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "b_ptr", "rw_ptr", "out_ptr", "sorted_ids_ptr", "block_expert_ptr",
            "num_padded_ptr", "perm_ptr", "gs_ptr")
INT_ARGS = ("R_OUT", "KRED", "num_pairs", "num_experts", "num_row_blocks", "x_row_div")
STRIDES = ("stride_xm", "stride_we", "stride_wr", "stride_se", "stride_sr", "stride_ze", "stride_zr", "stride_be",
           "stride_om", "stride_pe", "k_tiles_per_split", "stride_os")


def variant(kind: str, gated: bool, pair_blocks: bool, split: bool, fast: bool, block_m: int, block_n: int,
            block_k: int, warps: int, stages: int, k: int = 2880, n: int = 2880, group: int | None = None,
            zp: bool = False, bias: bool | None = None, scaled_dot: bool = False, perm: bool = False,
            split_k: bool = False, chain_acc: bool = False):
    """(signature, constexprs, attrs, options) of one launch of ``fused_wq_experts``."""
    kinds = {"mxfp4": 0, "int4": 1, "int8": 2, "nvfp4": 3}
    group = 32 if kind == "mxfp4" else (group or 128)
    bias = (kind == "mxfp4") if bias is None else bias
    kred = k if gated else n
    r_out = n if gated else k
    sdt = "*u8" if kind in ("mxfp4", "nvfp4") else "*fp16"
    types = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": sdt, "z_ptr": "*u8" if zp else sdt,
             "b_ptr": "*bf16" if bias else sdt, "rw_ptr": "*fp32", "out_ptr": "*fp32" if split_k else "*bf16", "sorted_ids_ptr": "*i32",
             "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "perm_ptr": "*i32", "gs_ptr": "*fp32"}
    sig = dict(types)
    p = 1 if kind == "int8" else 2
    rows, cols = (2 * n, k) if gated else (k, n)
    sg = cols if group == -1 else group
    top_k = 4
    values = {"R_OUT": r_out, "KRED": kred, "num_pairs": 3, "num_experts": 32, "num_row_blocks": 7,
              "x_row_div": top_k if gated else 1,
              "stride_xm": kred, "stride_we": rows * cols // p, "stride_wr": cols // p,
              "stride_se": rows * cols // sg, "stride_sr": cols // sg,
              "stride_ze": rows * cols // sg, "stride_zr": cols // sg,
              "stride_be": rows if bias else rows * cols // sg, "stride_om": (2 if gated and split_k else 1) * r_out,
              "stride_pe": kred, "k_tiles_per_split": 7, "stride_os": 3 * (2 if gated else 1) * r_out}
    for a in INT_ARGS + STRIDES:
        sig[a] = "i32"
    sig["limit"] = "fp32"
    scale_acc = kind in ("int4", "int8") and (group == kred or group % block_k == 0)
    const = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=1, GROUP=group, KIND=kinds[kind],
                 HAS_ZP=zp, ZERO=8 if kind == "int4" else 128, HAS_BIAS=bias, GATED=gated,
                 ACT=2 if kind == "mxfp4" else 0, HAS_LIMIT=kind == "mxfp4", INTERLEAVED=False,
                 ROUTER_WEIGHT=not gated, PAIR_BLOCKS=pair_blocks, SPLIT=split, FAST=fast and kind != "int8",
                 EVEN_K=kred % block_k == 0, SCALE_ACC=scale_acc, SCALED_DOT=scaled_dot, HAS_PERM=perm,
                 SPLIT_K=split_k, CHAIN_ACC=chain_acc)
    for c in const:
        sig[c] = "constexpr"
    # the JIT's specialization: ints equal to 1 become constants, multiples of 16 carry divisibility 16
    unspecialized = ("num_pairs", "num_experts", "num_row_blocks", "k_tiles_per_split", "stride_os")  # do_not_specialize
    const_ints = {a: 1 for a, v in values.items() if v == 1 and a not in unspecialized}
    for a in const_ints:
        sig[a] = "constexpr"
    const.update(const_ints)
    divisible = [a for a, v in values.items() if v != 1 and v % 16 == 0 and a not in unspecialized]
    return sig, const, {"num_warps": warps, "num_stages": stages}, divisible


def compile_one(mod, sig, const, options, divisible):
    fn = mod.wq_gemm_kernel
    names = fn.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in PTR_ARGS + tuple(divisible)}
    src = ASTSource(fn, sig, const, attrs)
    return triton.compile(src, target=TARGET, options=options)


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
            "mma": len(re.findall(r"\bmma\.sync", ptx)), "prmt": "prmt.b32" in ptx,
            # the dequantized bf16 tile stored to shared memory for the dot's operand layout (0: kept in registers)
            "bf16_to_smem": len(re.findall(r"local_alloc %\S+ : \(tensor<\d+x\d+xbf16", kernel.asm["ttgir"])),
            "ld128": len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx)),
            "ld_u8": len(re.findall(r"ld\.global(?:\.\w+)*\.(?:u8|b8)\b", ptx))}


def sass(kernel) -> str:
    """The kernel's SASS as ``cuobjdump -sass`` prints it."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True).stdout


def loop_cost(kernel, v) -> tuple[int, float, int, int]:
    """(SASS instructions per warp in the K loop's body, thread-instructions per weight byte, wgmma waits and
    wgmma instructions in it): the loop is the longest span closed by a backward branch; one iteration reads
    BLOCK_N x BLOCK_K weights (twice gated). A wait per wgmma (``WARPGROUP.DEPBAR`` as many as ``HGMMA``) is ptxas
    serializing them (its C7515 note), one per dot is the pipelined form."""
    seq = [line for line in sass(kernel).splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", line).group(1), 16) for line in seq]
    body, first = 0, 0
    for i, line in enumerate(seq):
        target = re.search(r"BRA 0x([0-9a-f]+)", line)
        if target and int(target.group(1), 16) < addr[i] and int(target.group(1), 16) in addr:
            start = addr.index(int(target.group(1), 16))
            if i - start + 1 > body:
                body, first = i - start + 1, start
    loop = seq[first:first + body]
    waits = sum("WARPGROUP.DEPBAR" in line for line in loop)
    wgmmas = sum("HGMMA" in line for line in loop)
    weight_bytes = (2 if v["gated"] else 1) * v["block_n"] * v["block_k"] // (1 if v["kind"] == "int8" else 2)
    return body, body * 32 * v["warps"] / weight_bytes, waits, wgmmas


def prefill_matrix():
    """MXFP4 (gpt-oss) w1 and w2 at the many-pair tiles, each K tile's dots into a fresh product or chained onto the
    running sums (``chain_acc``)."""
    out = []
    # MXFP4's default tiles from 33 pairs an expert (fused.MXFP4_MID_TILE, MXFP4_MANY_PAIR_TILE) among them
    for block_m, block_n, block_k, warps, stages in ((128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 64, 8, 3),
                                                     (128, 64, 64, 4, 3), (64, 64, 128, 4, 3)):
        for chain in (False, True):
            for gated in (True, False):
                out.append(dict(kind="mxfp4", gated=gated, pair_blocks=False, split=True, fast=True, scaled=False,
                                block_m=block_m, block_n=block_n, block_k=block_k, warps=warps, stages=stages, k=2880,
                                n=2880, group=32, zp=False, perm=False, split_k=False, chain_acc=chain))
    return out


def matrix(quick: bool):
    out = []
    for kind, k, n, group, zp, perm in (("mxfp4", 2880, 2880, 32, False, False), ("int4", 2048, 768, 128, False, False),
                                        ("int4", 2048, 768, 32, True, False), ("int4", 2048, 768, 128, True, False),
                                        ("int8", 2048, 768, 64, True, False),
                                        ("int4", 2048, 768, 128, False, True), ("nvfp4", 2048, 768, 16, False, False),
                                        ("int4", 7168, 2048, 32, False, False), ("int4", 2048, 768, 64, False, False)):
        tiles = [(16, 64, 128, 4, 4), (16, 64, 64, 4, 4), (64, 64, 128, 4, 3), (64, 128, 64, 8, 3)] if quick else [
            (16, 64, 128, 4, 4), (16, 64, 64, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 3), (64, 64, 128, 4, 3),
            (64, 128, 128, 8, 3), (128, 128, 64, 8, 3)]
        layouts = [(True, True, False)] if kind == "int8" else (
            [(True, True, False), (False, False, False)] if quick else
            [(True, True, False), (True, False, False), (False, True, False), (False, False, False)])
        if kind == "mxfp4":
            layouts.append((False, True, True))
        for split, fast, scaled in layouts:
            if kind == "int8":
                split = False
            for tile in tiles:
                for gated in (True, False):
                    for pair in ((True, False) if tile[0] == 16 else (False,)):
                        for split_k in ((False, True) if tile[0] == 16 else (False,)):  # split-K: decode tiles
                            out.append(dict(kind=kind, gated=gated, pair_blocks=pair, split=split, fast=fast,
                                            scaled=scaled, block_m=tile[0], block_n=tile[1], block_k=tile[2],
                                            warps=tile[3], stages=tile[4], k=k, n=n, group=group, zp=zp, perm=perm,
                                            split_k=split_k))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", help="substring of the variant name")
    ap.add_argument("--dump", help="directory to write ptx/ttgir/sass of each variant (diff two dumps to check that "
                                   "a change leaves the compiled code as it was)")
    ap.add_argument("--loop", action="store_true", help="the K loop's SASS instructions per weight byte")
    ap.add_argument("--prefill", action="store_true",
                    help="only MXFP4 at the many-pair tiles, with and without chain_acc")
    args = ap.parse_args()
    mod = _load()
    failures = 0
    for v in (prefill_matrix() if args.prefill else matrix(args.quick)):
        flags = " chain_acc" if v.get("chain_acc") else ""
        name = "{kind} g{group}{z}{a} {g} {p} split={split} fast={fast} scaled_dot={scaled} split_k={split_k} m{block_m} n{block_n} k{block_k} w{warps} s{stages}{flags}".format(
            g="w1" if v["gated"] else "w2", p="pair" if v["pair_blocks"] else "sorted", z=" zp" if v["zp"] else "", a=" act-order" if v["perm"] else "", flags=flags, **v)
        if args.only and args.only not in name:
            continue
        sig, const, options, divisible = variant(v["kind"], v["gated"], v["pair_blocks"], v["split"], v["fast"], v["block_m"],
                                            v["block_n"], v["block_k"], v["warps"], v["stages"], v["k"], v["n"],
                                            v["group"], v["zp"], scaled_dot=v["scaled"], perm=v["perm"],
                                            split_k=v["split_k"], chain_acc=v.get("chain_acc", False))
        try:
            kernel = compile_one(mod, sig, const, options, divisible)
        except Exception as exc:  # report and go on: every variant's verdict in one pass
            failures += 1
            msg = str(exc).strip().splitlines()
            print(f"FAIL {name}: {type(exc).__name__}: {' | '.join(msg[-6:])[:1500]}", flush=True)
            continue
        r = resources(kernel)
        print(f"ok   {name}: regs {r['regs']} stack {r['stack']} smem {r['shared']} wgmma {r['wgmma']} "
              f"mma.sync {r['mma']} prmt {r['prmt']} ld.v4 {r['ld128']} ld.u8 {r['ld_u8']} bf16->smem {r['bf16_to_smem']}"
              + (" loop {} SASS/iteration, {:.2f} per weight byte, {} wgmma waits / {} wgmma".format(*loop_cost(kernel, v))
                 if args.loop else ""),
              flush=True)
        if args.dump:
            d = Path(args.dump)
            d.mkdir(parents=True, exist_ok=True)
            safe = re.sub(r"[^A-Za-z0-9]+", "_", name)
            (d / f"{safe}.ptx").write_text(kernel.asm["ptx"])
            (d / f"{safe}.ttgir").write_text(kernel.asm["ttgir"])
            (d / f"{safe}.sass").write_text(sass(kernel))
    failures += compile_epilogues(mod, args.only)
    sys.exit(1 if failures else 0)


def compile_epilogues(mod, only: str | None) -> int:
    """The split-K epilogue passes (w1's activation, w2's top-k sum) for MXFP4 with biases, INT4 and NVFP4, 4 slices
    unrolled."""
    failures = 0
    for kind, code in (("mxfp4", 0), ("int4", 1), ("nvfp4", 3)):
        bias = kind == "mxfp4"
        b_type = "*bf16" if bias else "*u8"
        act = (mod.wq_splitk_act_kernel,
               {"ws_ptr": "*fp32", "ids_ptr": "*i32", "gs_ptr": "*fp32", "b_ptr": b_type, "out_ptr": "*bf16",
                "N": "i32", "num_experts": "i32", "splits": "i32", "stride_ws": "i32", "stride_be": "i32",
                "stride_om": "i32", "limit": "fp32"},
               dict(BLOCK=1024, KIND=code, HAS_BIAS=bias, ACT=2 if bias else 0, HAS_LIMIT=bias, INTERLEAVED=False,
                    MAX_SPLITS=4))
        total = (mod.wq_splitk_sum_kernel,
                 {"ws_ptr": "*fp32", "ids_ptr": "*i32", "rw_ptr": "*fp32", "gs_ptr": "*fp32", "b_ptr": b_type,
                  "out_ptr": "*bf16", "K": "i32", "num_experts": "i32", "splits": "i32", "stride_ws": "i32",
                  "stride_be": "i32", "stride_om": "i32"},
                 dict(TOP_K=8, BLOCK=1024, KIND=code, HAS_BIAS=bias, MAX_SPLITS=4))
        for fn, sig, const in (act, total):
            name = f"{fn.__name__} {kind}"
            if only and only not in name:
                continue
            sig = {**sig, **{c: "constexpr" for c in const}}
            try:
                # 1024 columns take 8 warps (fused._epilogue_block)
                kernel = triton.compile(ASTSource(fn, sig, const, {}), target=TARGET, options={"num_warps": 8})
            except Exception as exc:
                failures += 1
                print(f"FAIL {name}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:500]}", flush=True)
                continue
            r = resources(kernel)
            print(f"ok   {name}: regs {r['regs']} stack {r['stack']} smem {r['shared']}", flush=True)
    return failures


if __name__ == "__main__":
    main()
