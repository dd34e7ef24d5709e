"""Facts about the machine a layer will run on.

Support predicates read only these facts, never the live machine, so a
decision can be replayed elsewhere and "what would an H100 pick?" is a
question with an answer on a laptop. ``probe()`` is the one place that looks
at the real machine.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from functools import lru_cache
from typing import Mapping

from moe_fsm.inputs.hashing import computed_once, hashed_once
from moe_fsm.errors import InputError


class Vendor(str, Enum):
    CUDA = "cuda"
    ROCM = "rocm"
    XPU = "xpu"
    CPU = "cpu"
    TPU = "tpu"
    OUT_OF_TREE = "oot"


class Library(str, Enum):
    """Kernel libraries and entry points a backend may need importable."""

    TRITON = "triton"
    FLASHINFER = "flashinfer"
    FLASHINFER_CUTLASS_MOE = "flashinfer.cutlass_fused_moe"
    FLASHINFER_TRTLLM_MOE = "flashinfer.trtllm_fused_moe"
    FLASHINFER_CUTEDSL_MOE = "flashinfer.cutedsl_moe"
    FLASHINFER_B12X_MOE = "flashinfer.b12x_moe"
    DEEP_GEMM = "deep_gemm"
    AITER = "aiter"
    VLLM_OPS = "vllm._custom_ops"
    TORCH_GROUPED_MM = "torch._grouped_mm"
    TORCH_SCALED_GROUPED_MM = "torch._scaled_grouped_mm"
    HUMMING = "humming"  # the humming mixed-precision GEMM library
    HPC = "hpc"
    B12X = "b12x"
    TRITON_KERNELS = "triton_kernels"  # OpenAI's triton_kernels (gpt-oss MXFP4 MoE)
    AMD_QUARK = "quark"  # amd-quark (vLLM's OCP MX emulation)
    ZENTORCH = "zentorch"  # AMD's zentorch CPU ops
    VLLM_CPU_INT8_MOE = "torch.ops._C.cpu_fused_moe_int8"  # vLLM's Arm/POWER CPU INT8 MoE op
    VLLM_RDNA3_MOE = "torch.ops._rocm_C.moe_gptq_gemm_rdna3"  # vLLM's RDNA3 GPTQ MoE op
    TORCH_DYN_QUANT_4BIT = "torch.ops.aten._dyn_quant_matmul_4bit"  # torch's KleidiAI 4-bit ops


@hashed_once
@dataclass(frozen=True)
class PlatformFacts:
    """Vendor, device capability and importable libraries.

    ``capability`` is the CUDA compute capability (major, minor); ``gcn_arch`` the
    ROCm architecture (e.g. gfx942). Both are None elsewhere. On a CPU,
    ``cpu_arch`` is vLLM's ``get_cpu_architecture()`` (x86, arm, powerpc; None:
    not known) and ``cpu_amx`` whether the cores have AMX tiles, which vLLM's
    x86 CPU MoE kernels need.

    ``probe_override`` names the preset that ``MOE_FSM_PLATFORM`` put in place of
    the probe (None: the facts were read off the machine, or given by the caller).
    It is part of the record, so a trace says the machine did not decide them.
    """

    vendor: Vendor = Vendor.CPU
    capability: tuple[int, int] | None = None
    gcn_arch: str | None = None
    device_name: str = "cpu"
    libraries: frozenset[Library] = field(default_factory=frozenset)
    cpu_arch: str | None = None
    cpu_amx: bool = False
    probe_override: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.vendor, Vendor):
            try:
                object.__setattr__(self, "vendor", Vendor(self.vendor))
            except (ValueError, TypeError):
                raise InputError(f"vendor {self.vendor!r} is not one of {[v.value for v in Vendor]}") from None
        if self.capability is not None:
            cap = tuple(self.capability) if isinstance(self.capability, (tuple, list)) else None
            if cap is None or len(cap) != 2 or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cap):
                raise InputError(f"capability must be (major, minor) integers, got {self.capability!r}")
            object.__setattr__(self, "capability", cap)
        if self.gcn_arch is not None and not isinstance(self.gcn_arch, str):
            raise InputError(f"gcn_arch must be a string like 'gfx942' or None, got {self.gcn_arch!r}")
        if not isinstance(self.device_name, str):
            raise InputError(f"device_name must be a string, got {self.device_name!r}")
        if isinstance(self.libraries, (str, bytes)) or not isinstance(self.libraries, (set, frozenset, list, tuple)):
            raise InputError(f"libraries must be a set of library names, got {self.libraries!r}")
        if self.vendor is Vendor.CUDA and self.capability is None:
            raise InputError("a CUDA platform needs its compute capability, e.g. (9, 0)")
        if self.vendor is not Vendor.CUDA and self.capability is not None:
            raise InputError(f"capability is a CUDA fact; vendor {self.vendor.value} has none")
        if self.cpu_arch is not None and self.cpu_arch not in CPU_ARCHES:
            raise InputError(f"cpu_arch {self.cpu_arch!r} is not one of {list(CPU_ARCHES)} (or None)")
        if self.probe_override is not None and self.probe_override not in PRESETS:
            raise InputError(f"probe_override {self.probe_override!r} is not a platform preset: {sorted(PRESETS)} (or None)")
        if (self.cpu_arch is not None or self.cpu_amx) and self.vendor is not Vendor.CPU:
            raise InputError(f"cpu_arch and cpu_amx are CPU facts; vendor {self.vendor.value} has neither")
        libs = set()
        for lib in self.libraries:
            try:
                libs.add(lib if isinstance(lib, Library) else Library(lib))
            except (ValueError, TypeError):
                raise InputError(f"library {lib!r} is not one of {[l.value for l in Library]}") from None
        object.__setattr__(self, "libraries", frozenset(libs))

    # The three capability questions vLLM's predicates ask.
    def is_capability(self, major: int, minor: int) -> bool:
        return self.capability == (major, minor)

    def is_capability_family(self, major: int) -> bool:
        return self.capability is not None and self.capability[0] == major

    def has_capability(self, major: int, minor: int = 0) -> bool:
        return self.capability is not None and self.capability >= (major, minor)

    def has(self, library: Library) -> bool:
        return library in self.libraries

    @property
    def supports_fp8(self) -> bool:
        """FP8 tensor-core math: CUDA 8.9+ or ROCm MI300-class (gfx94x/gfx95x)."""
        if self.vendor is Vendor.CUDA:
            return self.has_capability(8, 9)
        return self.vendor is Vendor.ROCM and (self.gcn_arch or "").startswith(("gfx94", "gfx95"))

    @computed_once
    def describe(self) -> str:
        if self.vendor is Vendor.CUDA:
            return f"CUDA {self.capability[0]}.{self.capability[1]} ({self.device_name})"
        if self.vendor is Vendor.ROCM:
            return f"ROCm {self.gcn_arch} ({self.device_name})"
        return f"{self.vendor.value} ({self.device_name})"

    def capability_text(self) -> str:
        if self.capability is None:
            return f"a {self.vendor.value} platform with no CUDA capability"
        return f"{self.capability[0]}.{self.capability[1]}"

    @computed_once
    def to_json(self) -> dict:
        """Built once (a process probes its platform once and records it in every trace); read-only."""
        return {
            "vendor": self.vendor.value,
            "capability": list(self.capability) if self.capability else None,
            "gcn_arch": self.gcn_arch,
            "device_name": self.device_name,
            "libraries": sorted(lib.value for lib in self.libraries),
            **({"cpu_arch": self.cpu_arch} if self.cpu_arch is not None else {}),
            **({"cpu_amx": True} if self.cpu_amx else {}),
            **({"probe_override": self.probe_override} if self.probe_override is not None else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> "PlatformFacts":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"unknown platform field(s) {unknown}; accepted: {sorted(known)}")
        values = dict(data)
        if values.get("capability") is not None:
            values["capability"] = tuple(values["capability"])
        values["libraries"] = frozenset(values.get("libraries", ()))
        return cls(**values)


CPU_ARCHES = ("x86", "arm", "powerpc")

_FLASHINFER_ALL = frozenset({
    Library.FLASHINFER, Library.FLASHINFER_CUTLASS_MOE, Library.FLASHINFER_TRTLLM_MOE,
    Library.FLASHINFER_CUTEDSL_MOE, Library.FLASHINFER_B12X_MOE,
})
_CUDA_COMMON = frozenset({Library.TRITON, Library.VLLM_OPS})
_GROUPED_MM = frozenset({Library.TORCH_GROUPED_MM, Library.TORCH_SCALED_GROUPED_MM})

PRESETS: dict[str, PlatformFacts] = {
    "sm80": PlatformFacts(Vendor.CUDA, (8, 0), None, "NVIDIA A100", _CUDA_COMMON | {Library.FLASHINFER, Library.TORCH_GROUPED_MM}),
    "sm89": PlatformFacts(Vendor.CUDA, (8, 9), None, "NVIDIA L40S", _CUDA_COMMON | {Library.FLASHINFER}),
    "sm90": PlatformFacts(Vendor.CUDA, (9, 0), None, "NVIDIA H100", _CUDA_COMMON | _FLASHINFER_ALL | _GROUPED_MM | {Library.DEEP_GEMM}),
    "sm90-bare": PlatformFacts(Vendor.CUDA, (9, 0), None, "NVIDIA H100 (torch and triton only)", frozenset({Library.TRITON}) | _GROUPED_MM),
    "sm100": PlatformFacts(Vendor.CUDA, (10, 0), None, "NVIDIA B200", _CUDA_COMMON | _FLASHINFER_ALL | _GROUPED_MM | {Library.DEEP_GEMM}),
    "sm120": PlatformFacts(Vendor.CUDA, (12, 0), None, "NVIDIA RTX PRO 6000", _CUDA_COMMON | _FLASHINFER_ALL | _GROUPED_MM),
    "sm121": PlatformFacts(Vendor.CUDA, (12, 1), None, "NVIDIA GB10 (DGX Spark)", _CUDA_COMMON | _FLASHINFER_ALL | _GROUPED_MM),
    "rocm-mi300": PlatformFacts(Vendor.ROCM, None, "gfx942", "AMD Instinct MI300X", frozenset({Library.TRITON, Library.AITER, Library.VLLM_OPS})),
    "rocm-mi355": PlatformFacts(Vendor.ROCM, None, "gfx950", "AMD Instinct MI355X", frozenset({Library.TRITON, Library.AITER, Library.VLLM_OPS})),
    "xpu": PlatformFacts(Vendor.XPU, None, None, "Intel Data Center GPU Max", frozenset({Library.TRITON})),
    "cpu": PlatformFacts(Vendor.CPU, None, None, "cpu", frozenset()),
    "cpu-x86": PlatformFacts(Vendor.CPU, None, None, "x86 CPU", frozenset({Library.TORCH_DYN_QUANT_4BIT}), "x86"),
    "cpu-x86-amx": PlatformFacts(Vendor.CPU, None, None, "x86 CPU with AMX (Xeon Sapphire Rapids)",
                                 frozenset({Library.TORCH_DYN_QUANT_4BIT}), "x86", True),
    "cpu-arm": PlatformFacts(Vendor.CPU, None, None, "Arm CPU (Neoverse V2)",
                             frozenset({Library.TORCH_DYN_QUANT_4BIT, Library.VLLM_CPU_INT8_MOE}), "arm"),
    "cpu-power": PlatformFacts(Vendor.CPU, None, None, "POWER10 CPU", frozenset({Library.VLLM_CPU_INT8_MOE}), "powerpc"),
    "tpu": PlatformFacts(Vendor.TPU, None, None, "TPU v5e", frozenset()),
    "oot": PlatformFacts(Vendor.OUT_OF_TREE, None, None, "out-of-tree platform plugin", frozenset()),
}


def preset(name: str) -> PlatformFacts:
    try:
        return PRESETS[name]
    except KeyError:
        raise InputError(f"platform preset {name!r} is not one of {sorted(PRESETS)} (or 'probe')") from None


def with_libraries(facts: PlatformFacts, add: set[Library] = frozenset(), remove: set[Library] = frozenset()) -> PlatformFacts:
    """A what-if variant: the same machine with libraries installed or removed."""
    return replace(facts, libraries=(facts.libraries | frozenset(add)) - frozenset(remove))


# Where each library's entry point lives: (module, attribute or None).
_ENTRY_POINTS: dict[Library, tuple[str, str | None]] = {
    Library.TRITON: ("triton", None),
    Library.FLASHINFER: ("flashinfer", None),
    Library.FLASHINFER_CUTLASS_MOE: ("flashinfer.fused_moe", "cutlass_fused_moe"),
    Library.FLASHINFER_TRTLLM_MOE: ("flashinfer.fused_moe", "trtllm_fp8_block_scale_moe"),
    Library.FLASHINFER_CUTEDSL_MOE: ("flashinfer.cute_dsl", "grouped_gemm_nt_masked"),
    Library.FLASHINFER_B12X_MOE: ("flashinfer.fused_moe", "B12xNvfp4Runner"),
    Library.DEEP_GEMM: ("deep_gemm", None),
    Library.AITER: ("aiter", None),
    Library.VLLM_OPS: ("vllm._custom_ops", None),
    Library.HUMMING: ("humming", None),
    Library.HPC: ("hpc", None),
    Library.B12X: ("b12x", None),
    Library.TRITON_KERNELS: ("triton_kernels", None),
    Library.AMD_QUARK: ("quark", None),
    Library.ZENTORCH: ("zentorch", None),
}
# Ops vLLM finds as torch.ops.<namespace>.<name> (registered by a compiled extension or by torch itself).
_TORCH_OPS: dict[Library, tuple[str, str]] = {
    Library.VLLM_CPU_INT8_MOE: ("_C", "cpu_fused_moe_int8"),
    Library.VLLM_RDNA3_MOE: ("_rocm_C", "moe_gptq_gemm_rdna3"),
    Library.TORCH_DYN_QUANT_4BIT: ("aten", "_dyn_quant_matmul_4bit"),
}


def _importable(module: str, attribute: str | None) -> bool:
    top = module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        return False
    if module == top and attribute is None:
        return True
    try:
        mod = importlib.import_module(module)
    except Exception:
        return False
    return attribute is None or hasattr(mod, attribute)


PLATFORM_OVERRIDE_VAR = "MOE_FSM_PLATFORM"


def probe_override(environ: Mapping[str, str] = os.environ) -> PlatformFacts | None:
    """The preset ``MOE_FSM_PLATFORM`` names in place of the probe, or None when it is unset, empty or "probe".

    So a user can ask what a decision would be on another machine (``MOE_FSM_PLATFORM=cpu-x86``: an x86 CPU
    without AMX tiles) and a test suite can run as that machine; the facts carry the preset's name.
    """
    name = environ.get(PLATFORM_OVERRIDE_VAR, "").strip()
    if name in ("", "probe"):
        return None
    if name not in PRESETS:
        raise InputError(f"{PLATFORM_OVERRIDE_VAR}={name!r} is not a platform preset; accepted: {sorted(PRESETS)}, "
                         f"or 'probe' (or unset) to read this machine")
    return replace(PRESETS[name], probe_override=name)


def probe() -> PlatformFacts:
    """Read the real machine: torch's device, then which kernel entry points import.

    ``MOE_FSM_PLATFORM=<preset>`` replaces the reading with that preset (``probe_override``).
    """
    override = probe_override()
    if override is not None:
        return override
    import torch

    libraries = {lib for lib, (module, attr) in _ENTRY_POINTS.items() if _importable(module, attr)}
    if hasattr(torch, "_grouped_mm"):
        libraries.add(Library.TORCH_GROUPED_MM)
    if hasattr(torch, "_scaled_grouped_mm"):
        libraries.add(Library.TORCH_SCALED_GROUPED_MM)
    for lib, (namespace, name) in _TORCH_OPS.items():
        if _has_torch_op(torch, namespace, name):
            libraries.add(lib)
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        if torch.version.hip:
            arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
            return PlatformFacts(Vendor.ROCM, None, arch, name, frozenset(libraries))
        return PlatformFacts(Vendor.CUDA, torch.cuda.get_device_capability(0), None, name, frozenset(libraries))
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return PlatformFacts(Vendor.XPU, None, None, torch.xpu.get_device_name(0), frozenset(libraries))
    return PlatformFacts(Vendor.CPU, None, None, "cpu", frozenset(libraries), _cpu_arch(), _cpu_amx(torch))


@lru_cache(maxsize=1)
def probed_platform() -> PlatformFacts:
    """``probe()`` once per process: what ``platform=None`` and ``--platform probe`` stand for."""
    return probe()


def _has_torch_op(torch, namespace: str, name: str) -> bool:
    try:
        return hasattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False


def _cpu_arch() -> str | None:
    """vLLM's CpuArchEnum, from the machine name."""
    import platform

    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        return "x86"
    if machine.startswith(("arm", "aarch64")):
        return "arm"
    if machine.startswith(("ppc", "powerpc")):
        return "powerpc"
    return None


def _cpu_amx(torch) -> bool:
    check = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False
