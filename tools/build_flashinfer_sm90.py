"""Build a trimmed copy of FlashInfer's SM90 CUTLASS fused-MoE module, for moe-fsm's adapter.

FlashInfer JIT-compiles ``fused_moe_90`` from 248 objects on first use (about 48 minutes on 16
cores): every dtype pair its runner knows, including the FP4 and INT4/INT8 mixed-input kernels
that moe-fsm's adapter never calls. This script asks FlashInfer's own JIT machinery for the
module's spec (``gen_cutlass_fused_moe_sm90_module``: its generated CUTLASS instantiation files,
sources and flags), keeps only the objects for the dtype pairs moe-fsm runs, and builds that
spec under its own module name with ninja. The result is one shared object plus a manifest, laid
out the way ``moe_fsm.experts.flashinfer_prebuilt`` looks for it.

Why the trim is safe: the runner classes (``cutlass_fused_moe_instantiation.cu``) and the binding
are compiled whole (only ``-DENABLE_FP4`` is dropped, which the binding and the instantiation
file both honour), so every vtable is complete; what is left out are the GEMM launcher
translation units of other dtype pairs, which the kept code reaches only through ordinary calls.
Those stay undefined in the ``.so`` and are bound lazily (tvm-ffi opens modules with
``RTLD_LAZY``), so loading works and a call on a dropped path would fail loudly, never silently.
``--check-symbols`` verifies that no undefined symbol is needed at load time.

nvcc only compiles for sm_90a here, so the build needs no GPU: any machine with CUDA 13's nvcc
and the same FlashInfer and apache-tvm-ffi versions as the GPU machine will do.

    python tools/build_flashinfer_sm90.py --out prebuilt/ --jobs 16
    python tools/build_flashinfer_sm90.py --dry-run          # list the objects, build nothing
    python tools/build_flashinfer_sm90.py --pack-runtime fi.tar.xz   # the package to carry, sans sources
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODULE_NAME = "moe_fsm_fused_moe_90"
ARCH = "9.0a"

# The dtype pairs (activation, weight) as the generated CUTLASS files spell them, per set the
# adapter can be built for. "fp8" is FP8 e4m3 activations and weights with per-tensor scales.
DTYPE_SETS = {
    "bf16": {("Sm90", "__nv_bfloat16", "__nv_bfloat16"), ("sm80", "cutlass::bfloat16_t", "cutlass::bfloat16_t")},
    "fp16": {("Sm90", "half", "half"), ("sm80", "cutlass::half_t", "cutlass::half_t")},
    "fp8": {("Sm90", "__nv_fp8_e4m3", "__nv_fp8_e4m3")},
}
# Hand-written GEMM dispatch files per dtype set (moe_gemm_kernels_<a>_<w>.cu).
DISPATCH_FILES = {"bf16": "moe_gemm_kernels_bf16_bf16.cu", "fp16": "moe_gemm_kernels_fp16_fp16.cu",
                  "fp8": "moe_gemm_kernels_fp8_fp8.cu"}
DROPPED_FLAGS = ("-DENABLE_FP4", "-DENABLE_FP8_BLOCK_SCALE")
DROPPED_SOURCES = ("fp8_blockscale_gemm.cu",)

_INSTANTIATION = re.compile(
    r"INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM\(\s*(\w+),\s*([\w:]+),\s*([\w:]+)"
    r"|template void (sm80)_generic_fused_moe_gemm_kernelLauncher<\s*([\w:]+),\s*([\w:]+)"
)


def generated_pairs(source: Path) -> set[tuple[str, str, str]]:
    """The (arch, activation, weight) triples a generated CUTLASS file instantiates."""
    pairs = set()
    for match in _INSTANTIATION.finditer(source.read_text()):
        groups = [g for g in match.groups() if g is not None]
        pairs.add(tuple(groups))
    return pairs


def keep_source(source: Path, wanted: set[tuple[str, str, str]], dtype_sets: list[str]) -> bool:
    name = source.name
    if name.endswith(".generated.cu"):
        pairs = generated_pairs(source)
        return bool(pairs) and pairs <= wanted
    if name.startswith("moe_gemm_kernels_"):
        return name in {DISPATCH_FILES[d] for d in dtype_sets}
    return name not in DROPPED_SOURCES


def trimmed_spec(dtype_sets: list[str], cuda_extra: list[Path]):
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    full = gen_cutlass_fused_moe_sm90_module(use_fast_build=True)
    wanted = set().union(*(DTYPE_SETS[d] for d in dtype_sets))
    sources = [Path(s) for s in full.sources if keep_source(Path(s), wanted, dtype_sets)]
    flags = [f for f in full.extra_cuda_cflags if f not in DROPPED_FLAGS]
    spec = dataclasses.replace(
        full, name=MODULE_NAME, sources=sources, extra_cuda_cflags=flags,
        extra_include_dirs=[*full.extra_include_dirs, *(d / "include" for d in cuda_extra)],
        extra_ldflags=[*(f"-L{d / 'lib'}" for d in cuda_extra), *full.extra_ldflags],
    )
    return full, spec


def ninja_log(build_dir: Path) -> list[dict]:
    """Per-object wall times from ninja's own log (start and end in ms since the build began)."""
    log = build_dir / ".ninja_log"
    if not log.exists():
        return []
    rows = []
    for line in log.read_text().splitlines()[1:]:
        start, end, _mtime, output, _hash = line.split("\t")
        rows.append({"object": Path(output).name, "seconds": (int(end) - int(start)) / 1000})
    return rows


def undefined_at_load(so_path: Path) -> list[str]:
    """Undefined symbols bound by non-PLT relocations: those make dlopen fail even when lazy."""
    relocs = subprocess.run(["readelf", "-rW", str(so_path)], capture_output=True, text=True, check=True).stdout
    undefined = set(
        subprocess.run(["nm", "-D", "--undefined-only", str(so_path)], capture_output=True, text=True,
                       check=True).stdout.split()
    )
    eager = set()
    for line in relocs.splitlines():
        parts = line.split()
        if len(parts) >= 5 and "JUMP_SLOT" not in parts[2] and parts[4] in undefined:
            eager.add(parts[4])
    return sorted(s for s in eager if not s.startswith(("_ITM", "__gmon", "_Jv_", "__cxa", "_ZTI", "__gxx")))


# What of flashinfer/data the trimmed build reads (the spec's include paths and sources).
BUILD_SOURCES = ("csrc/nv_internal", "csrc/fused_moe/cutlass_backend", "cutlass/include",
                 "cutlass/tools/util/include", "include", "spdlog", "cccl")


def pack_runtime(archive: Path, with_build_sources: bool) -> int:
    """Archive the FlashInfer package as the adapter needs it at run time: Python only.

    Leaves out ``flashinfer/data`` (the C++/CUDA sources and headers only a build reads) and the
    experimental kernels ``import flashinfer.fused_moe`` does not load: about 60 MiB of the
    wheel's 426 MiB, a few MiB compressed, so it fits a device call's carry with the module.
    ``with_build_sources`` adds the part of ``data`` the trimmed build reads, for building on a
    machine that cannot install the wheel.
    """
    import tarfile

    import flashinfer
    import flashinfer.fused_moe  # noqa: F401  (loads what the adapter's import loads)

    root = Path(flashinfer.__file__).parent
    loaded = {Path(m.__file__).resolve() for m in list(sys.modules.values())
              if getattr(m, "__file__", None) and m.__name__.startswith("flashinfer")}
    with tarfile.open(archive, "w:xz") as tar:
        for path in sorted(root.rglob("*")):
            relative = path.relative_to(root)
            if not path.is_file() or path.suffix == ".pyc":
                continue
            if relative.parts[0] == "data" and not (
                with_build_sources and any(relative.as_posix().startswith(f"data/{d}/") for d in BUILD_SOURCES)
            ):
                continue
            if relative.parts[0] == "experimental" and path.resolve() not in loaded and path.name != "__init__.py":
                continue
            tar.add(path, arcname=str(Path("flashinfer") / relative))
        for dist in root.parent.glob("flashinfer_python-*.dist-info"):
            tar.add(dist, arcname=dist.name)
    print(f"{archive}: {archive.stat().st_size / 2**20:.1f} MiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("flashinfer-prebuilt"),
                        help="where the module and its manifest go (default: ./flashinfer-prebuilt)")
    parser.add_argument("--dtypes", default="bf16,fp16,fp8", help=f"comma list of {sorted(DTYPE_SETS)}")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workspace", type=Path, default=None,
                        help="FlashInfer workspace (generated sources, objects); default: a temp dir")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="stop ninja after this many seconds and report what was built")
    parser.add_argument("--cuda-extra", type=Path, action="append", default=[],
                        help="a directory with include/ and lib/ to add, for a CUDA toolkit without cuBLAS headers, "
                             "libnvrtc or the libcuda stub (for example the nvidia/cu13 folder of NVIDIA's pip wheels)")
    parser.add_argument("--dry-run", action="store_true", help="print the object list and exit")
    parser.add_argument("--pack-runtime", type=Path, metavar="ARCHIVE.tar.xz",
                        help="instead of building, archive the FlashInfer package without its build sources")
    parser.add_argument("--with-build-sources", action="store_true",
                        help="with --pack-runtime: include the sources and headers the trimmed build reads")
    args = parser.parse_args(argv)

    if args.pack_runtime:
        return pack_runtime(args.pack_runtime, args.with_build_sources)
    dtype_sets = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = sorted(set(dtype_sets) - set(DTYPE_SETS))
    if unknown:
        parser.error(f"--dtypes: unknown {unknown}; accepted: {sorted(DTYPE_SETS)}")
    if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        parser.error("nvcc (CUDA 13) is needed to build; none found on PATH or in /usr/local/cuda/bin")

    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", ARCH)
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    workspace = args.workspace or Path(tempfile.mkdtemp(prefix="moe-fsm-fi-"))
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(workspace.resolve())

    import flashinfer
    import tvm_ffi

    full, spec = trimmed_spec(dtype_sets, args.cuda_extra)
    print(f"flashinfer {flashinfer.__version__}, apache-tvm-ffi {tvm_ffi.__version__}: "
          f"{len(spec.sources)} of {len(full.sources)} sources kept for {dtype_sets}", flush=True)
    if args.dry_run:
        for source in spec.sources:
            print(f"  {source.name}")
        return 0

    spec.write_ninja()
    command = ["ninja", "-C", str(spec.build_dir), "-f", str(spec.ninja_path), "-j", str(args.jobs)]
    started = time.monotonic()
    try:
        result = subprocess.run(command, timeout=args.time_limit, capture_output=True, text=True)
        finished, returncode = True, result.returncode
        tail = (result.stdout + result.stderr)[-4000:]
    except subprocess.TimeoutExpired as stopped:
        finished, returncode = False, None
        tail = ((stopped.stdout or b"").decode() if isinstance(stopped.stdout, bytes) else (stopped.stdout or ""))[-4000:]
    wall = time.monotonic() - started

    objects = ninja_log(spec.build_dir)
    report = {
        "module": MODULE_NAME, "arch": ARCH, "flashinfer": flashinfer.__version__, "tvm_ffi": tvm_ffi.__version__,
        "dtype_sets": dtype_sets, "sources_kept": len(spec.sources), "sources_full": len(full.sources),
        "jobs": args.jobs, "wall_seconds": round(wall, 1), "finished": finished, "returncode": returncode,
        "objects_built": len(objects), "objects": sorted(objects, key=lambda r: -r["seconds"]),
        "object_seconds_total": round(sum(r["seconds"] for r in objects), 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    if finished and returncode == 0:
        so_path = spec.jit_library_path
        report["eager_undefined_symbols"] = undefined_at_load(so_path)
        target = args.out / f"{MODULE_NAME}.so"
        shutil.copy2(so_path, target)
        subprocess.run(["strip", "--strip-unneeded", str(target)], check=False)
        report["so_bytes"] = target.stat().st_size
    else:
        report["log_tail"] = tail
    (args.out / "manifest.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "objects"}, indent=2))
    return 0 if finished and returncode == 0 and not report.get("eager_undefined_symbols") else 1


if __name__ == "__main__":
    sys.exit(main())
