"""vLLM 0.31.0's experts classes where they differ from 0.32.0's (``vllm_0_32.kernels``, through it 0.33's).

Read from the 0.31.0 wheel's ``fused_moe/experts/*.py``:

* ``gpt_oss_triton_kernels_moe.py``: ``_triton_kernel_moe_supports_current_device`` keeps CUDA to
  ``(9, 0) <= capability < (11, 0)`` (0.32: ``< (13, 0)``), so the OAI Triton MXFP4 experts
  (``OAITritonMxfp4ExpertsMonolithic``, ``OAITritonExperts``, ``UnfusedOAITritonExperts``) refuse SM12x;
* ``cutlass_moe.py``: ``CutlassExpertsFp4._supports_parallel_config`` (and ``CutlassExpertsMxfp4``'s) is
  ``ep_size == 1``: no expert parallelism at all (0.32 accepts expert parallelism except under the FlashInfer
  NVLink or DeepEP high-throughput all-to-alls, through the expert map);
* ``flashinfer_moe_ep.py`` does not exist: no ``FlashInferMoeEpExperts``.
"""

from __future__ import annotations

from dataclasses import replace

from moe_fsm.backends.requirements import Condition, ParallelRule
from moe_fsm.backends.specs import KernelSpec
from moe_fsm.inputs.platform import Vendor
from moe_fsm.profiles.vllm_0_32 import PROFILE as V032
from moe_fsm.profiles.vllm_0_33.kernels_mx_int import TRITON_KERNELS_DEVICE, _rocm

DROPPED = ("FlashInferMoeEpExperts",)

TRITON_KERNELS_DEVICE_031 = Condition(
    "CUDA 9.0 <= capability < 11.0, or ROCm gfx9 (gfx90a, gfx94x, gfx95x) / gfx11 / gfx12",
    lambda ctx: (ctx.platform.vendor is Vendor.CUDA and (9, 0) <= ctx.platform.capability < (11, 0))
    or _rocm("gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")(ctx),
    lambda ctx: f"kernel does not support current device {ctx.platform.describe()}")
EP_SIZE_1 = ParallelRule("ep_size == 1 (no expert parallelism)", lambda p: not p.use_ep)


def _replace_requirement(name: str, old, new) -> KernelSpec:
    spec = V032.kernels[name]
    if old not in spec.requirements:
        raise ValueError(f"{name}: no requirement {old!r} to replace")
    return replace(spec, requirements=tuple(new if r is old else r for r in spec.requirements))


def _replace_parallel(name: str) -> KernelSpec:
    spec = V032.kernels[name]
    rules = [r for r in spec.requirements if isinstance(r, ParallelRule)]
    if len(rules) != 1:
        raise ValueError(f"{name}: expected one parallel rule, found {len(rules)}")
    return replace(spec, requirements=tuple(EP_SIZE_1 if r is rules[0] else r for r in spec.requirements))


KERNELS: tuple[KernelSpec, ...] = (
    *(_replace_requirement(name, TRITON_KERNELS_DEVICE[0], TRITON_KERNELS_DEVICE_031)
      for name in ("OAITritonMxfp4ExpertsMonolithic", "OAITritonExperts", "UnfusedOAITritonExperts")),
    _replace_parallel("CutlassExpertsFp4"),
    _replace_parallel("CutlassExpertsMxfp4"),
)
