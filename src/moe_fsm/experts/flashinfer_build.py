"""Build FlashInfer's SM90 CUTLASS fused-MoE module, trimmed to the dtype sets moe-fsm runs.

FlashInfer JIT-compiles ``fused_moe_90`` from 248 objects on first use (about 48 minutes on 16
cores): every dtype pair its runner knows. This module asks FlashInfer's own JIT machinery for
the module's spec (``gen_cutlass_fused_moe_sm90_module``: generated CUTLASS instantiation files,
sources, flags), keeps the objects of the dtype sets asked for, builds that spec with ninja
under its own name, and installs the stripped ``.so`` with a ``manifest.json`` where
``flashinfer_prebuilt`` looks for it. ``moe-fsm flashinfer build`` and
``tools/build_flashinfer_sm90.py`` are its two front ends.

A trimmed module must never be able to end the caller's process, so the build refuses to
install one that is broken in either of the two ways measured on the H100 (issue 27):

* an undefined ``tensorrt_llm`` / CUTLASS symbol (``nm -D --undefined-only``, lazily bound ones
  included) that instantiates a dtype pair the build kept: the module would load, and the first
  call reaching that symbol would end the process with "symbol lookup error". Symbols of the
  pairs that were dropped stay (the binding names runners of every pair), and are listed in the
  manifest;
* a smoke call that fails: a small layer of every kept set runs through ``cutlass_fused_moe``
  with FlashInfer's autotuner on (every tactic it profiles), in a child process, so a missing
  symbol kills the child and the build reports it.

What is kept: every hand-written source except the GEMM dispatch files of other dtype sets, so
``fp8_blockscale_gemm.cu`` always (without ``-DENABLE_FP8_BLOCK_SCALE`` it is stubs that throw,
which the runner classes still name); a generated CUTLASS file when it instantiates ANY wanted
pair (the sm80 files put bf16 and fp16 launchers in one file). ninja runs with ``-k 0`` and its
whole output is kept in ``build.log`` beside the manifest; host memory in use is sampled while
it runs.

nvcc compiles for sm_90a only, so the build needs no GPU; the smoke call does
(``--no-smoke`` skips it and says so in the manifest).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from moe_fsm.trace.document import write_atomic

MODULE_NAME = "moe_fsm_fused_moe_90"
ARCH = "9.0a"
GB = 1e9
GB_PER_COMPILE = 5.0  # H100 machine, -j16, longest objects first: 78.4 GB peak = 4.9 GB a compile (issue 27)
DEFAULT_DTYPES = ("bf16", "fp8", "fp8_block")

# The dtype pairs (activation, weight) as the generated CUTLASS files spell them, per set.
# "fp8" is FP8 e4m3 activations and weights with per-tensor scales; "fp8_block" is DeepSeek's
# 128x128-block FP8 weights with bf16 activations quantized 1x128 inside the kernel (FlashInfer's
# use_deepseek_fp8_block_scale path: CutlassMoeFCRunner<bf16, fp8> with fp8_blockscale_gemm).
DTYPE_SETS: dict[str, set[tuple[str, str, str]]] = {
    "bf16": {("Sm90", "__nv_bfloat16", "__nv_bfloat16"), ("sm80", "cutlass::bfloat16_t", "cutlass::bfloat16_t")},
    "fp16": {("Sm90", "half", "half"), ("sm80", "cutlass::half_t", "cutlass::half_t")},
    "fp8": {("Sm90", "__nv_fp8_e4m3", "__nv_fp8_e4m3")},
    "fp8_block": set(),
}
# Hand-written GEMM dispatch files per dtype set (moe_gemm_kernels_<a>_<w>.cu).
DISPATCH_FILES = {"bf16": ("moe_gemm_kernels_bf16_bf16.cu",), "fp16": ("moe_gemm_kernels_fp16_fp16.cu",),
                  "fp8": ("moe_gemm_kernels_fp8_fp8.cu",), "fp8_block": ("moe_gemm_kernels_bf16_fp8.cu",)}
# The (activation, weight) pairs, in canonical names, whose symbols must all be defined.
KEPT_PAIRS = {"bf16": {("bf16", "bf16")}, "fp16": {("fp16", "fp16")}, "fp8": {("fp8", "fp8")},
              "fp8_block": {("bf16", "fp8")}}
SET_FLAGS = {"fp8_block": ("-DENABLE_FP8_BLOCK_SCALE",)}  # kept only when the set is built
DROPPED_FLAGS = ("-DENABLE_FP4", "-DENABLE_FP8_BLOCK_SCALE")
# ninja starts objects in the order the build file lists them, so the longest go first (the
# critical path is one object: at -j16 the first build's wall time was the fp8 dispatch file's plus
# the sm80 group0 file's, started late).
MEASURED_SECONDS = {  # one H100-machine core each, -j16 (issue 27's first build): started longest first
    "moe_gemm_kernels_fp8_fp8.cu": 495, "cutlass_kernel_file_gemm_grouped_sm80_M128_group0.generated.cu": 447,
    "cutlass_kernel_file_gemm_grouped_sm80_M64_group0.generated.cu": 300,
    "cutlass_kernel_file_gemm_grouped_sm80_M128_group1.generated.cu": 287,
    "cutlass_kernel_file_gemm_grouped_sm80_M16_group2.generated.cu": 220,
    "cutlass_kernel_file_gemm_grouped_sm80_M64_group1.generated.cu": 220,
    "cutlass_kernel_file_gemm_grouped_sm80_M32_group0.generated.cu": 219,
    "cutlass_kernel_file_gemm_grouped_sm80_M16_group1.generated.cu": 216, "moe_gemm_kernels_bf16_bf16.cu": 189,
    "cutlass_kernel_file_gemm_grouped_sm90_M256_group8.generated.cu": 183,
    "cutlass_kernel_file_gemm_grouped_sm90_M256_group9.generated.cu": 175,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group34.generated.cu": 171,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group33.generated.cu": 170, "cutlass_fused_moe_instantiation.cu": 169,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group10.generated.cu": 168,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group11.generated.cu": 167,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group12.generated.cu": 164,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group31.generated.cu": 162,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group32.generated.cu": 160,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group13.generated.cu": 160,
    "cutlass_kernel_file_gemm_grouped_sm80_M32_group1.generated.cu": 159,
    "cutlass_kernel_file_gemm_grouped_sm90_M256_group3.generated.cu": 158,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group29.generated.cu": 158,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group9.generated.cu": 147,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group30.generated.cu": 147,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group27.generated.cu": 146,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group28.generated.cu": 142,
    "cutlass_kernel_file_gemm_grouped_sm90_M256_group6.generated.cu": 141,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group26.generated.cu": 141,
    "cutlass_kernel_file_gemm_grouped_sm90_M256_group2.generated.cu": 136,
    "cutlass_kernel_file_gemm_grouped_sm90_M256_group7.generated.cu": 134,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group25.generated.cu": 132,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group8.generated.cu": 128,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group7.generated.cu": 128,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group22.generated.cu": 124,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group23.generated.cu": 122,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group24.generated.cu": 121, "fp8_blockscale_gemm.cu": 120,
    "cutlass_kernel_file_gemm_grouped_sm90_M128_group21.generated.cu": 119,
    "flashinfer_cutlass_fused_moe_binding.cu": 82, "moe_gemm_kernels_bf16_fp8.cu": 62,
    "moe_gemm_tma_warp_specialized_input.cu": 41, "memoryUtils.cu": 16, "deepgemm_jit_setup.cu": 12,
    "cutlass_heuristic.cpp": 7, "preQuantScaleKernel.cu": 4, "envUtils.cpp": 4, "lora.cpp": 4, "logger.cpp": 3,
    "moe_gemm_mixed_utils.cu": 2, "stringUtils.cpp": 1, "tllmException.cpp": 1,
}
# Read at run time, not at build time: DeepGEMM's JIT (the fp8_block path) compiles its kernels
# with nvrtc from these headers, under the include directory FlashInfer hands the module.
RUNTIME_DATA_DIRS = ("csrc/nv_internal/tensorrt_llm/deep_gemm",)

_INSTANTIATION = re.compile(
    r"INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM\(\s*(\w+),\s*([\w:]+),\s*([\w:]+)"
    r"|template void (sm80)_generic_fused_moe_gemm_kernelLauncher<\s*([\w:]+),\s*([\w:]+)"
)


class BuildError(RuntimeError):
    """The build did not produce a module that may be installed; the message says why."""


def parse_dtype_sets(text: str) -> list[str]:
    sets = [d.strip() for d in text.split(",") if d.strip()]
    unknown = sorted(set(sets) - set(DTYPE_SETS))
    if unknown or not sets:
        raise ValueError(f"--dtypes: unknown {unknown or 'empty list'}; accepted: {sorted(DTYPE_SETS)}")
    return list(dict.fromkeys(sets))


# --- what is kept -------------------------------------------------------------------------------


def generated_pairs(source: Path) -> set[tuple[str, str, str]]:
    """The (arch, activation, weight) triples a generated CUTLASS file instantiates."""
    pairs = set()
    for match in _INSTANTIATION.finditer(source.read_text()):
        pairs.add(tuple(g for g in match.groups() if g is not None))
    return pairs


def keep_source(source: Path, wanted: set[tuple[str, str, str]], dtype_sets: Iterable[str]) -> bool:
    """Whether the trimmed module compiles ``source``.

    A generated file is kept when it instantiates any wanted pair: one that also holds an
    unwanted pair costs compile time, one dropped for it leaves launchers of a kept pair
    undefined (measured: the sm80 ``*_group0`` files hold bf16 and fp16 together).
    """
    name = source.name
    if name.endswith(".generated.cu"):
        return bool(generated_pairs(source) & wanted)
    if name.startswith("moe_gemm_kernels_"):
        return name in {f for d in dtype_sets for f in DISPATCH_FILES[d]}
    return True


def _start_order(source: Path) -> float:
    return -MEASURED_SECONDS.get(source.name, 100.0)


def trimmed_spec(dtype_sets: list[str], cuda_extra: Iterable[Path] = ()):
    """FlashInfer's full SM90 spec, and the trimmed one moe-fsm builds (heavy objects first)."""
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    cuda_extra = list(cuda_extra)
    full = gen_cutlass_fused_moe_sm90_module(use_fast_build=True)
    wanted = set().union(*(DTYPE_SETS[d] for d in dtype_sets))
    sources = sorted((Path(s) for s in full.sources if keep_source(Path(s), wanted, dtype_sets)), key=_start_order)
    kept_flags = {f for d in dtype_sets for f in SET_FLAGS.get(d, ())}
    flags = [f for f in full.extra_cuda_cflags if f and (f not in DROPPED_FLAGS or f in kept_flags)]
    flags += [f for f in sorted(kept_flags) if f not in flags]
    spec = dataclasses.replace(
        full, name=MODULE_NAME, sources=sources, extra_cuda_cflags=flags,
        extra_include_dirs=[*full.extra_include_dirs, *(d / "include" for d in cuda_extra)],
        extra_ldflags=[*(f"-L{d / 'lib'}" for d in cuda_extra), *full.extra_ldflags],
    )
    return full, spec


# --- symbols ------------------------------------------------------------------------------------

# Canonical dtype names of the C++ spellings found in the module's symbols.
_DTYPE_WORDS = (
    ("bf16", ("__nv_bfloat16", "cutlass::bfloat16_t")),
    ("fp16", ("__half", "half", "cutlass::half_t")),
    ("fp8", ("__nv_fp8_e4m3", "cutlass::float_e4m3_t")),
    ("fp8_e5m2", ("__nv_fp8_e5m2", "cutlass::float_e5m2_t")),
    ("fp4", ("__nv_fp4_e2m1", "cutlass::float_e2m1_t", "Fp4Type", "cutlass::nv_float4_t", "cutlass::mx_float4_t")),
    ("int4", ("cutlass::uint4b_t", "cutlass::int4b_t")),
    ("uint8", ("unsigned char", "uint8_t", "cutlass::uint8_t")),
    ("fp32", ("float",)),
)


def _canonical_dtype(arg: str) -> Optional[str]:
    arg = arg.replace(" const", "").strip()
    for name, spellings in _DTYPE_WORDS:
        if arg in spellings:
            return name
    if arg.startswith(("cutlass::integer_subbyte<4,", "cutlass::integer_subbyte<4>")):
        return "int4"
    if arg.startswith(("cutlass::nv_float4_t", "cutlass::mx_float4_t")):
        return "fp4"
    return None


def _template_args(text: str, start: int) -> list[str]:
    """The top-level arguments of the template argument list opening at ``text[start] == '<'``."""
    depth, args, current = 0, [], []
    for char in text[start:]:
        if char == "<":
            depth += 1
            if depth == 1:
                continue
        elif char == ">":
            depth -= 1
            if depth == 0:
                args.append("".join(current).strip())
                return args
        elif char == "," and depth == 1:
            args.append("".join(current).strip())
            current = []
            continue
        elif char == "(" and depth == 0:
            break
        current.append(char)
    return args


def symbol_pair(demangled: str) -> Optional[tuple[str, str]]:
    """The (activation, weight) dtype pair a tensorrt_llm/CUTLASS symbol instantiates, if it names one.

    The first template argument list whose first two arguments are both dtypes decides:
    ``MoeGemmRunner<__nv_fp8_e4m3, cutlass::integer_subbyte<4, false>, ...>::moeGemmBiasAct``
    is (fp8, int4); ``sm80_generic_fused_moe_gemm_kernelLauncher<cutlass::bfloat16_t,
    cutlass::bfloat16_t, 32, ...>`` is (bf16, bf16).
    """
    for match in re.finditer(r"<", demangled):
        args = _template_args(demangled, match.start())
        if len(args) >= 2:
            a, w = _canonical_dtype(args[0]), _canonical_dtype(args[1])
            if a and w:
                return a, w
    return None


def _is_ours(demangled: str) -> bool:
    return "tensorrt_llm::" in demangled or "cutlass::" in demangled or "cutlass_kernels" in demangled


def undefined_symbols(so_path: Path) -> list[tuple[str, str]]:
    """(mangled, demangled) of every undefined dynamic symbol, lazily bound ones included."""
    mangled = subprocess.run(["nm", "-D", "--undefined-only", "--format=posix", str(so_path)],
                             capture_output=True, text=True, check=True).stdout
    names = [line.split()[0] for line in mangled.splitlines() if line.strip()]
    demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                               check=True).stdout.splitlines()
    return list(zip(names, demangled))


def undefined_at_load(so_path: Path) -> list[str]:
    """Undefined symbols bound by non-PLT relocations: those make dlopen fail even when lazy."""
    relocs = subprocess.run(["readelf", "-rW", str(so_path)], capture_output=True, text=True, check=True).stdout
    undefined = {name for name, _ in undefined_symbols(so_path)}
    eager = set()
    for line in relocs.splitlines():
        parts = line.split()
        if len(parts) >= 5 and "JUMP_SLOT" not in parts[2] and parts[4] in undefined:
            eager.add(parts[4])
    return sorted(s for s in eager if not s.startswith(("_ITM", "__gmon", "_Jv_", "__cxa", "_ZTI", "__gxx")))


def classify_undefined(symbols: list[tuple[str, str]], dtype_sets: Iterable[str]) -> dict[str, list[str]]:
    """Split the module's undefined tensorrt_llm/CUTLASS symbols by the dtype pair they instantiate.

    ``kept_pair``: a pair the build kept: such a module must not be installed. ``dropped_pair``:
    pairs left out on purpose (reached only by calls moe-fsm never makes). ``no_pair``: symbols
    of ours that name no dtype pair, listed for a human to judge.
    """
    kept = set().union(*(KEPT_PAIRS[d] for d in dtype_sets))
    out: dict[str, list[str]] = {"kept_pair": [], "dropped_pair": [], "no_pair": []}
    for _mangled, demangled in symbols:
        if not _is_ours(demangled):
            continue
        pair = symbol_pair(demangled)
        key = "no_pair" if pair is None else ("kept_pair" if pair in kept else "dropped_pair")
        out[key].append(demangled)
    return {k: sorted(v) for k, v in out.items()}


# --- headers: from the compiler's dependency files ----------------------------------------------


def _flashinfer_data_root() -> Path:
    import flashinfer

    return Path(flashinfer.__file__).parent / "data"


def _data_relative(paths: Iterable[str], data_root: Path) -> set[str]:
    root = str(data_root.resolve()) + os.sep
    found = set()
    for path in paths:
        resolved = os.path.normpath(path if os.path.isabs(path) else os.path.join(os.getcwd(), path))
        resolved = str(Path(resolved).resolve()) if os.path.exists(resolved) else resolved
        if resolved.startswith(root):
            found.add(resolved[len(root):])
    return found


def _depfile_paths(text: str) -> list[str]:
    body = text.replace("\\\n", " ")
    paths = []
    for line in body.splitlines():
        if ":" not in line:
            continue
        paths.extend(p for p in line.split(":", 1)[1].split() if p)
    return paths


def ninja_deps(build_dir: Path, ninja_path: Path) -> set[str]:
    """Every file under flashinfer/data the objects of a finished build read (``ninja -t deps``).

    FlashInfer's rules write ``*.o.d`` files (``deps = gcc``), which ninja folds into its
    ``.ninja_deps`` log; ``-t deps`` prints them back.
    """
    out = subprocess.run(["ninja", "-C", str(build_dir), "-f", str(ninja_path), "-t", "deps"],
                         capture_output=True, text=True, check=True).stdout
    paths = [line.strip() for line in out.splitlines() if line.startswith("    ")]
    return _data_relative(paths, _flashinfer_data_root())


def preprocess_deps(spec, jobs: int = 2, log: Callable[[str], None] = print) -> set[str]:
    """The files under flashinfer/data the spec's objects include, from nvcc's own ``-M`` pass.

    Each compile command of the spec's ninja file is run as ``nvcc -M -MF <obj>.o.d`` (the
    preprocessor only: seconds an object). Headers outside FlashInfer that this machine lacks
    (cuBLAS, nvrtc on a toolkit without them) are given empty stand-ins in a scratch include
    directory, so the pass reaches every FlashInfer header; none of them is FlashInfer's.
    """
    from concurrent.futures import ThreadPoolExecutor

    spec.write_ninja()
    commands = subprocess.run(["ninja", "-C", str(spec.build_dir), "-f", str(spec.ninja_path), "-t", "commands"],
                              capture_output=True, text=True, check=True).stdout.splitlines()
    compiles = [c for c in commands if " -c " in c and " -o " in c]
    stubs = Path(tempfile.mkdtemp(prefix="moe-fsm-fi-stubs-"))
    data_root = _flashinfer_data_root()

    def one(command: str) -> set[str]:
        depfile = re.search(r"-MF (\S+)", command).group(1)
        command = command.replace("--generate-dependencies-with-compile", "-M")
        command = command.replace(" -MMD ", " -M ")  # the C++ rule's -MMD leaves -isystem headers out
        command = re.sub(r" -o \S+", "", command).replace(" -c ", " ") + f" -isystem {stubs}"
        for _ in range(20):
            result = subprocess.run(command, shell=True, capture_output=True, text=True)
            missing = re.search(r"fatal error: ([\w./+-]+): No such file", result.stderr)
            if result.returncode == 0 or missing is None:
                break
            if (data_root / "csrc" / missing.group(1)).exists() or "flashinfer" in missing.group(1):
                break
            stub = stubs / missing.group(1)
            stub.parent.mkdir(parents=True, exist_ok=True)
            stub.touch()
        if result.returncode != 0:
            raise BuildError(f"the dependency pass failed for {command.split()[-1]}: {result.stderr[-2000:]}")
        return _data_relative(_depfile_paths(Path(depfile).read_text()), data_root)

    found: set[str] = set()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for index, deps in enumerate(pool.map(one, compiles), 1):
            found |= deps
            log(f"[{index}/{len(compiles)}] dependency pass: {len(found)} files under flashinfer/data so far")
    shutil.rmtree(stubs, ignore_errors=True)
    return found


# --- memory, jobs, ninja --------------------------------------------------------------------------


def meminfo() -> dict[str, int]:
    values = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, rest = line.split(":", 1)
            values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values


def default_jobs() -> tuple[int, str]:
    """ninja's -j from free memory (about 5 GB a compile, longest first), at most one per core."""
    cores = os.cpu_count() or 1
    available = meminfo().get("MemAvailable")
    if available is None:
        return cores, f"{cores} cores (free memory unknown)"
    by_memory = max(1, int(available / GB / GB_PER_COMPILE))
    jobs = min(cores, by_memory)
    return jobs, f"{available / GB:.0f} GB free / {GB_PER_COMPILE} GB a compile = {by_memory}, {cores} cores"


class MemorySampler:
    """Host memory in use (MemTotal - MemAvailable), sampled every ``interval`` seconds."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.baseline = self._used()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _used() -> int:
        info = meminfo()
        return info.get("MemTotal", 0) - info.get("MemAvailable", 0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._used())

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def ninja_log(build_dir: Path) -> list[dict]:
    """Per-object wall times from ninja's own log (start and end in ms since the build began)."""
    log = build_dir / ".ninja_log"
    if not log.exists():
        return []
    rows = []
    for line in log.read_text().splitlines()[1:]:
        start, end, _mtime, output, _hash = line.split("\t")
        rows.append({"object": Path(output).name, "start": int(start) / 1000, "seconds": (int(end) - int(start)) / 1000})
    return rows


_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]\s+(.*)$")


def run_ninja(spec, jobs: int, log_path: Path, time_limit: Optional[float],
              progress: Callable[[str], None]) -> tuple[Optional[int], float]:
    """ninja -k 0 (every failure shown, none stops the others), whole output to ``log_path``."""
    command = ["ninja", "-k", "0", "-C", str(spec.build_dir), "-f", str(spec.ninja_path), "-j", str(jobs)]
    started = time.monotonic()
    env = dict(os.environ, NINJA_STATUS="[%f/%t] ")
    with open(log_path, "w") as log, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                       text=True, env=env, bufsize=1) as proc:
        log.write(f"$ {' '.join(command)}\n")
        timer = None
        if time_limit is not None:
            timer = threading.Timer(time_limit, proc.kill)
            timer.start()
        for line in proc.stdout:
            log.write(line)
            log.flush()
            match = _PROGRESS.match(line)
            if match:
                done, total, what = match.groups()
                target = what.split()[-1] if what.split() else what
                progress(f"[{done}/{total}] {time.monotonic() - started:6.0f} s  {Path(target).name}")
            elif "error" in line.lower():
                progress("  " + line.rstrip()[:300])
        returncode = proc.wait()
        if timer is not None:
            timer.cancel()
    wall = time.monotonic() - started
    if time_limit is not None and wall >= time_limit and returncode != 0:
        return None, wall
    return returncode, wall


# --- smoke call ---------------------------------------------------------------------------------

SMOKE_TIMEOUT_S = 300  # per set; the first block-FP8 call JIT-compiles DeepGEMM kernels


def smoke_in_child(module_dir: Path, dtype_set: str, timeout: float = SMOKE_TIMEOUT_S) -> dict:
    """Run ``smoke_main`` for one dtype set in a child process against the module in ``module_dir``.

    A missing symbol bound lazily ends the process that calls it ("symbol lookup error"), with
    no exception to catch; here that process is the child, and the build reports its death.
    """
    env = dict(os.environ, MOE_FSM_FLASHINFER_PREBUILT=str(module_dir))
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-c", "import sys; from moe_fsm.experts.flashinfer_build import smoke_main; "
               "sys.exit(smoke_main(sys.argv[1:]))", dtype_set]
    started = time.monotonic()
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"dtype_set": dtype_set, "ok": False, "returncode": None,
                "reason": f"the smoke call did not finish in {timeout:.0f} s"}
    lines = [line for line in result.stdout.splitlines() if line.startswith("SMOKE ")]
    report = json.loads(lines[-1][6:]) if lines else {"dtype_set": dtype_set, "ok": False}
    report.update(returncode=result.returncode, seconds=round(time.monotonic() - started, 1))
    report["ok"] = bool(report.get("ok")) and result.returncode == 0
    if not report["ok"]:
        died = result.returncode < 0 or result.returncode == 127
        said = report.get("reason") or report.get("error")
        report["reason"] = (f"the child process died (status {result.returncode})" if died
                            else f"the child process exited with status {result.returncode}") + (f": {said}" if said else "")
        report["stderr_tail"] = result.stderr[-3000:]
    return report


SMOKE_TOLERANCE = {"bf16": 2e-2, "fp16": 2e-2, "fp8": 8e-2, "fp8_block": 6e-2}


def _smoke_case(dtype_set: str, cutlass_fused_moe, torch) -> dict:
    """One small layer of ``dtype_set`` through cutlass_fused_moe, against a float64 reference."""
    from flashinfer.autotuner import autotune

    torch.manual_seed(0)
    device = "cuda"
    experts, top_k, hidden, inter, tokens = 8, 2, 512, 256, 96
    x = torch.randn(tokens, hidden, device=device).to(torch.bfloat16)
    w1 = torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device=device) / inter**0.5
    logits = torch.randn(tokens, experts, device=device)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    ids = ids.to(torch.int32)
    extra: dict = {}
    if dtype_set in ("bf16", "fp16"):
        dtype = torch.bfloat16 if dtype_set == "bf16" else torch.float16
        x = x.to(dtype)
        w1q, w2q = w1.to(dtype), w2.to(dtype)
        w1d, w2d, xd = w1q.double(), w2q.double(), x.double()
        scales: list = []
    elif dtype_set == "fp8":
        dtype = torch.bfloat16
        fp8 = torch.float8_e4m3fn
        s1 = w1.abs().amax(dim=(1, 2)) / 448
        s2 = w2.abs().amax(dim=(1, 2)) / 448
        w1q = (w1 / s1[:, None, None]).to(fp8)
        w2q = (w2 / s2[:, None, None]).to(fp8)
        a1 = x.float().abs().max() / 448
        xq = (x.float() / a1).to(fp8)
        w1d = w1q.double() * s1.double()[:, None, None]
        w2d = w2q.double() * s2.double()[:, None, None]
        xd = xq.double() * a1.double()
        scales = [s1, s2, a1]  # completed below, once the intermediate's range is known
        x = xq
    else:  # fp8_block: 128x128 weight blocks, bf16 input quantized 1x128 by the kernel
        dtype = torch.bfloat16
        fp8 = torch.float8_e4m3fn

        def blocks(w):
            e, n, k = w.shape
            view = w.reshape(e, n // 128, 128, k // 128, 128)
            scale = view.abs().amax(dim=(2, 4)) / 448
            q = (view / scale[:, :, None, :, None]).to(fp8).reshape(e, n, k)
            deq = (q.double().reshape(e, n // 128, 128, k // 128, 128) * scale.double()[:, :, None, :, None]).reshape(e, n, k)
            return q, scale.float().contiguous(), deq

        w1q, s1, w1d = blocks(w1)
        w2q, s2, w2d = blocks(w2)
        xd = x.double()
        scales = [s1, s2]
        extra["use_deepseek_fp8_block_scale"] = True
    # reference: [gate; up] in w1d rows, SiLU(gate) * up, weighted sum over the top-k
    ref = torch.zeros(tokens, hidden, dtype=torch.float64, device=device)
    act_max = torch.zeros((), dtype=torch.float64, device=device)
    for e in range(experts):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        h = xd[rows] @ w1d[e].T
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        act_max = torch.maximum(act_max, act.abs().max())
        ref.index_add_(0, rows, (act @ w2d[e].T) * weights[rows, slots].double()[:, None])
    if dtype_set == "fp8":  # a static a2 calibrated on this input, as a checkpoint's would be
        s1, s2, a1 = scales
        a2 = (act_max / 448).float()
        scales = [(s1 * a1).float(), (1.0 / a2).reshape(()), (s2 * a2).float(), a1.reshape(()).float()]

    def up_gate(w):
        half = w.shape[1] // 2
        return torch.cat([w[:, half:], w[:, :half]], dim=1).contiguous()

    if dtype_set == "fp8_block":
        scales = [up_gate(scales[0]), scales[1]]
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype, device=device)
    with autotune(True):
        cutlass_fused_moe(x.contiguous(), ids, weights.float(), up_gate(w1q), w2q.contiguous(), dtype,
                          quant_scales=scales, output=out, **extra)
    out2 = cutlass_fused_moe(x.contiguous(), ids, weights.float(), up_gate(w1q), w2q.contiguous(), dtype,
                             quant_scales=scales, **extra)
    out2 = out2[0] if isinstance(out2, (list, tuple)) else out2
    torch.cuda.synchronize()
    err = float((out2.double() - ref).norm() / ref.norm())
    finite = bool(torch.isfinite(out2).all())
    return {"dtype_set": dtype_set, "rel_err": err, "finite": finite,
            "ok": finite and err < SMOKE_TOLERANCE[dtype_set], "tolerance": SMOKE_TOLERANCE[dtype_set]}


def smoke_main(dtype_sets: list[str]) -> int:
    """The child's side: load the module through moe-fsm's loader, run each set, print a JSON line each."""
    import torch

    if not torch.cuda.is_available():
        print("SMOKE " + json.dumps({"ok": False, "reason": "no CUDA device"}), flush=True)
        return 1
    from moe_fsm.experts import flashinfer_prebuilt

    flashinfer_prebuilt.install_sm90_module()
    from flashinfer.fused_moe import cutlass_fused_moe

    status = 0
    for dtype_set in dtype_sets:
        try:
            result = _smoke_case(dtype_set, cutlass_fused_moe, torch)
        except Exception as err:  # reported, the next set still runs
            result = {"dtype_set": dtype_set, "ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
        print("SMOKE " + json.dumps(result), flush=True)
        status |= 0 if result["ok"] else 1
    return status


# --- the build ----------------------------------------------------------------------------------


def default_out_dir() -> Path:
    import flashinfer

    from moe_fsm.experts.flashinfer_prebuilt import default_cache_dir

    return default_cache_dir(flashinfer.__version__)


def find_nvcc() -> Optional[str]:
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None


def build(dtype_sets: list[str], out: Optional[Path] = None, jobs: Optional[int] = None,
          workspace: Optional[Path] = None, cuda_extra: Iterable[Path] = (), time_limit: Optional[float] = None,
          smoke: bool = True, log: Callable[[str], None] = print) -> dict:
    """Build, check and install the trimmed module; returns the manifest. Raises BuildError."""
    if find_nvcc() is None:
        raise BuildError("nvcc (CUDA 12.8 or newer) is needed to build; none found on PATH or in /usr/local/cuda/bin")
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", ARCH)
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    workspace = Path(workspace or tempfile.mkdtemp(prefix="moe-fsm-fi-")).resolve()
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(workspace)

    import flashinfer
    import tvm_ffi

    out = Path(out or default_out_dir())
    jobs_why = "given"
    if jobs is None:
        jobs, jobs_why = default_jobs()
    full, spec = trimmed_spec(dtype_sets, cuda_extra)
    log(f"flashinfer {flashinfer.__version__}, apache-tvm-ffi {tvm_ffi.__version__}: building {len(spec.sources)} of "
        f"{len(full.sources)} objects for {','.join(dtype_sets)} with -j{jobs} ({jobs_why}).")
    log("This takes about 8-10 minutes on 16 cores (501 s measured at -j16 for bf16,fp8,fp8_block on the H100 "
        f"machine, 78 GB of memory at peak: about 5 GB a compile); the module goes to {out}.")
    spec.write_ninja()
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "build.log"
    with MemorySampler() as memory:
        returncode, wall = run_ninja(spec, jobs, log_path, time_limit, log)
    objects = ninja_log(spec.build_dir)
    manifest = {
        "module": MODULE_NAME, "arch": ARCH, "flashinfer": flashinfer.__version__, "tvm_ffi": tvm_ffi.__version__,
        "dtype_sets": dtype_sets, "sources_kept": len(spec.sources), "sources_full": len(full.sources),
        "flags_kept": [f for f in spec.extra_cuda_cflags if f.startswith("-DENABLE")],
        "jobs": jobs, "jobs_from": jobs_why, "cores": os.cpu_count(), "wall_seconds": round(wall, 1),
        "finished": returncode is not None, "returncode": returncode,
        "host_memory_in_use_gb": {"before": round(memory.baseline / GB, 1), "peak": round(memory.peak / GB, 1),
                                  "total": round(meminfo().get("MemTotal", 0) / GB, 1)},
        "objects_built": len(objects), "object_seconds_total": round(sum(r["seconds"] for r in objects), 1),
        "objects": sorted(objects, key=lambda r: -r["seconds"]), "build_log": str(log_path),
        "workspace": str(workspace),
    }
    manifest_path = out / "manifest.json"
    so_target = out / f"{MODULE_NAME}.so"

    def fail(reason: str) -> BuildError:
        manifest["installed"] = False
        manifest["failure"] = reason
        write_atomic(out / "build-failed.json", json.dumps(manifest, indent=2) + "\n")
        return BuildError(f"{reason} (details: {out / 'build-failed.json'}, ninja's log: {log_path})")

    if returncode != 0:
        raise fail(f"ninja stopped after {wall:.0f} s" if returncode is None else f"ninja failed (status {returncode})")
    try:
        manifest["headers_read"] = sorted(ninja_deps(spec.build_dir, spec.ninja_path))
    except (OSError, subprocess.CalledProcessError) as err:
        manifest["headers_read"] = f"ninja -t deps failed: {err}"
    so_path = Path(spec.jit_library_path)
    manifest["eager_undefined_symbols"] = undefined_at_load(so_path)
    classified = classify_undefined(undefined_symbols(so_path), dtype_sets)
    manifest["undefined_symbols"] = {k: len(v) for k, v in classified.items()}
    manifest["undefined_symbols_of_kept_pairs"] = classified["kept_pair"]
    manifest["undefined_symbols_of_dropped_pairs"] = classified["dropped_pair"]
    manifest["undefined_symbols_without_pair"] = classified["no_pair"]
    log(f"built in {wall:.0f} s; peak host memory in use {memory.peak / GB:.1f} GB; undefined tensorrt_llm/CUTLASS "
        f"symbols: {len(classified['kept_pair'])} of kept pairs, {len(classified['dropped_pair'])} of dropped pairs, "
        f"{len(classified['no_pair'])} naming no pair")
    # Symbols of the libraries the module is loaded beside (tvm-ffi, CUDA, libc) are bound by the loader
    # from them; only FlashInfer's own (tensorrt_llm, CUTLASS, flashinfer) would be missing at load time.
    eager_all = manifest.pop("eager_undefined_symbols")
    eager_demangled = dict(undefined_symbols(so_path))
    manifest["eager_undefined_symbols"] = [s for s in eager_all if _is_ours(eager_demangled.get(s, s))
                                           or "flashinfer" in eager_demangled.get(s, s)]
    manifest["eager_undefined_external"] = [s for s in eager_all if s not in manifest["eager_undefined_symbols"]]
    if manifest["eager_undefined_symbols"]:
        raise fail(f"{len(manifest['eager_undefined_symbols'])} undefined symbols are bound at load time, "
                   f"e.g. {manifest['eager_undefined_symbols'][0]}")
    if classified["kept_pair"]:
        raise fail(f"{len(classified['kept_pair'])} undefined symbols instantiate a kept dtype pair, "
                   f"e.g. {classified['kept_pair'][0]}")

    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out))
    shutil.copy2(so_path, staging / so_target.name)
    subprocess.run(["strip", "--strip-unneeded", str(staging / so_target.name)], check=False)
    manifest["so_bytes"] = (staging / so_target.name).stat().st_size
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if smoke:
        log(f"smoke calls, one child process per set: {','.join(dtype_sets)} through cutlass_fused_moe, autotuner on")
        results = []
        for dtype_set in dtype_sets:
            results.append(smoke_in_child(staging, dtype_set))
            log(f"  {json.dumps({k: v for k, v in results[-1].items() if k != 'stderr_tail'})}")
        passed = [r["dtype_set"] for r in results if r["ok"]]
        manifest["smoke"] = {"ok": len(passed) == len(dtype_sets), "results": results}
        if not passed:
            manifest["staging"] = str(staging)
            raise fail(f"the smoke call failed for every set ({results[0].get('reason')}); the unchecked module "
                       f"is left in {staging}")
        if len(passed) < len(dtype_sets):
            # Installed for the sets that ran; the adapter refuses the others, naming this manifest.
            manifest["dtype_sets_failed_smoke"] = [d for d in dtype_sets if d not in passed]
            manifest["dtype_sets"] = passed
            log(f"installed for {passed} only: {manifest['dtype_sets_failed_smoke']} failed the smoke call")
    else:
        manifest["smoke"] = {"ok": None, "reason": "skipped (--no-smoke)"}
    manifest["installed"] = True
    os.replace(staging / so_target.name, so_target)
    write_atomic(manifest_path, json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(staging, ignore_errors=True)
    (out / "build-failed.json").unlink(missing_ok=True)
    log(f"installed {so_target} ({manifest['so_bytes'] / 2**20:.1f} MiB) and {manifest_path}")
    return manifest


# --- the runtime pack ---------------------------------------------------------------------------

PACK_LIST = "moe_fsm_pack.json"


def pack_runtime(archive: Path, header_list: Optional[Path] = None, dtype_sets: Iterable[str] = tuple(DTYPE_SETS),
                 jobs: int = 2, log: Callable[[str], None] = print) -> dict:
    """Archive FlashInfer for a machine without network: its Python, plus what a trimmed build reads.

    Leaves out ``flashinfer/data`` except: the kept sources of ``dtype_sets``, every file under
    it that their compiles include (from the compiler's dependency files: ``header_list``, a
    JSON list such as a build's ``headers_read``, or a fresh ``nvcc -M`` pass here), and the
    headers DeepGEMM's JIT compiles at run time. Experimental kernels ``import
    flashinfer.fused_moe`` does not load are left out too.
    """
    import tarfile

    import flashinfer
    import flashinfer.fused_moe  # noqa: F401  (loads what the adapter's import loads)

    root = Path(flashinfer.__file__).parent
    data_root = root / "data"
    dtype_sets = list(dtype_sets)
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", ARCH)
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    os.environ["FLASHINFER_WORKSPACE_BASE"] = tempfile.mkdtemp(prefix="moe-fsm-fi-pack-")
    _full, spec = trimmed_spec(dtype_sets)
    sources = _data_relative((str(s) for s in spec.sources), data_root)
    if header_list is not None:
        headers = set(json.loads(Path(header_list).read_text()))
        how = f"from {header_list}"
    else:
        headers = preprocess_deps(spec, jobs=jobs, log=log)
        how = "nvcc -M over the kept sources"
    runtime = {str(p.relative_to(data_root)) for d in RUNTIME_DATA_DIRS for p in (data_root / d).rglob("*") if p.is_file()}
    data_files = sorted(sources | headers | runtime)
    loaded = {Path(m.__file__).resolve() for m in list(sys.modules.values())
              if getattr(m, "__file__", None) and m.__name__.startswith("flashinfer")}
    listing = {"dtype_sets": dtype_sets, "headers_from": how, "sources": sorted(sources), "headers": sorted(headers),
               "runtime": sorted(runtime)}
    with tarfile.open(archive, "w:xz") as tar:
        for path in sorted(root.rglob("*")):
            relative = path.relative_to(root)
            if not path.is_file() or path.suffix == ".pyc" or relative.parts[0] == "data":
                continue
            if relative.parts[0] == "experimental" and path.resolve() not in loaded and path.name != "__init__.py":
                continue
            tar.add(path, arcname=str(Path("flashinfer") / relative))
        for relative in data_files:
            tar.add(data_root / relative, arcname=str(Path("flashinfer/data") / relative))
        listing_path = Path(tempfile.mkdtemp()) / PACK_LIST
        listing_path.write_text(json.dumps(listing, indent=1) + "\n")
        tar.add(listing_path, arcname=f"flashinfer/{PACK_LIST}")
        for dist in root.parent.glob("flashinfer_python-*.dist-info"):
            tar.add(dist, arcname=dist.name)
    log(f"{archive}: {archive.stat().st_size / 2**20:.1f} MiB; {len(data_files)} files of flashinfer/data "
        f"({len(sources)} sources, {len(headers)} headers {how}, {len(runtime)} read at run time)")
    return listing
