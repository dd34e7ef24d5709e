"""The environment variables the seed oracles read (shared/seeds/000..002, shared/reference)."""

from __future__ import annotations

from moe_fsm.inputs.env import EnvRegistry, EnvVar, bool_word, choice, int_flag

FLASHINFER_MOE_BACKEND_CHOICES = ("throughput", "latency", "masked_gemm")
BOOL_WORDS = "1, true, 0 or false (case-insensitive)"

ENV = EnvRegistry.of(
    EnvVar("VLLM_USE_FLASHINFER_MOE_FP16", False, int_flag("VLLM_USE_FLASHINFER_MOE_FP16"), "0 or 1",
           "Prefer FlashInfer kernels for unquantized MoE."),
    EnvVar("VLLM_USE_FLASHINFER_MOE_FP8", False, int_flag("VLLM_USE_FLASHINFER_MOE_FP8"), "0 or 1",
           "Set: force (1) or exclude (0) FlashInfer kernels for FP8 MoE."),
    EnvVar("VLLM_USE_FLASHINFER_MOE_FP4", False, int_flag("VLLM_USE_FLASHINFER_MOE_FP4"), "0 or 1",
           "Set: force (1) or exclude (0) FlashInfer kernels for NVFP4 MoE."),
    EnvVar("VLLM_FLASHINFER_MOE_BACKEND", "latency",
           choice("VLLM_FLASHINFER_MOE_BACKEND", FLASHINFER_MOE_BACKEND_CHOICES),
           ", ".join(FLASHINFER_MOE_BACKEND_CHOICES),
           "Which FlashInfer MoE family: throughput=CUTLASS, latency=TRTLLM (SM100 only), masked_gemm=CuteDSL."),
    EnvVar("VLLM_USE_DEEP_GEMM", True, int_flag("VLLM_USE_DEEP_GEMM"), "0 or 1",
           "DeepGEMM globally; set to 1 (with VLLM_MOE_USE_DEEP_GEMM not 0) it forces DeepGEMM for FP8 MoE."),
    EnvVar("VLLM_MOE_USE_DEEP_GEMM", True, int_flag("VLLM_MOE_USE_DEEP_GEMM"), "0 or 1",
           "DeepGEMM for MoE only; 0 excludes it."),
    EnvVar("VLLM_TEST_FORCE_FP8_MARLIN", False, bool_word("VLLM_TEST_FORCE_FP8_MARLIN"), BOOL_WORDS,
           "Force the Marlin weight-only MoE kernel."),
    EnvVar("VLLM_ROCM_USE_AITER", False, bool_word("VLLM_ROCM_USE_AITER"), BOOL_WORDS, "AITER master switch on ROCm."),
    EnvVar("VLLM_ROCM_USE_AITER_MOE", True, bool_word("VLLM_ROCM_USE_AITER_MOE"), BOOL_WORDS,
           "AITER MoE switch on ROCm (needs VLLM_ROCM_USE_AITER too)."),
)
