"""vLLM 0.33.0: ``select_fp8_moe_backend`` (fused_moe/oracle/fp8.py).

No LoRA step (LoRA is a kernel check); an explicit ``moe_backend`` (batched
rewrite, the ``allow_vllm_cutlass`` gate) is required to run;
VLLM_USE_DEEP_GEMM / VLLM_MOE_USE_DEEP_GEMM, when set, force or prune DeepGEMM;
VLLM_ROCM_USE_AITER/_MOE force or prune AITER; then one priority list, reordered
(Humming ahead of Marlin on SM90; block FP8 on SM90: FlashInfer CUTLASS first
with EP, else Triton first; XPU first on XPU; CPU first on CPUs). NONE off CUDA
and ROCm.
"""

from __future__ import annotations

from moe_fsm.backends.requirements import CudaCapability, OnVendor, ParallelRule, QuantSchemes
from moe_fsm.backends.specs import backends
from moe_fsm.fsm.policy import FamilyPolicy, Reorder, frozen
from moe_fsm.fsm.steps import AutoScan, EnvOverride, ExplicitChoice
from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.vllm_0_33.kernels import FP8_BLOCK

FAMILY = QuantFamily.FP8
HOPPER = CudaCapability(exact=((9, 0),))
HUMMING_FIRST = Reorder(when=(HOPPER,), backends=("HUMMING",), to="before:MARLIN",
                        because="Humming outranks Marlin on SM90 (prioritize_humming)")

POLICY = FamilyPolicy(
    family=FAMILY,
    label="FP8",
    steps=(
        ExplicitChoice("explicit_user_choice"),
        EnvOverride("deep_gemm_override", names=("VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM"),
                    standard="DEEPGEMM", batched="BATCHED_DEEPGEMM", prunes=("DEEPGEMM", "BATCHED_DEEPGEMM")),
        EnvOverride("aiter_override", names=("VLLM_ROCM_USE_AITER", "VLLM_ROCM_USE_AITER_MOE"),
                    standard="AITER", batched="AITER", prunes=("AITER",)),
        AutoScan("auto_scan"),
    ),
    backends=frozen(backends(
        FAMILY,
        ("AITER", ["AiterFp8BlockExperts", "AiterFp8TensorExperts", "AiterFp8ChannelExperts"]),
        ("FLASHINFER_TRTLLM", ["TrtLlmFp8ExpertsMonolithic", "TrtLlmFp8ExpertsModular"]),
        ("FLASHINFER_CUTLASS", ["FlashInferExperts"]),
        ("DEEPGEMM", ["TritonOrDeepGemmExperts"]),
        ("VLLM_CUTLASS", ["TritonOrCutlassExperts"]),
        ("TRITON", ["TritonExperts"]),
        ("MARLIN", ["MarlinExperts"]),
        ("HUMMING", ["BatchedHummingGroupedExperts", "HummingGroupedExperts", "HummingIndexedExperts"]),
        ("BATCHED_DEEPGEMM", ["BatchedDeepGemmExperts"]),
        ("BATCHED_VLLM_CUTLASS", ["CutlassBatchedExpertsFp8"]),
        ("BATCHED_TRITON", ["BatchedTritonExperts"]),
        ("XPU", ["XPUExpertsFp8", "XPUExpertsMxFp8", "XPUExpertsBlockFp8"]),
        ("CPU_W8A8", ["CPUExpertsFp8W8A8"]),
        ("CPU", ["CPUExpertsFp8"]),
        ("HPC", ["HPCExperts"]),
    )),
    user_names=frozen({
        "triton": "TRITON",
        "deep_gemm": "DEEPGEMM",
        "cutlass": "VLLM_CUTLASS",
        "flashinfer_trtllm": "FLASHINFER_TRTLLM",
        "flashinfer_cutlass": "FLASHINFER_CUTLASS",
        "marlin": "MARLIN",
        "humming": "HUMMING",
        "aiter": "AITER",
        "hpc": "HPC",
    }),
    batched_variants=frozen({"DEEPGEMM": "BATCHED_DEEPGEMM", "TRITON": "BATCHED_TRITON",
                             "VLLM_CUTLASS": "BATCHED_VLLM_CUTLASS"}),
    priority=frozen({None: (
        "AITER", "FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "DEEPGEMM", "VLLM_CUTLASS", "TRITON", "MARLIN", "HUMMING",
        "BATCHED_DEEPGEMM", "BATCHED_VLLM_CUTLASS", "BATCHED_TRITON", "XPU", "CPU_W8A8", "CPU", "HPC",
    )}),
    reorders=(
        HUMMING_FIRST,
        Reorder(when=(HOPPER, QuantSchemes((FP8_BLOCK,)), ParallelRule("ep_size > 1", lambda p: p.ep_size > 1)),
                backends=("FLASHINFER_CUTLASS",), to="front",
                because="on Hopper, block FP8 prefers FlashInfer CUTLASS under expert parallelism"),
        Reorder(when=(HOPPER, QuantSchemes((FP8_BLOCK,)), ParallelRule("ep_size == 1", lambda p: p.ep_size == 1)),
                backends=("TRITON",), to="front", because="on Hopper, block FP8 prefers Triton under tensor parallelism"),
        Reorder(when=(OnVendor((Vendor.XPU,)),), backends=("XPU",), to="front", because="XPU's own kernels first"),
        Reorder(when=(OnVendor((Vendor.CPU,)),), backends=("CPU_W8A8", "CPU"), to="front",
                because="CPU kernels first, W8A8 (AMX-FP8) before W8A16"),
    ),
    unsupported_message="FP8 MoE backend {backend} does not support the deployment configuration since {reason}.",
    exhausted_message="No FP8 MoE backend supports the deployment configuration.",
    gated_by_allow_vllm_cutlass=("VLLM_CUTLASS", "BATCHED_VLLM_CUTLASS"),
    none_on_vendors=frozenset({Vendor.XPU, Vendor.CPU, Vendor.TPU, Vendor.OUT_OF_TREE}),
)
