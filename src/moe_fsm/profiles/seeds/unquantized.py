"""Seeds: ``select_unquantized_moe_backend`` (shared/seeds/002)."""

from __future__ import annotations

from moe_fsm.backends.specs import backends
from moe_fsm.fsm.policy import FamilyPolicy, frozen
from moe_fsm.fsm.steps import AutoScan, ExplicitChoice, FlashInferPreference
from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.seeds.kernels import EP_WITHOUT_DP, ON_CPU

FAMILY = QuantFamily.UNQUANTIZED

POLICY = FamilyPolicy(
    family=FAMILY,
    label="Unquantized",
    steps=(
        ExplicitChoice("explicit_user_choice"),
        FlashInferPreference(
            "flashinfer_preference",
            env_var="VLLM_USE_FLASHINFER_MOE_FP16",
            gate_on_presence=False,
            candidates=("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS"),
            requires_latency=("FLASHINFER_TRTLLM",),
        ),
        AutoScan("auto_scan"),
    ),
    backends=frozen(backends(
        FAMILY,
        ("FLASHINFER_TRTLLM", ["TrtLlmBf16ExpertsMonolithic"]),
        ("FLASHINFER_CUTLASS", ["FlashInferExperts"], [EP_WITHOUT_DP]),
        ("AITER", ["AiterExperts"]),
        ("TRITON", ["TritonExperts"]),
        ("BATCHED_TRITON", ["BatchedTritonExperts"]),
        ("XPU", ["XPUExperts"]),
        ("CPU", ["TorchExperts", "TorchBatchedExperts"], [ON_CPU]),
        ("TPU", ["TPUExperts"]),
        ("OOT", ["OOTExperts"]),
    )),
    user_names=frozen({
        "triton": "TRITON",
        "flashinfer_trtllm": "FLASHINFER_TRTLLM",
        "flashinfer_cutlass": "FLASHINFER_CUTLASS",
        "aiter": "AITER",
    }),
    batched_variants=frozen({"TRITON": "BATCHED_TRITON"}),
    priority=frozen({
        Vendor.CUDA: ("TRITON", "BATCHED_TRITON"),
        Vendor.ROCM: ("AITER", "TRITON", "BATCHED_TRITON"),
        Vendor.XPU: ("XPU",),
        Vendor.CPU: ("CPU",),
        Vendor.TPU: ("TPU",),
        Vendor.OUT_OF_TREE: ("OOT",),
    }),
    unsupported_message="Unquantized MoE backend {backend} does not support the deployment configuration since {reason}.",
    exhausted_message="No Unquantized MoE backend supports the deployment configuration.",
    explicit_unavailable=frozen({
        "FLASHINFER_TRTLLM": "FlashInfer TRTLLM MoE backend is not available for this configuration",
        "FLASHINFER_CUTLASS": "FlashInfer CUTLASS MoE backend is not available for this configuration",
        "AITER": "ROCm AITer MoE backend is not available for this configuration",
    }),
)
