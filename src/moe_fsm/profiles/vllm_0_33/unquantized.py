"""vLLM 0.33.0: ``select_unquantized_moe_backend`` (fused_moe/oracle/unquantized.py).

Order: TPU and out-of-tree platforms return their backend at once; LoRA returns
the FlashInfer TRT-LLM LoRA experts where they run (Blackwell, per-partition
intermediate a multiple of 128), else TRITON unchecked; an explicit
``moe_backend`` (``humming``/``marlin`` fall through to auto) is required to
run; VLLM_ROCM_USE_AITER/_MOE, when set, prune AITER or try it first (falling
back to the scan when it cannot run); then the platform's priority list, with
FlashInfer first on CUDA except on SM90, under DP (CUTLASS) and for SwiGLU-OAI.
"""

from __future__ import annotations

from moe_fsm.backends.requirements import Activations, CudaCapability, LoRAEnabled, OnVendor, ParallelRule
from moe_fsm.backends.specs import backends
from moe_fsm.fsm.policy import FamilyPolicy, Reorder, frozen
from moe_fsm.fsm.steps import AutoScan, EnvOverride, ExplicitChoice, Shortcut
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.layer import Activation
from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.quant import QuantFamily

FAMILY = QuantFamily.UNQUANTIZED
FI = ("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS")

POLICY = FamilyPolicy(
    family=FAMILY,
    label="Unquantized",
    steps=(
        Shortcut("tpu_platform", when=(OnVendor((Vendor.TPU,)),), otherwise="TPU"),
        Shortcut("oot_platform", when=(OnVendor((Vendor.OUT_OF_TREE,)),), otherwise="OOT"),
        # _trtllm_bf16_lora_supported asks TrtLlmBf16LoRAExperts about the standard format, before the oracle
        # works out the batched one (--backend batched_triton, batched all-to-all kinds).
        Shortcut("lora_shortcut", when=(LoRAEnabled(),), candidates=("FLASHINFER_TRTLLM",), otherwise="TRITON",
                 activation_format=ActivationFormat.STANDARD),
        ExplicitChoice("explicit_user_choice", passthrough=("humming", "marlin")),
        EnvOverride("aiter_override", names=("VLLM_ROCM_USE_AITER", "VLLM_ROCM_USE_AITER_MOE"),
                    standard="AITER", batched="AITER", prunes=("AITER",), unsupported="prune"),
        AutoScan("auto_scan"),
    ),
    backends=frozen(backends(
        FAMILY,
        # TrtLlmBf16LoRAExperts is what the LoRA step asks for; it requires LoRA, so the scan never picks it.
        ("FLASHINFER_TRTLLM", ["TrtLlmBf16ExpertsMonolithic", "TrtLlmBf16ExpertsModular", "TrtLlmBf16LoRAExperts"]),
        ("FLASHINFER_CUTLASS", ["FlashInferExperts"]),
        ("AITER", ["AiterUnquantizedExperts"]),
        ("TRITON", ["TritonExperts"]),
        ("BATCHED_TRITON", ["BatchedTritonExperts"]),
        ("XPU", ["XPUExperts"]),
        ("CPU", ["X86CPUUnquantizedExperts", "ArmCPUUnquantizedExperts", "PowerCPUUnquantizedExperts",
                 "CPUUnquantizedExperts"]),
        ("TPU", []),
        ("OOT", []),
    )),
    user_names=frozen({
        "triton": "TRITON",
        "batched_triton": "BATCHED_TRITON",
        "flashinfer_trtllm": "FLASHINFER_TRTLLM",
        "flashinfer_cutlass": "FLASHINFER_CUTLASS",
        "aiter": "AITER",
    }),
    batched_variants=frozen({"TRITON": "BATCHED_TRITON"}),
    batched_requests=frozenset({"batched_triton"}),
    priority=frozen({
        Vendor.CUDA: ("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "TRITON", "BATCHED_TRITON"),
        Vendor.ROCM: ("AITER", "TRITON", "BATCHED_TRITON"),
        Vendor.XPU: ("XPU", "TRITON"),
        Vendor.CPU: ("CPU",),
    }),
    reorders=(
        Reorder(when=(CudaCapability(families=(9,)),), backends=FI, to="back",
                because="on Hopper the FlashInfer unquantized kernels are slower than Triton"),
        Reorder(when=(ParallelRule("dp_size > 1", lambda p: p.dp_size > 1),), backends=("FLASHINFER_CUTLASS",),
                to="back", because="FlashInfer CUTLASS BF16 crashes under DP+EP for Qwen3.5 (vLLM's HACK)"),
        Reorder(when=(Activations((Activation.SWIGLUOAI,)),), backends=FI, to="back",
                because="unquantized FlashInfer aliases SwiGLU-OAI to plain SwiGLU (vLLM's HACK)"),
    ),
    unsupported_message="Unquantized MoE backend {backend} does not support the deployment configuration since {reason}.",
    exhausted_message="No Unquantized MoE backend supports the deployment configuration.",
)
