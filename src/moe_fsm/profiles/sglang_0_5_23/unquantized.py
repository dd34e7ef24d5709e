"""SGLang 0.5.23: ``UnquantizedFusedMoEMethod.create_moe_runner`` (``layers/quantization/unquant.py``).

FusedMoE hands the method flags read from the resolved runner: flashinfer_trtllm (and its experimental and
routed forms) -> the TRT-LLM BF16 runner, flashinfer_cutlass -> FlashInfer CUTLASS, deep_gemm (or a LoRA
runner) -> DeepGEMM, triton_kernel -> triton_kernels, anything else -> Triton. With SGLANG_USE_AITER on ROCm,
auto or aiter under an all-to-all AITER supports, the aiter CK runner replaces it when it supports the layer
(intermediate size per partition 128-aligned; no SwiGLU-OAI on gfx95); an explicit aiter it cannot run is
refused.
"""

from __future__ import annotations

from moe_fsm.fsm.runner_steps import First, Resolved, Rule, is_
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.sglang_0_5_23.facts import AITER, OAI_ON_GFX95, negated
from moe_fsm.profiles.sglang_0_5_23.kernels import sglang_policy
from moe_fsm.profiles.sglang_0_5_23.layer import A2A, AITER_A2A, RUNNER, runner_at

SIZES = ("intermediate_size", "tp_size", "ep_size")


def _aligned(n: int, tp: int, ep: int) -> bool:
    """FusedMoE's intermediate_size_per_partition (intermediate / moe_tp_size, moe_tp_size = tp // ep) % 128 == 0."""
    return (n // max(tp // ep, 1)) % 128 == 0


ALIGNED = Resolved("intermediate_size_per_partition is 128-aligned", SIZES, _aligned)
NOT_ALIGNED = Resolved("intermediate_size_per_partition is not 128-aligned", SIZES, lambda *s: not _aligned(*s))
AITER_ASKED = (AITER, is_(RUNNER, "auto", "aiter"), is_(A2A, *AITER_A2A))

UNQUANTIZED_RULES = (
    First((
        Rule("use_flashinfer_trtllm_moe: flashinfer_trtllm or experimental_sgl_trtllm -> FLASHINFER_TRTLLM",
             when=(is_(RUNNER, "flashinfer_trtllm", "experimental_sgl_trtllm"),),
             sets=runner_at("flashinfer_trtllm")),
        Rule("use_flashinfer_trtllm_moe: flashinfer_trtllm_routed -> FLASHINFER_TRTLLM_ROUTED",
             when=(is_(RUNNER, "flashinfer_trtllm_routed"),), sets=runner_at("flashinfer_trtllm_routed")),
        Rule("use_flashinfer_cutlass -> FLASHINFER_CUTLASS", when=(is_(RUNNER, "flashinfer_cutlass"),),
             sets=runner_at("flashinfer_cutlass")),
        Rule("use_deep_gemm (deep_gemm or a LoRA runner) -> DEEP_GEMM",
             when=(is_(RUNNER, "deep_gemm", "lora_cutedsl", "lora_triton", "lora_marlin"),),
             sets=runner_at("deep_gemm")),
        Rule("use_triton_kernels -> TRITON_KERNELS", when=(is_(RUNNER, "triton_kernel"),),
             sets=runner_at("triton_kernel")),
        Rule("otherwise -> TRITON", sets=runner_at("triton")),
    )),
    First((
        Rule("aiter CK fused-MoE runs the layer (128-aligned, no SwiGLU-OAI on gfx95): the aiter runner replaces it",
             when=(*AITER_ASKED, ALIGNED, negated(OAI_ON_GFX95)), sets=runner_at("aiter")),
        Rule("an explicit aiter the CK kernels cannot run (not 128-aligned) is refused",
             when=(*AITER_ASKED, is_(RUNNER, "aiter"), NOT_ALIGNED),
             fail="moe_runner_backend=aiter is not supported: intermediate_size_per_partition is not 128-aligned; "
                  "use --moe-runner-backend triton."),
        Rule("an explicit aiter the CK kernels cannot run (SwiGLU-OAI on gfx95) is refused",
             when=(*AITER_ASKED, is_(RUNNER, "aiter"), OAI_ON_GFX95),
             fail="moe_runner_backend=aiter is not supported: SwiGLU-OAI is not implemented by the aiter CK bf16 "
                  "fused-MoE kernels; use --moe-runner-backend triton."),
    )),
)

RUNNERS = ("triton", "triton_kernel", "deep_gemm", "aiter", "flashinfer_trtllm", "flashinfer_trtllm_routed",
           "flashinfer_cutlass")

POLICY = sglang_policy(QuantFamily.UNQUANTIZED, "Unquantized", {"unquantized": UNQUANTIZED_RULES}, RUNNERS)
