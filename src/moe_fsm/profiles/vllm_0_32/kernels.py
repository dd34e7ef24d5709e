"""vLLM 0.32.0's experts classes where they differ from 0.33.0's (``vllm_0_33.kernels``, ``kernels_mx_int``).

Read from the 0.32.0 wheel's ``fused_moe/experts/*.py``:

* ``rocm_aiter_moe.py``: one ``AiterExperts`` class serves every AITER backend (0.33 split it into
  ``AiterUnquantizedExperts``, ``AiterFp8{Block,Tensor,Channel}Experts``, ``AiterMxfp4Experts``); its
  quantization schemes are their union, MXFP4 only on gfx950 (not gfx1250), and no gfx942 INT4 requant.
* ``cpu_moe.py``: ``CPUExpertsFp8`` takes SiLU only, ``CPUExpertsMxfp4`` SiLU and SwiGLU-OAI only, and
  ``CPUExpertsInt8`` also needs a per-partition intermediate size divisible by 32.
* ``aiter_mxfp8_moe.py``: ``AiterMxfp8Experts`` hard-codes the uninterleaved SwiGLU-OAI activation, which no
  layer moe-fsm describes has, so it refuses every one (0.33 added SiLU).
* ``aiter_mxfp4_w4a4_moe.py`` (AiterW4A4ExpertsMonolithic) and ``TrtLlmMxfp4LoRAExperts`` do not exist yet.
"""

from __future__ import annotations

from dataclasses import replace

from moe_fsm.backends.requirements import Condition, NoLoRA, QuantSchemes
from moe_fsm.backends.specs import KernelSpec
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.quant import MXFP4_DYNAMIC, MXFP4_STATIC
from moe_fsm.profiles.vllm_0_33.kernels import (
    AITER_ENABLED, ALL, FP8_BLOCK, FP8_CHANNEL_TOKEN, FP8_TENSOR_DYNAMIC, FP8_TENSOR_STATIC, NO_FI_A2A,
    NOT_BATCH_INVARIANT, SILU, SILU_SWIGLUOAI, STANDARD, UNQUANTIZED, intermediate_per_partition,
)
from moe_fsm.profiles.vllm_0_33 import PROFILE as V033

DROPPED = ("AiterUnquantizedExperts", "AiterFp8BlockExperts", "AiterFp8TensorExperts", "AiterFp8ChannelExperts",
           "AiterMxfp4Experts", "AiterW4A4ExpertsMonolithic", "TrtLlmMxfp4LoRAExperts")


def _gfx950_not_1250(ctx) -> bool:
    arch = ctx.platform.gcn_arch or ""
    return "gfx950" in arch and "gfx1250" not in arch


AITER_EXPERTS = KernelSpec(
    "AiterExperts", ActivationFormat.STANDARD,
    (AITER_ENABLED, ALL,
     QuantSchemes((UNQUANTIZED, FP8_BLOCK, FP8_TENSOR_STATIC, FP8_TENSOR_DYNAMIC, FP8_CHANNEL_TOKEN), gated=(
         ("MXFP4 on ROCm gfx950 (not gfx1250)", _gfx950_not_1250, ((MXFP4_STATIC, None), (MXFP4_STATIC, MXFP4_DYNAMIC))),
     )),
     NO_FI_A2A, STANDARD, NOT_BATCH_INVARIANT, NoLoRA()),
    library_note="AMD's AITER fused MoE (aiter), one class for every AITER backend",
)

CPU_INT8_INTERMEDIATE = Condition(
    "per-partition intermediate size divisible by 32", lambda ctx: intermediate_per_partition(ctx) % 32 == 0,
    "kernel requires intermediate dim divisible by 32")
AITER_MXFP8_ACTIVATION = Condition(
    "the uninterleaved SwiGLU-OAI activation (not a layer activation moe-fsm describes)", lambda ctx: False,
    lambda ctx: "kernel hardcodes SwiGLU-OAI activation and requires activation=swigluoai_uninterleave; "
                f"got activation={ctx.layer.activation.value}")


def _replace_activations(name: str, activations) -> KernelSpec:
    spec = V033.kernels[name]
    kinds = type(activations)
    return replace(spec, requirements=tuple(activations if isinstance(r, kinds) else r for r in spec.requirements))


def _aiter_mxfp8() -> KernelSpec:
    spec = V033.kernels["AiterMxfp8Experts"]
    reqs = tuple(AITER_MXFP8_ACTIVATION if r.describe().startswith("SiLU (or SwiGLU-OAI") else r
                 for r in spec.requirements)
    return replace(spec, requirements=reqs)


KERNELS: tuple[KernelSpec, ...] = (
    AITER_EXPERTS,
    _replace_activations("CPUExpertsFp8", SILU),
    _replace_activations("CPUExpertsMxfp4", SILU_SWIGLUOAI),
    replace(V033.kernels["CPUExpertsInt8"],
            requirements=(*V033.kernels["CPUExpertsInt8"].requirements, CPU_INT8_INTERMEDIATE)),
    _aiter_mxfp8(),
)
