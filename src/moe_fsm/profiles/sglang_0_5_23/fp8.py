"""SGLang 0.5.23's FP8 MoE methods and their runner choice.

- ``fp8`` (``Fp8MoEMethod.create_moe_runner``, ``layers/quantization/fp8.py``): auto becomes deep_gemm when
  ``is_deepgemm_moe_runner_backend_enabled`` (a DeepEP, Mooncake or NIXL all-to-all with DeepGEMM's JIT on),
  else aiter on ROCm with SGLANG_USE_AITER or SGLANG_INT4_WEIGHT under an all-to-all AITER supports, else
  triton; flashinfer_cutlass and flashinfer_cutedsl (pinned for NVFP4 experts) run its FP8 experts on triton;
  deep_gemm, triton, aiter, the TRT-LLM runners, hpc_ops and flashinfer_megamoe build a ``MoeRunner``, any
  other runner is a kernel the method calls directly. MXFP8 checkpoints use the same method (``mxfp8.py``).
- ``compressed-tensors`` (``CompressedTensorsW8A8Fp8MoE``): auto becomes aiter for per-channel weights on ROCm
  with SGLANG_USE_AITER, else triton; aiter, triton and the TRT-LLM runners build a runner; any other runner
  builds none and the layer fails at its first forward.
- ``modelopt_fp8`` (``ModelOptFp8MoEMethod``): flashinfer_cutlass builds FlashInfer CUTLASS, anything else
  Triton (a declared routing method would report flashinfer_trtllm for the TRT-LLM runner; moe-fsm's inputs
  declare none).
"""

from __future__ import annotations

from moe_fsm.fsm.runner_steps import First, Rule, is_
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.backends.requirements import Condition, CudaCapability
from moe_fsm.inputs.platform import Vendor
from moe_fsm.profiles.sglang_0_5_23.facts import (
    AITER, AITER_OR_HIP_INT4, FP8_BLOCK_128, FP8_CHANNEL_WEIGHTS, HIP, JIT_DEEPGEMM, MXFP8_LAYER, env_on, negated,
)
from moe_fsm.profiles.sglang_0_5_23.kernels import sglang_policy
from moe_fsm.profiles.sglang_0_5_23.layer import (
    A2A, AITER_A2A, AS_RESOLVED, KIND, MOE_RUNNER, RUNNER, direct, layer_is, runner_at,
)

FP8_RUNNER_BACKENDS = ("deep_gemm", "triton", "aiter", "flashinfer_trtllm", "experimental_sgl_trtllm",
                       "flashinfer_trtllm_routed", "hpc_ops", "flashinfer_megamoe")
_AUTO = is_(RUNNER, "auto")

BLOCK_QUANT = Condition("block-quantized weights (128x128 block FP8, or MXFP8's 1x32)",
                        lambda ctx: FP8_BLOCK_128.holds(ctx) or MXFP8_LAYER.holds(ctx), "the weights are not blocks")
CUTLASS_FP8 = Condition("cutlass_fp8_supported(): CUDA with capability 9.0+ or 8.9",
                        lambda ctx: ctx.platform.vendor is Vendor.CUDA
                        and (ctx.platform.has_capability(9, 0) or ctx.platform.is_capability(8, 9)),
                        "not CUDA with capability 9.0+ or 8.9")
CUTLASS_FP8_GPUS = CudaCapability(families=(9, 10, 12))

FP8_METHOD_RULES = (
    # Fp8MoEMethod.__init__: the cutlass runner's asserts, then create_weights's ROCm INT4 path
    Rule("cutlass needs cutlass_fp8_supported()", when=(is_(RUNNER, "cutlass"), negated(CUTLASS_FP8)),
         fail="cutlass_fp8 MoE requires CUDA 12.0+ with SM90 or CUDA 12.4+ with SM89"),
    Rule("cutlass needs block quantization", when=(is_(RUNNER, "cutlass"), negated(BLOCK_QUANT)),
         fail="cutlass_fp8 MoE requires block quantization"),
    Rule("cutlass needs SM90, SM100 or SM120", when=(is_(RUNNER, "cutlass"), negated(CUTLASS_FP8_GPUS)),
         fail="cutlass_fp8 MoE requires SM90, SM100, or SM120 GPUs"),
    Rule("create_weights: block weights with SGLANG_INT4_WEIGHT on ROCm reach an unset scale (SGLang's bug)",
         when=(HIP, env_on("SGLANG_INT4_WEIGHT"), BLOCK_QUANT),
         fail="Fp8MoEMethod.create_weights fails for block weights with SGLANG_INT4_WEIGHT on ROCm (UnboundLocalError: "
              "cannot access local variable 'w13_weight_scale1')"),
    First((
        Rule("auto with a DeepEP, Mooncake or NIXL all-to-all and DeepGEMM's JIT on "
             "(is_deepgemm_moe_runner_backend_enabled) -> deep_gemm",
             when=(_AUTO, is_(A2A, "deepep", "mooncake", "nixl"), JIT_DEEPGEMM), sets=direct("deep_gemm")),
        Rule("auto on ROCm with SGLANG_USE_AITER or SGLANG_INT4_WEIGHT, under an all-to-all AITER supports -> aiter",
             when=(_AUTO, AITER_OR_HIP_INT4, is_(A2A, *AITER_A2A)), sets=direct("aiter")),
        Rule("auto -> triton", when=(_AUTO,), sets=direct("triton")),
        Rule("an explicit runner is taken as it is", sets=direct(AS_RESOLVED)),
    )),
    Rule("flashinfer_cutlass and flashinfer_cutedsl have no FP8 MoE path: this layer's FP8 experts run on triton",
         when=(layer_is("flashinfer_cutlass", "flashinfer_cutedsl"),), sets=direct("triton")),
    Rule("these runners build a MoeRunner; any other is a kernel the method calls directly",
         when=(layer_is(*FP8_RUNNER_BACKENDS),), sets={KIND: MOE_RUNNER}),
)

COMPRESSED_TENSORS_RULES = (
    First((
        Rule("auto, per-channel weights, SGLANG_USE_AITER on ROCm, under an all-to-all AITER supports -> aiter",
             when=(_AUTO, AITER, FP8_CHANNEL_WEIGHTS, is_(A2A, *AITER_A2A)), sets=runner_at("aiter")),
        Rule("auto -> triton", when=(_AUTO,), sets=runner_at("triton")),
        Rule("aiter, triton and the TRT-LLM runners are built as they are",
             when=(is_(RUNNER, "aiter", "triton", "flashinfer_trtllm", "experimental_sgl_trtllm",
                       "flashinfer_trtllm_routed"),), sets=runner_at(AS_RESOLVED)),
        Rule("any other runner builds nothing (the method's TODO): the layer has no runner and fails at its "
             "first forward", fail="CompressedTensorsW8A8Fp8MoE builds no MoE runner for --moe-runner-backend "
                                   "{moe_runner_backend}: the layer has no runner and fails at its first forward"),
    )),
)

MODELOPT_FP8_RULES = (
    First((
        Rule("flashinfer_cutlass -> FLASHINFER_CUTLASS", when=(is_(RUNNER, "flashinfer_cutlass"),),
             sets=runner_at("flashinfer_cutlass")),
        Rule("anything else -> TRITON", sets=runner_at("triton")),
    )),
)

# What Fp8MoEMethod can build or call: an explicit runner as it is (flashinfer_cutlass only through ModelOpt FP8;
# flashinfer_megamoe only for MXFP8, mxfp8.py, since the FlashInfer MegaMOE all-to-all refuses standard FP8)
RUNNERS = ("triton", "deep_gemm", "aiter", "flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutlass",
           "hpc_ops", "cutlass", "marlin", "humming", "triton_kernel", "flashinfer_mxfp4", "intel_xpu")

POLICY = sglang_policy(QuantFamily.FP8, "FP8", {"fp8": FP8_METHOD_RULES, "compressed-tensors": COMPRESSED_TENSORS_RULES,
                                                 "modelopt_fp8": MODELOPT_FP8_RULES}, RUNNERS)
