"""SGLang 0.5.23's MXFP4 MoE method (checkpoint-serialized MXFP4, gpt-oss): ``Mxfp4Config.from_config`` and
``Mxfp4MoEMethod`` (``layers/quantization/mxfp4.py``).

ROCm needs a gfx95 GPU; flashinfer_mxfp4 picks its FlashInfer entry point by GPU (SM100 TRT-LLM, SM120 and SM90
CUTLASS, the SM90 one needing FlashInfer) and refuses the others. Under the megamoe all-to-all,
flashinfer_mxfp4 builds no runner. auto becomes aiter on ROCm with SGLANG_USE_AITER under an all-to-all AITER
supports, else triton; aiter, triton_kernel, triton, marlin, deep_gemm and flashinfer_mxfp4 build a runner, any
other runner is refused.
"""

from __future__ import annotations

from moe_fsm.backends.requirements import CudaCapability
from moe_fsm.errors import NoBackendError
from moe_fsm.fsm.runner_steps import First, Rule, is_
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.sglang_0_5_23.facts import AITER, FLASHINFER, GFX95, HIP, SM90, negated
from moe_fsm.profiles.sglang_0_5_23.kernels import sglang_policy
from moe_fsm.profiles.sglang_0_5_23.layer import A2A, AITER_A2A, AS_RESOLVED, RUNNER, no_runner, runner_at

_AUTO = is_(RUNNER, "auto")
FI_MXFP4_GPUS = CudaCapability(families=(9, 10, 12))  # SM90, SM100, SM120: the three FlashInfer entry points

MXFP4_RULES = (
    Rule("Mxfp4Config.from_config: on ROCm only gfx95 supports MXFP4", when=(HIP, negated(GFX95)),
         fail="Current platform does not support mxfp4 computation"),
    Rule("Mxfp4MoEMethod: flashinfer_mxfp4 on SM90 needs FlashInfer's SM90 mixed-GEMM helpers",
         when=(is_(RUNNER, "flashinfer_mxfp4"), SM90, negated(FLASHINFER)),
         fail="moe_runner_backend=flashinfer_mxfp4 on SM90 requires the interleave_moe_{{weights,scales}}"
              "_for_sm90_mixed_gemm helpers from FlashInfer PR #3084 (>= 0.6.11). Upgrade flashinfer-python or "
              "pick a different backend (e.g. marlin / triton_kernel).", error=NoBackendError),
    Rule("Mxfp4MoEMethod: flashinfer_mxfp4 needs SM90, SM100 or SM120",
         when=(is_(RUNNER, "flashinfer_mxfp4"), negated(FI_MXFP4_GPUS)),
         fail="moe_runner_backend=flashinfer_mxfp4 requires SM90, SM100, or SM120.", error=NoBackendError),
    First((
        Rule("under the megamoe all-to-all flashinfer_mxfp4 only prepares weights for DeepGEMM's MegaMoE: no runner",
             when=(is_(A2A, "megamoe"), is_(RUNNER, "flashinfer_mxfp4")), sets=no_runner("megamoe")),
        Rule("auto on ROCm with SGLANG_USE_AITER under an all-to-all AITER supports -> aiter",
             when=(_AUTO, AITER, is_(A2A, *AITER_A2A)), sets=runner_at("aiter")),
        Rule("auto -> triton (use_triton_kernels is off while the runner is auto)", when=(_AUTO,),
             sets=runner_at("triton")),
        Rule("aiter, triton_kernel, triton, marlin and deep_gemm build a runner",
             when=(is_(RUNNER, "aiter", "triton_kernel", "triton", "marlin", "deep_gemm"),),
             sets=runner_at(AS_RESOLVED)),
        Rule("flashinfer_mxfp4 builds a runner (its FlashInfer entry point was found above)",
             when=(is_(RUNNER, "flashinfer_mxfp4"),), sets=runner_at("flashinfer_mxfp4")),
        Rule("Mxfp4MoEMethod has no MoeRunner for any other runner",
             fail="Mxfp4MoEMethod has no MoeRunner for backend={moe_runner_backend}.", error=NoBackendError),
    )),
)

RUNNERS = ("triton", "triton_kernel", "aiter", "marlin", "deep_gemm", "flashinfer_mxfp4", "megamoe")

POLICY = sglang_policy(QuantFamily.MXFP4, "MXFP4", {"mxfp4": MXFP4_RULES}, RUNNERS)
