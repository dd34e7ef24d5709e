"""Seeds: ``select_fp8_moe_backend`` (shared/seeds/000)."""

from __future__ import annotations

from moe_fsm.backends.requirements import LoRAEnabled
from moe_fsm.backends.specs import backends
from moe_fsm.fsm.policy import FamilyPolicy, frozen
from moe_fsm.fsm.steps import (
    FI_CUTLASS, FI_TRTLLM, AutoScan, EnvOverride, ExplicitChoice, FlashInferPreference, ForcedBackend, Shortcut,
)
from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.quant import QuantFamily

FAMILY = QuantFamily.FP8

POLICY = FamilyPolicy(
    family=FAMILY,
    label="FP8",
    steps=(
        Shortcut("lora_shortcut", when=(LoRAEnabled(),), candidates=("TRITON",)),
        ExplicitChoice("explicit_user_choice"),
        FlashInferPreference(
            "flashinfer_preference",
            env_var="VLLM_USE_FLASHINFER_MOE_FP8",
            gate_on_presence=True,
            candidates=("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS"),
            pinned=frozen({FI_CUTLASS: "FLASHINFER_CUTLASS", FI_TRTLLM: "FLASHINFER_TRTLLM"}),
            unpinnable="FlashInfer MaskedGEMM not supported for FP8",
            exhausted="Found VLLM_USE_FLASHINFER_MOE_FP8=1, but no FlashInfer FP8 MoE backend supports the configuration.",
        ),
        EnvOverride("deep_gemm_override", names=("VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM"),
                    standard="DEEPGEMM", batched="BATCHED_DEEPGEMM", prunes=("DEEPGEMM", "BATCHED_DEEPGEMM")),
        ForcedBackend("forced_marlin", env_var="VLLM_TEST_FORCE_FP8_MARLIN", backend="MARLIN"),
        EnvOverride("aiter_override", names=("VLLM_ROCM_USE_AITER", "VLLM_ROCM_USE_AITER_MOE"),
                    standard="AITER", batched="AITER", prunes=("AITER",)),
        AutoScan("auto_scan"),
    ),
    backends=frozen(backends(
        FAMILY,
        ("AITER", ["AiterExperts"]),
        ("FLASHINFER_TRTLLM", ["TrtLlmFp8ExpertsMonolithic", "TrtLlmFp8ExpertsModular"]),
        ("FLASHINFER_CUTLASS", ["FlashInferExperts"]),
        ("DEEPGEMM", ["TritonOrDeepGemmExperts"]),
        ("BATCHED_DEEPGEMM", ["BatchedDeepGemmExperts"]),
        ("VLLM_CUTLASS", ["TritonOrCutlassExperts"]),
        ("BATCHED_VLLM_CUTLASS", ["CutlassBatchedExpertsFp8"]),
        ("TRITON", ["TritonExperts"]),
        ("BATCHED_TRITON", ["BatchedTritonExperts"]),
        ("MARLIN", ["MarlinExperts"]),
        ("XPU", ["XPUExpertsFp8"]),
    )),
    user_names=frozen({
        "triton": "TRITON",
        "deep_gemm": "DEEPGEMM",
        "cutlass": "VLLM_CUTLASS",
        "flashinfer_trtllm": "FLASHINFER_TRTLLM",
        "flashinfer_cutlass": "FLASHINFER_CUTLASS",
        "marlin": "MARLIN",
        "aiter": "AITER",
    }),
    batched_variants=frozen({"DEEPGEMM": "BATCHED_DEEPGEMM", "TRITON": "BATCHED_TRITON", "VLLM_CUTLASS": "BATCHED_VLLM_CUTLASS"}),
    priority=frozen({None: (
        "AITER", "FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "DEEPGEMM", "BATCHED_DEEPGEMM", "VLLM_CUTLASS",
        "BATCHED_VLLM_CUTLASS", "TRITON", "BATCHED_TRITON", "MARLIN", "XPU",
    )}),
    unsupported_message="FP8 MoE backend {backend} does not support the deployment configuration since {reason}.",
    exhausted_message="No FP8 MoE backend supports the deployment configuration.",
    gated_by_allow_vllm_cutlass=("VLLM_CUTLASS", "BATCHED_VLLM_CUTLASS"),
    none_on_vendors=frozenset({Vendor.XPU, Vendor.CPU, Vendor.TPU, Vendor.OUT_OF_TREE}),
)
