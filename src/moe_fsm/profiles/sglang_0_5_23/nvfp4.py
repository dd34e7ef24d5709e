"""SGLang 0.5.23's ModelOpt NVFP4 MoE method: ``ModelOptNvFp4FusedMoEMethod.create_moe_runner``
(``layers/quantization/modelopt_quant.py``).

auto becomes marlin (W4A16) on CUDA from SM80 up to SM9x, else flashinfer_trtllm; under the megamoe
all-to-all the method builds no runner (the block calls DeepGEMM's MegaMoE), cutlass is refused, and every
other runner builds a ``MoeRunner``.
"""

from __future__ import annotations

from moe_fsm.errors import NoBackendError
from moe_fsm.fsm.runner_steps import First, Rule, is_
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.sglang_0_5_23.facts import AMPERE_TO_HOPPER
from moe_fsm.profiles.sglang_0_5_23.kernels import sglang_policy
from moe_fsm.profiles.sglang_0_5_23.layer import (
    A2A, AS_RESOLVED, KIND, MEGAMOE_RUNS, MOE_RUNNER, RUNNER, direct, layer_is,
)

_AUTO = is_(RUNNER, "auto")

MODELOPT_FP4_RULES = (
    First((
        Rule("auto on CUDA with (8, 0) <= capability < (10, 0) -> marlin", when=(_AUTO, AMPERE_TO_HOPPER),
             sets=direct("marlin")),
        Rule("auto -> flashinfer_trtllm (the most performant and tested FP4 MoE backend)", when=(_AUTO,),
             sets=direct("flashinfer_trtllm")),
        Rule("an explicit runner is taken as it is", sets=direct(AS_RESOLVED)),
    )),
    First((
        Rule("under the megamoe all-to-all the method builds no runner (FusedMoE.forward is never reached: "
             "DeepGEMM's MegaMoE runs the experts)", when=(is_(A2A, "megamoe"),), sets=MEGAMOE_RUNS),
        Rule("cutlass is not supported for NVFP4 MoE", when=(layer_is("cutlass"),),
             fail="moe_runner_backend=cutlass is not supported for NVFP4 MoE. Use --moe-runner-backend "
                  "flashinfer_cutlass instead.", error=NoBackendError),
        Rule("every other runner builds a MoeRunner", sets={KIND: MOE_RUNNER}),
    )),
)

RUNNERS = ("marlin", "flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutlass", "flashinfer_cutedsl",
           "flashinfer_mxfp4", "flashinfer_megamoe", "triton", "triton_kernel", "deep_gemm", "aiter", "humming",
           "hpc_ops", "intel_xpu", "megamoe")

POLICY = sglang_policy(QuantFamily.NVFP4, "NVFP4", {"modelopt_fp4": MODELOPT_FP4_RULES}, RUNNERS)
