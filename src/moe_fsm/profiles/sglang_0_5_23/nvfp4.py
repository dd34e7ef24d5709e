"""SGLang 0.5.23's NVFP4 MoE methods and their runner choice.

``modelopt_fp4`` (``ModelOptNvFp4FusedMoEMethod.create_moe_runner``, ``layers/quantization/modelopt_quant.py``):
auto becomes marlin (W4A16) on CUDA from SM80 up to SM9x, else flashinfer_trtllm; under the megamoe
all-to-all the method builds no runner (the block calls DeepGEMM's MegaMoE), cutlass is refused, and every
other runner builds a ``MoeRunner``.

``compressed-tensors`` (``CompressedTensorsConfig.get_moe_scheme``): weight-only NVFP4 takes the FP4 Marlin
scheme; W4A4 on capability 10.0 or newer takes ``CompressedTensorsW4A4Nvfp4MoE`` (TRT-LLM when the runner is
flashinfer_trtllm, else FlashInfer CUTLASS), below it the FP4 Marlin scheme, weight-only.
"""

from __future__ import annotations

from moe_fsm.backends.requirements import Condition, CudaCapability
from moe_fsm.errors import NoBackendError
from moe_fsm.fsm.runner_steps import First, Rule, is_, is_not
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.sglang_0_5_23.facts import AMPERE_TO_HOPPER, BLACKWELL, CUDA, negated
from moe_fsm.profiles.sglang_0_5_23.kernels import sglang_policy
from moe_fsm.profiles.sglang_0_5_23.layer import (
    A2A, AS_RESOLVED, KIND, MEGAMOE_RUNS, MOE_RUNNER, RUNNER, direct, layer_is, runner_at,
)

_AUTO = is_(RUNNER, "auto")
W4A16 = Condition("weight-only NVFP4 (W4A16: no activation quantization)",
                  lambda ctx: ctx.layer.quant.activation is None, "NVFP4 activations (W4A4)")
SM100_OR_NEWER = CudaCapability(minimum=(10, 0))

NOT_BLACKWELL = negated(BLACKWELL, "not a Blackwell GPU (SM100, SM110 or SM120)")
NVFP4_PLATFORM = ("Current platform does not support NVFP4 quantization with the selected MoE backend. Please use "
                  "Blackwell and above, or use moe_runner_backend=marlin on SM80+.")

MODELOPT_FP4_RULES = (
    # ModelOptNvFp4FusedMoEMethod.__init__: off Blackwell only the Marlin fallback runs NVFP4
    Rule("off Blackwell, auto on CUDA needs (8, 0) <= capability < (10, 0) for the Marlin fallback",
         when=(NOT_BLACKWELL, _AUTO, CUDA, negated(AMPERE_TO_HOPPER)), fail=NVFP4_PLATFORM),
    Rule("off Blackwell, auto elsewhere than CUDA has no NVFP4 runner", when=(NOT_BLACKWELL, _AUTO, negated(CUDA)),
         fail=NVFP4_PLATFORM),
    Rule("off Blackwell, an explicit runner must be marlin", when=(NOT_BLACKWELL, is_not(RUNNER, "auto", "marlin",
                                                                                          "experimental_sgl_marlin")),
         fail=NVFP4_PLATFORM),
    Rule("weight-only NVFP4 under ModelOpt (modelopt_mixed's W4A16_NVFP4 layers) is not modelled", when=(W4A16,),
         fail="moe-fsm's sglang-0.5.23 profile does not model ModelOpt W4A16 NVFP4 MoE layers", error=NoBackendError),
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

COMPRESSED_TENSORS_RULES = (
    Rule("moe-fsm models compressed-tensors NVFP4 on CUDA only (its capability check reads the CUDA capability)",
         when=(negated(CUDA),),
         fail="moe-fsm's sglang-0.5.23 profile models compressed-tensors NVFP4 MoE on CUDA only",
         error=NoBackendError),
    First((
        Rule("NVFP4 weights without activation quantization -> CompressedTensorsW4A16Nvfp4MoE (Marlin)",
             when=(W4A16,), sets=runner_at("marlin")),
        Rule("W4A4 on capability 10.0 or newer with flashinfer_trtllm -> CompressedTensorsW4A4Nvfp4MoE on TRT-LLM",
             when=(SM100_OR_NEWER, is_(RUNNER, "flashinfer_trtllm", "experimental_sgl_trtllm")),
             sets=runner_at("flashinfer_trtllm")),
        Rule("W4A4 on capability 10.0 or newer -> CompressedTensorsW4A4Nvfp4MoE on FlashInfer CUTLASS",
             when=(SM100_OR_NEWER,), sets=runner_at("flashinfer_cutlass")),
        Rule("W4A4 below capability 10.0 is served weight-only by FP4 Marlin (activation quantization ignored)",
             sets=runner_at("marlin")),
    )),
)

# What the NVFP4 methods can build (hpc_ops is refused before, intel_xpu by MoeRunner)
RUNNERS = ("marlin", "flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutlass", "flashinfer_cutedsl",
           "flashinfer_mxfp4", "flashinfer_megamoe", "triton", "triton_kernel", "deep_gemm", "aiter", "humming",
           "megamoe")

POLICY = sglang_policy(QuantFamily.NVFP4, "NVFP4", {"modelopt_fp4": MODELOPT_FP4_RULES,
                                                     "compressed-tensors": COMPRESSED_TENSORS_RULES}, RUNNERS)
