"""The machine facts vLLM 0.33's MX and integer kernels ask for, answered from a scenario's PlatformFacts.

On top of tools/vllm_parity_fakes.py: the CPU's architecture and AMX tiles
(``get_cpu_architecture``, ``torch.cpu._is_amx_tile_supported``), MX support on
ROCm (``supports_mx``), the libraries and compiled ops these kernels probe
(triton_kernels, humming, amd-quark, zentorch, b12x, vLLM's CPU INT8 and RDNA3
ops, ``mxfp4_experts_quant_supported``), and FlashInfer MXINT4 availability
(vLLM's cached check, evaluated per scenario). No decision logic is replaced.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types

import vllm_parity_fakes as base
from moe_fsm.inputs.platform import Library, Vendor

EXTRA_ENV = ("VLLM_HUMMING_MOE_GEMM_TYPE", "VLLM_CPU_INT4_W4A8", "VLLM_USE_FLASHINFER_MOE_INT4",
             "VLLM_HUMMING_INPUT_QUANT_CONFIG")
base.ENV_NAMES = tuple(dict.fromkeys(base.ENV_NAMES + EXTRA_ENV))
base.PROBES.update({
    "has_triton_kernels": Library.TRITON_KERNELS,
    "has_quark": Library.AMD_QUARK,
    "has_humming": Library.HUMMING,
})


def _facts():
    return base.STATE.facts


class _Ops(types.SimpleNamespace):
    """``torch.ops._C`` / ``torch.ops._rocm_C`` as a scenario's vLLM build has them."""

    def __init__(self, ops: dict):
        super().__init__()
        self._ops = ops

    def __getattr__(self, name):
        ops = object.__getattribute__(self, "_ops")
        if name in ops and ops[name][0]():
            return ops[name][1]
        raise AttributeError(name)


def _humming_stub() -> None:
    """The humming package's GemmType, which the Humming experts name (the library is not installed here).

    Its values are the gemm-type words vLLM compares them with (get_humming_moe_gemm_type).
    """
    import enum

    if "humming" in sys.modules:
        return
    # vLLM 0.32's vllm.utils.humming monkeypatches the humming package's device info on first use (a work-around
    # for a humming bug); the stub has no device info, so that patch is marked as done.
    with contextlib.suppress(ImportError):
        import vllm.utils.humming as vllm_humming

        if hasattr(vllm_humming, "_patched"):
            vllm_humming._patched = True
    config = types.ModuleType("humming.config")
    config.GemmType = enum.Enum("GemmType", {"INDEXED": "indexed", "GROUPED_CONTIGUOUS": "grouped_contiguous",
                                             "GROUPED_MASKED": "grouped_masked"})
    package = types.ModuleType("humming")
    package.config = config
    package.__path__ = []
    sys.modules.update({"humming": package, "humming.config": config})


class Faked(base.FakedVllm):
    def __init__(self, families: list[str]):
        super().__init__(families)
        _humming_stub()  # after vLLM's imports: only the Humming experts' gemm-type check reaches for it
        import torch

        facts = _facts
        torch.cpu._is_amx_tile_supported = lambda: facts().cpu_amx
        c_ops = _Ops({
            "cpu_fused_moe_int8": (lambda: Library.VLLM_CPU_INT8_MOE in facts().libraries, lambda *a: None),
            # the compiled mxfp4_experts_quant_supported(cap): read as the SM100 family (see kernels_mx_int.py)
            "mxfp4_experts_quant_supported": (lambda: True, lambda cap: Library.VLLM_OPS in facts().libraries
                                              and facts().capability is not None and facts().capability[0] == 10),
            "cutlass_group_gemm_supported": (lambda: True, lambda cap: Library.VLLM_OPS in facts().libraries
                                             and 90 <= cap < 110),
        })
        rocm_ops = _Ops({"moe_gptq_gemm_rdna3": (lambda: Library.VLLM_RDNA3_MOE in facts().libraries, lambda *a: None)})
        torch.ops._C = c_ops
        torch.ops._rocm_C = rocm_ops
        self._patch_family_probes()

    def _patch_family_probes(self) -> None:
        import vllm.model_executor.layers.quantization.utils.flashinfer_mxint4_moe as mxint4

        if not hasattr(self, "_mxint4_available"):  # the uncached original, kept for patching again
            self._mxint4_available = mxint4.is_flashinfer_mxint4_moe_available.__wrapped__
        mxint4_available = self._mxint4_available

        def has_zentorch_op(*args, **kwargs):
            return Library.ZENTORCH in _facts().libraries

        def get_b12x_fused_moe(*args, **kwargs):
            if Library.B12X not in _facts().libraries:
                return None
            return types.SimpleNamespace(is_supported=lambda: True)

        special = {
            "is_flashinfer_mxint4_moe_available": lambda: mxint4_available(),
            "has_zentorch_op": has_zentorch_op,
            "get_b12x_fused_moe": get_b12x_fused_moe,
        }
        for name, module in list(sys.modules.items()):
            if not name.startswith("vllm") or module is None:
                continue
            for attr, fake in special.items():
                if hasattr(module, attr) and callable(getattr(module, attr)):
                    setattr(module, attr, fake)
        # No user quantization_config.moe.activation override (a config fact; moe-fsm takes the checkpoint's key).
        import vllm.model_executor.layers.fused_moe.oracle.mxfp4 as mxfp4

        mxfp4._user_moe_activation_override = lambda: None
        # AITER's gate mode is a feature of the installed aiter version: present with aiter.
        self.aiter.rocm_aiter_ops.fused_moe_supports_gate_mode = classmethod(lambda cls: True)

    def _platform_class(self, facts):
        key = ("mx-int", facts.vendor, facts.capability, facts.gcn_arch, facts.device_name, facts.cpu_arch)
        if key in self._classes:
            return self._classes[key]
        parent = super()._platform_class(facts)
        arch = {"x86": self._Arch.X86, "arm": self._Arch.ARM, "powerpc": self._Arch.POWERPC}.get(
            facts.cpu_arch, self._Arch.UNKNOWN)
        gcn = facts.gcn_arch or ""
        cls = type(parent.__name__, (parent,), {
            "get_cpu_architecture": classmethod(lambda cls: arch),
            "supports_mx": classmethod(lambda cls: facts.vendor is Vendor.ROCM
                                       and any(g in gcn for g in ("gfx95", "gfx1250"))),
        })
        self._classes[key] = cls
        return cls

    def moe_config(self, inputs):
        config = super().moe_config(inputs)
        config.has_bias = inputs.layer.bias  # gpt-oss's expert biases (FusedMoEConfig.has_bias)
        return config

    def quant_key(self, key):
        return None if key is None else super().quant_key(key)

    @contextlib.contextmanager
    def facts(self, inputs, env: dict):
        with super().facts(inputs, env):
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
            yield
