"""vLLM 0.33.0: ``select_mxfp8_moe_backend`` (``fused_moe/oracle/mxfp8.py``).

Fixed keys (MXFP8 weights and activations, E8M0 scale per 32), one list on
every platform, Humming before Marlin on CUDA 9.0. Unlike the other oracles it
raises ValueError when nothing fits ("No MXFP8 MoE backends available."), and
an explicit backend that cannot run says "No supported MXFP8 expert class".
MXFP8 emulation runs on any device, so a CPU gets EMULATION.
"""

from __future__ import annotations

from moe_fsm.backends.specs import backends
from moe_fsm.errors import BackendUnsupportedError
from moe_fsm.fsm.policy import FamilyPolicy, frozen
from moe_fsm.fsm.steps import AutoScan, ExplicitChoice
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.vllm_0_33.fp8 import HUMMING_FIRST

FAMILY = QuantFamily.MXFP8

POLICY = FamilyPolicy(
    family=FAMILY,
    label="MXFP8",
    steps=(ExplicitChoice("explicit_user_choice"), AutoScan("auto_scan")),
    backends=frozen(backends(
        FAMILY,
        ("FLASHINFER_TRTLLM", ["TrtLlmFp8ExpertsMonolithic", "TrtLlmFp8ExpertsModular"]),
        ("DEEPGEMM", ["DeepGemmExperts"]),
        ("MARLIN", ["MarlinExperts"]),
        ("XPU", ["XPUExpertsFp8", "XPUExpertsMxFp8", "XPUExpertsBlockFp8"]),
        ("AITER_MXFP8", ["AiterMxfp8Experts"]),
        ("HUMMING", ["BatchedHummingGroupedExperts", "HummingGroupedExperts", "HummingIndexedExperts"]),
        ("TRITON_MXFP8", ["Mxfp8NativeTritonExperts"]),
        ("EMULATION", ["Mxfp8EmulationTritonExperts"]),
    )),
    user_names=frozen({
        "flashinfer_trtllm": "FLASHINFER_TRTLLM",
        "deep_gemm": "DEEPGEMM",
        "marlin": "MARLIN",
        "xpu": "XPU",
        "aiter": "AITER_MXFP8",
        "triton": "TRITON_MXFP8",
        "humming": "HUMMING",
    }),
    batched_variants=frozen({}),
    priority=frozen({None: (
        "FLASHINFER_TRTLLM", "DEEPGEMM", "MARLIN", "XPU", "AITER_MXFP8", "HUMMING", "TRITON_MXFP8", "EMULATION",
    )}),
    reorders=(HUMMING_FIRST,),
    unsupported_message="No supported MXFP8 expert class for {backend}: {reason}",
    exhausted_message="No MXFP8 MoE backends available.",
    exhausted_error=BackendUnsupportedError,
)
