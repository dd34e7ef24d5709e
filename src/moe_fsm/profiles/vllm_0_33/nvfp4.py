"""vLLM 0.33.0: ``select_nvfp4_moe_backend`` (fused_moe/oracle/nvfp4.py).

No env steps any more: an explicit ``moe_backend`` (CuTe DSL's batched rewrite;
with ``swiglu_limit`` only a backend that applies the clamp) is required to run;
otherwise one priority list (Humming ahead of Marlin on SM90), filtered to the
clamp-applying backends when the model sets ``swiglu_limit``. FLASHINFER_B12X
is explicit-only.
"""

from __future__ import annotations

from moe_fsm.backends.specs import backends
from moe_fsm.fsm.policy import FamilyPolicy, frozen
from moe_fsm.fsm.steps import AutoScan, ExplicitChoice
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.vllm_0_33.fp8 import HUMMING_FIRST

FAMILY = QuantFamily.NVFP4

POLICY = FamilyPolicy(
    family=FAMILY,
    label="NvFp4",
    steps=(ExplicitChoice("explicit_user_choice"), AutoScan("auto_scan")),
    backends=frozen(backends(
        FAMILY,
        ("B12X", ["B12xExperts"]),
        ("FLASHINFER_TRTLLM", ["TrtLlmNvFp4ExpertsMonolithic", "TrtLlmNvFp4ExpertsModular"]),
        ("FLASHINFER_CUTLASS", ["FlashInferExperts"]),
        ("FLASHINFER_CUTEDSL", ["FlashInferCuteDSLExperts"]),
        ("FLASHINFER_CUTEDSL_BATCHED", ["FlashInferCuteDSLBatchedExperts"]),
        ("FLASHINFER_B12X", ["FlashInferB12xExperts"]),
        ("VLLM_CUTLASS", ["CutlassExpertsFp4"]),
        ("MARLIN", ["MarlinExperts"]),
        ("HUMMING", ["BatchedHummingGroupedExperts", "HummingGroupedExperts", "HummingIndexedExperts"]),
        ("EMULATION", ["Nvfp4QuantizationEmulationTritonExperts"]),
        ("FLASHINFER_MOE_EP_CUTEDSL", ["FlashInferMoeEpExperts"]),
    )),
    user_names=frozen({
        "b12x": "B12X",
        "cutlass": "VLLM_CUTLASS",
        "flashinfer_trtllm": "FLASHINFER_TRTLLM",
        "flashinfer_cutlass": "FLASHINFER_CUTLASS",
        "flashinfer_cutedsl": "FLASHINFER_CUTEDSL",
        "flashinfer_moe_ep_cutedsl": "FLASHINFER_MOE_EP_CUTEDSL",
        "flashinfer_b12x": "FLASHINFER_B12X",
        "marlin": "MARLIN",
        "humming": "HUMMING",
        "emulation": "EMULATION",
    }),
    batched_variants=frozen({"FLASHINFER_CUTEDSL": "FLASHINFER_CUTEDSL_BATCHED"}),
    priority=frozen({None: (
        "FLASHINFER_TRTLLM", "FLASHINFER_CUTEDSL", "FLASHINFER_CUTEDSL_BATCHED", "FLASHINFER_CUTLASS", "VLLM_CUTLASS",
        "MARLIN", "HUMMING", "EMULATION",
    )}),
    reorders=(HUMMING_FIRST,),
    unsupported_message="NvFp4 MoE backend '{backend}' does not support the deployment configuration since {reason}.",
    exhausted_message="No NvFp4 MoE backend supports the deployment configuration.",
    clamp_backends=frozenset({"B12X", "FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "FLASHINFER_CUTEDSL",
                              "FLASHINFER_MOE_EP_CUTEDSL", "VLLM_CUTLASS", "MARLIN", "EMULATION", "HUMMING"}),
)
