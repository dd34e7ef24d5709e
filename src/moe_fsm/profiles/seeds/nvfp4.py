"""Seeds: ``select_nvfp4_moe_backend`` (shared/seeds/001)."""

from __future__ import annotations

from moe_fsm.backends.specs import backends
from moe_fsm.fsm.policy import FamilyPolicy, frozen
from moe_fsm.fsm.steps import (
    FI_CUTEDSL, FI_CUTLASS, FI_TRTLLM, AutoScan, ExplicitChoice, FlashInferPreference, ForcedBackend,
)
from moe_fsm.inputs.quant import QuantFamily

FAMILY = QuantFamily.NVFP4

POLICY = FamilyPolicy(
    family=FAMILY,
    label="NvFp4",
    steps=(
        ExplicitChoice("explicit_user_choice"),
        FlashInferPreference(
            "flashinfer_preference",
            env_var="VLLM_USE_FLASHINFER_MOE_FP4",
            gate_on_presence=True,
            candidates=("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "FLASHINFER_CUTEDSL", "FLASHINFER_CUTEDSL_BATCHED",
                        "FLASHINFER_B12X"),
            pinned=frozen({FI_CUTLASS: "FLASHINFER_CUTLASS", FI_TRTLLM: "FLASHINFER_TRTLLM", FI_CUTEDSL: "FLASHINFER_CUTEDSL"}),
            exhausted="Found VLLM_USE_FLASHINFER_MOE_FP4=1, but no FlashInfer NVFP4 MoE backend supports the configuration.",
        ),
        ForcedBackend("forced_marlin", env_var="VLLM_TEST_FORCE_FP8_MARLIN", backend="MARLIN"),
        AutoScan("auto_scan"),
    ),
    backends=frozen(backends(
        FAMILY,
        ("FLASHINFER_TRTLLM", ["TrtLlmNvFp4ExpertsMonolithic", "TrtLlmNvFp4ExpertsModular"]),
        ("FLASHINFER_CUTEDSL", ["FlashInferCuteDSLExperts"]),
        ("FLASHINFER_CUTEDSL_BATCHED", ["FlashInferCuteDSLBatchedExperts"]),
        ("FLASHINFER_CUTLASS", ["FlashInferExperts"]),
        ("FLASHINFER_B12X", ["FlashInferB12xExperts"]),
        ("VLLM_CUTLASS", ["CutlassExpertsFp4"]),
        ("MARLIN", ["MarlinExperts"]),
        ("EMULATION", ["TorchExperts", "TorchBatchedExperts"]),
    )),
    user_names=frozen({
        "cutlass": "VLLM_CUTLASS",
        "flashinfer_trtllm": "FLASHINFER_TRTLLM",
        "flashinfer_cutlass": "FLASHINFER_CUTLASS",
        "flashinfer_cutedsl": "FLASHINFER_CUTEDSL",
        "flashinfer_b12x": "FLASHINFER_B12X",
        "marlin": "MARLIN",
        "emulation": "EMULATION",
    }),
    batched_variants=frozen({"FLASHINFER_CUTEDSL": "FLASHINFER_CUTEDSL_BATCHED"}),
    priority=frozen({None: (
        "FLASHINFER_TRTLLM", "FLASHINFER_CUTEDSL", "FLASHINFER_CUTEDSL_BATCHED", "FLASHINFER_CUTLASS",
        "VLLM_CUTLASS", "MARLIN", "EMULATION",
    )}),
    unsupported_message="NvFp4 MoE backend '{backend}' does not support the deployment configuration since {reason}.",
    exhausted_message="No NvFp4 MoE backend supports the deployment configuration.",
    clamp_backends=frozenset({"FLASHINFER_TRTLLM"}),
)
