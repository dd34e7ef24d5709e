"""vLLM 0.33.0: ``select_mxfp4_moe_backend`` (``fused_moe/oracle/mxfp4.py``), the gpt-oss MXFP4 oracle.

A ``--moe-backend`` name stands for the backend's activation variants
(``flashinfer_trtllm``: BF16 then MXFP8 activations); the checkpoint's
activation key orders and narrows them; each variant is checked with its own
activation key. The auto list is the same on every platform (the kernels'
device checks do the filtering); on CUDA 12.x TRITON waits until after the
Marlin backends, and on CUDA 9.0 Humming comes before Marlin. On XPU an
exhausted scan asks XPU once more and raises its refusal. gpt-oss layers
carry expert biases and the SwiGLU-OAI clamp, which every MXFP4 backend
applies. See docs/vllm-0.33-families.md.
"""

from __future__ import annotations

from moe_fsm.backends.requirements import Condition, CudaCapability
from moe_fsm.backends.specs import LAYER_ACTIVATION, BackendSpec
from moe_fsm.fsm.candidate_steps import ActivationOrder, ExplicitAlternatives
from moe_fsm.fsm.policy import FamilyPolicy, Reorder, frozen
from moe_fsm.fsm.steps import AutoScan
from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.quant import FP8_DYNAMIC_GROUP128, FP8_STATIC_TENSOR, MXFP4_DYNAMIC, MXFP8_DYNAMIC, QuantFamily
from moe_fsm.profiles.vllm_0_33.fp8 import HUMMING_FIRST

FAMILY = QuantFamily.MXFP4
CONSUMER_BLACKWELL = CudaCapability(families=(12,))
# _requested_kernel_cls: with LoRA the MXFP8-activation TRTLLM variant refuses before its kernels are asked.
NO_LORA_WITH_MXFP8 = Condition(
    "no LoRA (the TRTLLM LoRA experts take BF16 activations only)", lambda ctx: not ctx.layer.lora,
    "expert LoRA is not supported with MXFP8 activations; use moe_backend='flashinfer_trtllm'",
)
# flashinfer_moe_ep_unsupported_reasons: the DeepGEMM megakernel routes DeepSeek-V4's way only, and moe-fsm's
# layers are routed by plain top-k, so that backend refuses every layer moe-fsm describes.
MEGA_DEEP_GEMM_REFUSAL = ("FLASHINFER_MOE_EP_DEEP_GEMM", "kernel does not support routing method Renormalize "
                          "(the DeepGEMM MoE-EP megakernel needs DeepSeek-V4 routing)")

# (backend, kernel classes in vLLM's order, the activation key its support check uses (None: 16-bit), extra checks)
_BACKENDS = (
    ("B12X_MXFP4_MXFP8", ("B12xExperts",), MXFP8_DYNAMIC),
    ("B12X_MXFP4_BF16", ("B12xExperts",), None),
    ("DEEPGEMM_MXFP4", ("DeepGemmFP4Experts",), FP8_DYNAMIC_GROUP128),
    ("FLASHINFER_TRTLLM_MXFP4_MXFP8", ("TrtLlmMxfp4ExpertsMonolithic", "TrtLlmMxfp4ExpertsModular"), MXFP8_DYNAMIC, (NO_LORA_WITH_MXFP8,)),
    ("FLASHINFER_TRTLLM_MXFP4_BF16", ("TrtLlmMxfp4ExpertsMonolithic", "TrtLlmMxfp4ExpertsModular"), None),
    ("FLASHINFER_CUTLASS_MXFP4_MXFP8", ("FlashInferExperts",), MXFP8_DYNAMIC),
    ("FLASHINFER_CUTLASS_MXFP4_BF16", ("FlashInferExperts",), None),
    ("CUTLASS_MXFP4_MXFP4", ("CutlassExpertsMxfp4",), MXFP4_DYNAMIC),
    ("BATCHED_MARLIN", ("BatchedMarlinExperts",), None),
    ("MARLIN", ("MarlinExperts",), None),
    ("AITER_MXFP4_BF16", ("AiterMxfp4Experts",), None),
    ("AITER_TRITON_MXFP4_BF16", ("AiterW4A16ExpertsMonolithic",), None),
    ("AITER_MXFP4_FP8", ("AiterW4A8ExpertsMonolithic",), FP8_STATIC_TENSOR),
    ("AITER_MXFP4_MXFP4", ("AiterMxfp4Experts",), MXFP4_DYNAMIC),
    ("AITER_TRITON_MXFP4_MXFP4", ("AiterW4A4ExpertsMonolithic",), MXFP4_DYNAMIC),
    ("TRITON", ("OAITritonMxfp4ExpertsMonolithic", "OAITritonExperts"), None),
    ("TRITON_UNFUSED", ("UnfusedOAITritonExperts",), None),
    ("XPU", ("XPUExpertsMxFp4",), None),
    ("CPU", ("CPUExpertsMxfp4",), None),
    ("EMULATION", ("OCP_MXQuantizationEmulationTritonExperts",), LAYER_ACTIVATION),
    ("HUMMING", ("BatchedHummingGroupedExperts", "HummingGroupedExperts", "HummingIndexedExperts"), None),
    ("FLASHINFER_MOE_EP_CUTEDSL", ("FlashInferMoeEpExperts",), None),
)

# map_mxfp4_backend: every name vLLM's MXFP4 oracle accepts, with its variants in order.
ALTERNATIVES = frozen({
    "b12x": ("B12X_MXFP4_MXFP8", "B12X_MXFP4_BF16"),
    "deep_gemm": ("DEEPGEMM_MXFP4",),
    "flashinfer_trtllm": ("FLASHINFER_TRTLLM_MXFP4_BF16", "FLASHINFER_TRTLLM_MXFP4_MXFP8"),
    "flashinfer_trtllm_afp8": ("FLASHINFER_TRTLLM_MXFP4_MXFP8",),
    "flashinfer_cutlass": ("FLASHINFER_CUTLASS_MXFP4_BF16", "FLASHINFER_CUTLASS_MXFP4_MXFP8"),
    "flashinfer_cutlass_afp8": ("FLASHINFER_CUTLASS_MXFP4_MXFP8",),
    "flashinfer_moe_ep_cutedsl": ("FLASHINFER_MOE_EP_CUTEDSL",),
    "flashinfer_moe_ep_mega_deep_gemm": (),  # refused: see MEGA_DEEP_GEMM_REFUSAL
    "triton": ("TRITON",),
    "triton_unfused": ("TRITON_UNFUSED",),
    "humming": ("HUMMING",),
    "marlin": ("MARLIN",),
    "aiter": ("AITER_MXFP4_BF16", "AITER_TRITON_MXFP4_BF16", "AITER_MXFP4_FP8", "AITER_MXFP4_MXFP4",
              "AITER_TRITON_MXFP4_MXFP4"),
    "aiter_triton_mxfp4_bf16": ("AITER_TRITON_MXFP4_BF16",),
    "aiter_mxfp4_fp8": ("AITER_MXFP4_FP8",),
    "aiter_triton_mxfp4_mxfp4": ("AITER_TRITON_MXFP4_MXFP4",),
    "aiter_mxfp4_mxfp4": ("AITER_MXFP4_MXFP4",),
    "xpu": ("XPU",),
    "cpu": ("CPU",),
    "emulation": ("EMULATION",),
})

BY_ACTIVATION = ActivationOrder()

POLICY = FamilyPolicy(
    family=FAMILY,
    label="MXFP4",
    steps=(
        ExplicitAlternatives(
            "explicit_user_choice",
            alternatives=ALTERNATIVES,
            activation_order=BY_ACTIVATION,
            unordered_without_activation=("b12x",),
            forced=frozen({"b12x": ("VLLM_B12X_MOE_FP4_FORCE_A16", ("B12X_MXFP4_BF16",))}),
            lora_kernels=frozen({"FLASHINFER_TRTLLM_MXFP4_BF16": ("TrtLlmMxfp4LoRAExperts",)}),
            refusals=frozen({"flashinfer_moe_ep_mega_deep_gemm": MEGA_DEEP_GEMM_REFUSAL}),
        ),
        AutoScan("auto_scan", activation_order=BY_ACTIVATION, last_resort=frozen({Vendor.XPU: "XPU"})),
    ),
    backends=frozen({row[0]: BackendSpec(row[0], FAMILY, row[1], extra=row[3] if len(row) > 3 else (), activation_key=row[2])
                     for row in _BACKENDS}),
    user_names=frozen({name: backends[0] for name, backends in ALTERNATIVES.items() if backends}),
    batched_variants=frozen({"MARLIN": "BATCHED_MARLIN"}),
    # _get_priority_backends_for_gpt_oss, the same on every platform (TRITON_UNFUSED is left out there too).
    priority=frozen({None: (
        "FLASHINFER_TRTLLM_MXFP4_BF16", "FLASHINFER_TRTLLM_MXFP4_MXFP8", "AITER_MXFP4_BF16", "AITER_TRITON_MXFP4_BF16",
        "AITER_MXFP4_FP8", "AITER_MXFP4_MXFP4", "TRITON", "FLASHINFER_CUTLASS_MXFP4_BF16",
        "FLASHINFER_CUTLASS_MXFP4_MXFP8", "CUTLASS_MXFP4_MXFP4", "MARLIN", "BATCHED_MARLIN", "HUMMING", "XPU", "CPU",
        "EMULATION",
    )}),
    reorders=(
        Reorder((CONSUMER_BLACKWELL,), ("TRITON",), "after:BATCHED_MARLIN",
                "consumer Blackwell: the OAI Triton kernels' 99KB shared memory caps their tiles, Marlin prefills faster"),
        HUMMING_FIRST,
    ),
    unsupported_message="Mxfp4 MoE backend '{backend}' does not support the deployment configuration since {reason}.",
    exhausted_message="No MXFP4 MoE backend supports the deployment configuration.",
)
