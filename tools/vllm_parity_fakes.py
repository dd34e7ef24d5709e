"""Run vLLM 0.33.0's oracles on a CPU box with only the machine facts faked.

``FakedVllm`` imports vLLM's oracle and experts modules once, then, per
scenario (``facts``), answers the questions vLLM asks of the machine from a
moe-fsm ``PlatformFacts``: vendor, CUDA capability, ROCm arch, FP8 support,
which kernel libraries import. It replaces no decision logic. What is stubbed,
and why:

* ``vllm.platforms.rocm``: its import reads the GPU's arch through a ROCm
  torch, impossible here. The stand-in's ``on_gfx*`` / ``on_cdna`` /
  ``get_cdna_version`` follow the real module's string tests on the scenario's
  arch.
* the platform object: ``current_platform`` is resolved once (vLLM's CPU
  platform on this box) and its ``__class__`` swapped per scenario for a
  subclass of vLLM's ``Platform`` interface that answers the scenario's facts
  (the same answers vLLM's CudaPlatform / RocmPlatform / XPUPlatform /
  CpuPlatform give from the device).
* library probes (``has_flashinfer_*``, ``has_deep_gemm``, ``has_humming``,
  ``IS_AITER_FOUND``...) are replaced by name in every loaded vLLM module.
* no model config is current (``get_current_vllm_config().model_config`` is
  None: the scenarios name no model, so FP8's per-model DeepGEMM auto-disable
  never applies).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import types
from types import SimpleNamespace

from moe_fsm.inputs.platform import Library, Vendor

# Every env var either side reads (vLLM 0.33's oracles and kernels; moe-fsm's profiles).
ENV_NAMES = (
    "VLLM_BATCH_INVARIANT", "VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM", "VLLM_ROCM_USE_AITER",
    "VLLM_ROCM_USE_AITER_MOE", "VLLM_B12X_MOE_FP4_FORCE_A16", "VLLM_USE_FLASHINFER_MOE_FP16",
    "VLLM_USE_FLASHINFER_MOE_FP8", "VLLM_USE_FLASHINFER_MOE_FP4", "VLLM_FLASHINFER_MOE_BACKEND",
    "VLLM_TEST_FORCE_FP8_MARLIN", "VLLM_ROCM_USE_AITER_MOE_A4W4_DSV4", "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS",
)

# vLLM's library probes -> the moe-fsm library whose presence answers them.
PROBES: dict[str, Library | None] = {
    "has_flashinfer": Library.FLASHINFER,
    "has_flashinfer_moe": Library.FLASHINFER,
    "has_flashinfer_trtllm_fused_moe": Library.FLASHINFER_TRTLLM_MOE,
    "has_flashinfer_cutlass_fused_moe": Library.FLASHINFER_CUTLASS_MOE,
    "has_flashinfer_cutedsl_grouped_gemm_nt_masked": Library.FLASHINFER_CUTEDSL_MOE,
    "has_flashinfer_cutedsl_moe_nvfp4": Library.FLASHINFER_CUTEDSL_MOE,
    "has_flashinfer_cutedsl": Library.FLASHINFER_CUTEDSL_MOE,
    "has_flashinfer_b12x_moe": Library.FLASHINFER_B12X_MOE,
    "has_deep_gemm": Library.DEEP_GEMM,
    "has_humming": Library.HUMMING,
    "has_hpc": Library.HPC,
    # Libraries moe-fsm's platform facts do not model: absent on every scenario platform.
    "has_triton_kernels": None,
    "has_zentorch_op": None,
    "has_flashinfer_situ_activation": None,
    "has_deep_ep": None,
    "has_deep_ep_v2": None,
    "has_nixl_ep": None,
    "has_mori": None,
    "has_moonep": None,
    "is_flashinfer_mxint4_moe_available": None,
    "has_flashinfer_nvlink_two_sided": None,
    "has_flashinfer_nvlink_one_sided": None,
}


class _State:
    facts = None  # the scenario's PlatformFacts


STATE = _State()


def _arch() -> str:
    return STATE.facts.gcn_arch or ""


def _rocm_module() -> types.ModuleType:
    """A stand-in for ``vllm.platforms.rocm`` answering from the scenario's arch (same string tests)."""
    mod = types.ModuleType("vllm.platforms.rocm")
    a = _arch
    on = {
        "on_gfx1x": lambda: any(x in a() for x in ("gfx11", "gfx12")) and not mod.on_cdna(),
        "on_gfx11": lambda: "gfx11" in a(),
        "on_gfx1100": lambda: "gfx1100" in a(),
        "on_gfx1151": lambda: "gfx1151" in a(),
        "on_gfx115x": lambda: "gfx115" in a(),
        "on_gfx12x": lambda: "gfx12" in a() and not mod.on_cdna(),
        "on_gfx1250": lambda: "gfx1250" in a(),
        "on_rdna4": lambda: any(x in a() for x in ("gfx1200", "gfx1201")),
        "on_mi3xx": lambda: any(x in a() for x in ("gfx942", "gfx950")),
        "on_gfx9": lambda: any(x in a() for x in ("gfx90a", "gfx942", "gfx950")),
        "on_gfx90a": lambda: "gfx90a" in a(),
        "on_gfx942": lambda: "gfx942" in a(),
        "on_gfx950": lambda: "gfx950" in a(),
        "on_cdna": lambda: any(x in a() for x in ("gfx9", "gfx1250")),
        "on_rdna": lambda: any(x in a() for x in ("gfx11", "gfx12")) and "gfx1250" not in a(),
    }
    for name, fn in on.items():
        setattr(mod, name, fn)

    def get_cdna_version() -> int:
        arch = a()
        if "gfx90a" in arch:
            return 2
        if "gfx942" in arch:
            return 3
        if "gfx950" in arch:
            return 4
        if "gfx1250" in arch:
            return 5
        return 0

    mod.get_cdna_version = get_cdna_version
    mod.get_rdna_version = lambda: 4 if mod.on_rdna4() else (3 if "gfx11" in a() else 0)
    mod._GCN_ARCH = ""
    return mod


class FakedVllm:
    def __init__(self, families: list[str]):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
        sys.modules["vllm.platforms.rocm"] = _rocm_module()
        import torch

        from vllm.platforms import current_platform
        from vllm.platforms.interface import CpuArchEnum, DeviceCapability, Platform, PlatformEnum

        self.torch = torch
        self.platform = current_platform
        self._classes = {}
        self._Platform, self._Enum, self._Cap, self._Arch = Platform, PlatformEnum, DeviceCapability, CpuArchEnum
        torch.cpu._is_amx_tile_supported = lambda: False
        self.modules = {name: importlib.import_module(name) for name in families}
        # Import every experts class the oracles can name, so the probes below reach them.
        for name, mod in self.modules.items():
            enum = next(v for k, v in vars(mod).items() if k.lower().endswith("moebackend") and isinstance(v, type))
            for backend in enum:
                with contextlib.suppress(Exception):
                    mod.backend_to_kernel_cls(backend)
        import vllm._aiter_ops as aiter_ops
        import vllm.config.vllm as vllm_config

        self.aiter = aiter_ops
        vllm_config._current_vllm_config = SimpleNamespace(
            model_config=None, weight_transfer_config=None,
            parallel_config=SimpleNamespace(enable_dbo=False, enable_eplb=False))
        self._patch_probes()

        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import (
            FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType,
        )
        from vllm.model_executor.layers.quantization.utils import quant_utils

        self.MoEActivation, self.FusedMoEConfig, self.FusedMoEParallelConfig = MoEActivation, FusedMoEConfig, FusedMoEParallelConfig
        self.RoutingMethodType = RoutingMethodType
        self.qu = quant_utils

    # -- probes ---------------------------------------------------------------

    def _patch_probes(self) -> None:
        def probe(library):
            return lambda *a, **k: library is not None and library in STATE.facts.libraries

        def cutlass_group_gemm_supported(*args):
            # vllm._custom_ops.cutlass_group_gemm_supported: capability 9.0..10.x, answered by the compiled ops.
            cap = STATE.facts.capability
            return Library.VLLM_OPS in STATE.facts.libraries and cap is not None and (9, 0) <= cap < (11, 0)

        import vllm.utils.deep_gemm as deep_gemm

        # functools.cache'd in vLLM (one machine per process): re-evaluated per scenario, uncached. Kept from the
        # first call, so that patching again (after more of vLLM was imported) finds it.
        if not hasattr(self, "_is_deep_gemm_supported"):
            self._is_deep_gemm_supported = deep_gemm.is_deep_gemm_supported.__wrapped__
        is_deep_gemm_supported = self._is_deep_gemm_supported
        special = {"cutlass_group_gemm_supported": cutlass_group_gemm_supported,
                   "cpu_has_amx_fp8": lambda *a: False,
                   "is_deep_gemm_supported": lambda: is_deep_gemm_supported()}
        for name, module in list(sys.modules.items()):
            if not name.startswith("vllm") or module is None:
                continue
            for attr, library in PROBES.items():
                if hasattr(module, attr):
                    setattr(module, attr, probe(library))
            for attr, fake in special.items():
                if hasattr(module, attr) and callable(getattr(module, attr)):
                    setattr(module, attr, fake)

    # -- the platform -----------------------------------------------------------

    def _platform_class(self, facts):
        key = (facts.vendor, facts.capability, facts.gcn_arch, facts.device_name)
        if key in self._classes:
            return self._classes[key]
        Platform, Enum, Cap, Arch, torch = self._Platform, self._Enum, self._Cap, self._Arch, self.torch
        enum = {Vendor.CUDA: Enum.CUDA, Vendor.ROCM: Enum.ROCM, Vendor.XPU: Enum.XPU, Vendor.CPU: Enum.CPU,
                Vendor.TPU: Enum.TPU, Vendor.OUT_OF_TREE: Enum.OOT}[facts.vendor]
        cap = Cap(*facts.capability) if facts.capability else None
        arch = facts.gcn_arch or ""
        rocm = sys.modules["vllm.platforms.rocm"]

        def supports_fp8(cls):
            if facts.vendor is Vendor.CUDA:
                return cls.has_device_capability(89)  # CudaPlatformBase.supports_fp8
            if facts.vendor is Vendor.ROCM:
                return rocm.on_cdna() or rocm.on_rdna()  # RocmPlatform.supports_fp8
            return facts.vendor is Vendor.XPU  # XPUPlatform says True; the base class False

        def is_fp8_fnuz(cls):
            return facts.vendor is Vendor.ROCM and "gfx94" in arch

        def fp8_dtype(cls):
            return torch.float8_e4m3fnuz if is_fp8_fnuz(cls) else torch.float8_e4m3fn

        def support_deep_gemm(cls):
            return facts.vendor is Vendor.CUDA and (
                cls.is_device_capability(90) or cls.is_device_capability_family(100) or cls.is_device_capability_family(120))

        attrs = {
            "_enum": enum,
            "device_name": facts.device_name,
            "device_type": {Vendor.CUDA: "cuda", Vendor.ROCM: "cuda", Vendor.XPU: "xpu", Vendor.CPU: "cpu",
                            Vendor.TPU: "tpu", Vendor.OUT_OF_TREE: "oot"}[facts.vendor],
            "get_device_capability": classmethod(lambda cls, device_id=0: cap),
            "get_device_name": classmethod(lambda cls, device_id=0: facts.device_name),
            "supports_fp8": classmethod(supports_fp8),
            "is_fp8_fnuz": classmethod(is_fp8_fnuz),
            "fp8_dtype": classmethod(fp8_dtype),
            "support_deep_gemm": classmethod(support_deep_gemm),
            "get_cpu_architecture": classmethod(lambda cls: Arch.X86),
        }
        cls = type(f"Faked{facts.vendor.value.title()}Platform", (Platform,), attrs)
        self._classes[key] = cls
        return cls

    @contextlib.contextmanager
    def facts(self, inputs, env: dict):
        STATE.facts = inputs.platform
        saved = {k: os.environ.get(k) for k in ENV_NAMES}
        for k in ENV_NAMES:
            os.environ.pop(k, None)
        for k, v in env.items():
            os.environ[k] = str(v)
        original = self.platform.__class__
        self.platform.__class__ = self._platform_class(inputs.platform)
        self.aiter.IS_AITER_FOUND = Library.AITER in inputs.platform.libraries
        try:
            with contextlib.suppress(Exception):
                self.aiter.rocm_aiter_ops.refresh_env_variables()
            yield
        finally:
            self.platform.__class__ = original
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    # -- arguments --------------------------------------------------------------

    def module(self, name: str):
        return self.modules[name]

    def quant_key(self, key):
        """moe-fsm's QuantKey -> vLLM's."""
        if key is None:
            return None
        qu = self.qu
        if key.dtype == "nvfp4":
            return qu.kNvfp4Static if key.static else qu.kNvfp4Dynamic
        table = {
            ("tensor", True): qu.kFp8StaticTensorSym,
            ("tensor", False): qu.kFp8DynamicTensorSym,
            ("channel", True): qu.kFp8StaticChannelSym,
            ("token", True): qu.kFp8StaticTokenSym,
            ("token", False): qu.kFp8DynamicTokenSym,
            ("block128x128", True): qu.kFp8Static128BlockSym,
            ("group1x128", False): qu.kFp8Dynamic128Sym,
        }
        return table[(key.granularity.value, key.static)]

    def moe_config(self, inputs):
        layer, par = inputs.layer, inputs.parallel
        # FusedMoEParallelConfig.make: TP is flattened across DP; with EP every rank holds whole experts.
        use_ep = par.ep_size > 1
        flat = par.tp_size * par.dp_size
        parallel = self.FusedMoEParallelConfig(
            tp_size=1 if use_ep else flat, pcp_size=1, dp_size=par.dp_size, ep_size=flat if use_ep else 1,
            tp_rank=0, pcp_rank=0, dp_rank=0, ep_rank=0, sp_size=1, use_ep=use_ep,
            all2all_backend=par.all2all.value, enable_eplb=False,
        )
        dtype = getattr(self.torch, layer.dtype)
        request = inputs.request.for_family(layer.quant.family)
        return self.FusedMoEConfig(
            num_experts=layer.num_experts,
            experts_per_token=layer.top_k,
            hidden_dim=layer.hidden_size,
            intermediate_size=layer.intermediate_size,
            num_local_experts=max(1, layer.num_experts // (flat if use_ep else 1)),
            num_logical_experts=layer.num_experts,
            activation=self.MoEActivation(layer.activation.value),
            device="cpu",
            routing_method=self.RoutingMethodType.Renormalize,
            moe_parallel_config=parallel,
            in_dtype=dtype,
            moe_backend=request,
            is_lora_enabled=layer.lora,
            swiglu_limit=layer.swiglu_limit,
        )
