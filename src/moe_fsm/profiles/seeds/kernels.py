"""The seeds profile's kernel classes, with their support conditions as data.

Conditions come from vLLM's ``is_supported_config`` implementations (see
``shared/reference``): device and capability, importable entry points,
accepted (weight, activation) quantization keys, activations, activation
format, parallel limits, LoRA. A kernel that moe-fsm can run names its
implementation (``impl``); the others are modelled so a decision about them is
explained, and building them fails with a true reason.

Another profile may import these specs and the building blocks below where
vLLM has not changed them (a profile is data; sharing is explicit).
"""

from __future__ import annotations

from moe_fsm.backends.specs import KernelSpec
from moe_fsm.backends.requirements import (
    Activations, CudaCapability, EnvEnabled, Format, Importable, InputDtypes, MaxExperts,
    NoLoRA, OnVendor, ParallelRule, QuantSchemes, ShapeMultiple,
)
from moe_fsm.inputs.layer import Activation
from moe_fsm.inputs.parallel import AllToAllKind
from moe_fsm.inputs.platform import Library, Vendor
from moe_fsm.inputs.quant import (
    FP8_DYNAMIC_GROUP128, FP8_DYNAMIC_TENSOR, FP8_DYNAMIC_TOKEN, FP8_STATIC_BLOCK128,
    FP8_STATIC_CHANNEL, FP8_STATIC_TENSOR, FP8_STATIC_TOKEN, NVFP4_DYNAMIC, NVFP4_STATIC,
)
from moe_fsm.inputs.formats import ActivationFormat

STANDARD = Format(ActivationFormat.STANDARD)
BATCHED = Format(ActivationFormat.BATCHED)
ALL_ACTIVATIONS = Activations(tuple(Activation))
SILU_ONLY = Activations((Activation.SILU,))
HALF_DTYPES = InputDtypes(("bfloat16", "float16"))

UNQUANTIZED = (None, None)
NVFP4 = (NVFP4_STATIC, NVFP4_DYNAMIC)
NVFP4_W4A16 = (NVFP4_STATIC, None)
FP8_BLOCK = (FP8_STATIC_BLOCK128, FP8_DYNAMIC_GROUP128)
FP8_TENSOR_STATIC = (FP8_STATIC_TENSOR, FP8_STATIC_TENSOR)
FP8_TENSOR_DYNAMIC = (FP8_STATIC_TENSOR, FP8_DYNAMIC_TENSOR)
FP8_CHANNEL_TOKEN = (FP8_STATIC_CHANNEL, FP8_DYNAMIC_TOKEN)
FP8_TENSOR_TOKEN = (FP8_STATIC_TENSOR, FP8_DYNAMIC_TOKEN)
FP8_EVERY = (
    FP8_BLOCK, FP8_CHANNEL_TOKEN, FP8_TENSOR_TOKEN, FP8_TENSOR_STATIC, FP8_TENSOR_DYNAMIC,
    (FP8_STATIC_CHANNEL, FP8_STATIC_TOKEN), (FP8_STATIC_TENSOR, FP8_STATIC_TOKEN),
    (FP8_STATIC_CHANNEL, FP8_DYNAMIC_TENSOR), (FP8_STATIC_CHANNEL, FP8_STATIC_TENSOR),
    (FP8_STATIC_BLOCK128, FP8_DYNAMIC_TOKEN), (FP8_STATIC_BLOCK128, FP8_DYNAMIC_TENSOR),
    (FP8_STATIC_BLOCK128, FP8_STATIC_TENSOR), (FP8_STATIC_BLOCK128, FP8_STATIC_TOKEN),
    (FP8_STATIC_TENSOR, FP8_DYNAMIC_GROUP128), (FP8_STATIC_CHANNEL, FP8_DYNAMIC_GROUP128),
)


def _has_fp8(ctx) -> bool:
    return ctx.platform.supports_fp8


def _cap(major: int, minor: int):
    return lambda ctx: ctx.platform.is_capability(major, minor)


def _cap_at_least(major: int):
    return lambda ctx: ctx.platform.has_capability(major, 0)


NO_EXPERT_MAP_A2A = ParallelRule(
    "no DeepEP high-throughput or FlashInfer all-to-all (they do not pass an expert map)",
    lambda p: not (p.use_all2all_kernels and p.all2all in (AllToAllKind.DEEPEP_HIGH_THROUGHPUT, AllToAllKind.FLASHINFER_ALL2ALLV)),
)
NO_FI_A2A = ParallelRule(
    "no FlashInfer all-to-all",
    lambda p: not (p.use_all2all_kernels and p.all2all is AllToAllKind.FLASHINFER_ALL2ALLV),
)
AG_RS_ONLY = ParallelRule(
    "no all-to-all kernels other than all-gather/reduce-scatter",
    lambda p: not p.use_all2all_kernels or p.all2all is AllToAllKind.ALLGATHER_REDUCESCATTER,
)
NO_EP = ParallelRule("ep_size == 1", lambda p: p.ep_size == 1)
EP_WITHOUT_DP = ParallelRule(
    "expert parallelism without data parallelism (FlashInfer CUTLASS unquantized MoE)",
    lambda p: p.use_ep and not p.use_dp,
)


TRITON_DEVICE = (CudaCapability(minimum=(8, 0), also=(Vendor.ROCM,)), Importable(Library.TRITON))
TRITON_SCHEMES = QuantSchemes((UNQUANTIZED,), gated=(("with FP8 hardware", _has_fp8, (FP8_BLOCK, FP8_CHANNEL_TOKEN, FP8_TENSOR_TOKEN, FP8_TENSOR_STATIC, FP8_TENSOR_DYNAMIC)),))
DEEPGEMM_DEVICE = (CudaCapability(exact=((9, 0),), families=(10,)), Importable(Library.DEEP_GEMM))
VLLM_CUTLASS_DEVICE = (CudaCapability(exact=((9, 0),), families=(10,)), Importable(Library.VLLM_OPS))
VLLM_CUTLASS_FP8 = QuantSchemes((FP8_CHANNEL_TOKEN, FP8_TENSOR_DYNAMIC, FP8_TENSOR_STATIC))
FI_CUTLASS_DEVICE = (CudaCapability(exact=((9, 0),), families=(10, 12)), Importable(Library.FLASHINFER_CUTLASS_MOE))
FI_TRTLLM_DEVICE = (CudaCapability(families=(10,)), Importable(Library.FLASHINFER_TRTLLM_MOE))
# Block FP8 (128x128 weight blocks, 1x128 activation groups): kernels that take whole blocks only.
DEEPGEMM_BLOCKS = ShapeMultiple(128, (FP8_STATIC_BLOCK128,), "DeepGEMM's grouped GEMM: vLLM's _valid_deep_gemm_shape")
FI_CUTLASS_BLOCKS = ShapeMultiple(128, (FP8_STATIC_BLOCK128,), "FlashInfer CUTLASS's 128-wide FP8 block scales")
TRTLLM_BLOCKS = ShapeMultiple(128, (FP8_STATIC_BLOCK128,), "TRTLLM's DeepSeek FP8 layout: vLLM's prepare_deepseek_fp8_x_sf")

KERNELS: dict[str, KernelSpec] = {k.name: k for k in (
    KernelSpec("TorchExperts", ActivationFormat.STANDARD,
               (QuantSchemes((UNQUANTIZED, NVFP4, NVFP4_W4A16) + FP8_EVERY), ALL_ACTIVATIONS, STANDARD),
               impl="moe_fsm.experts.torch_experts:TorchExperts"),
    KernelSpec("TorchBatchedExperts", ActivationFormat.BATCHED,
               (QuantSchemes((UNQUANTIZED, NVFP4, NVFP4_W4A16) + FP8_EVERY), ALL_ACTIVATIONS, BATCHED, NoLoRA()),
               impl="moe_fsm.experts.torch_experts:TorchBatchedExperts"),
    KernelSpec("TritonExperts", ActivationFormat.STANDARD,
               TRITON_DEVICE + (ALL_ACTIVATIONS, TRITON_SCHEMES, NO_FI_A2A, STANDARD,
                                MaxExperts(1024, "kernel's moe_align_block_size")),
               impl="moe_fsm.experts.triton_experts:TritonExperts"),
    KernelSpec("BatchedTritonExperts", ActivationFormat.BATCHED,
               TRITON_DEVICE + (ALL_ACTIVATIONS, TRITON_SCHEMES, BATCHED, NoLoRA()),
               impl="moe_fsm.experts.triton_experts:BatchedTritonExperts"),
    KernelSpec("FlashInferExperts", ActivationFormat.STANDARD,
               FI_CUTLASS_DEVICE + (
                   Activations((Activation.SILU, Activation.SWIGLUOAI)),
                   QuantSchemes((), gated=(
                       ("compute capability 9.0+", _cap_at_least(9), (UNQUANTIZED, FP8_TENSOR_STATIC)),
                       ("compute capability 9.0 exactly", _cap(9, 0), (FP8_BLOCK,)),
                       ("compute capability 10.0+", _cap_at_least(10), (NVFP4,)),
                   )),
                   FI_CUTLASS_BLOCKS, STANDARD, HALF_DTYPES, NoLoRA()),
               impl="moe_fsm.experts.flashinfer_experts:FlashInferCutlassExperts",
               library_note="flashinfer.fused_moe.cutlass_fused_moe"),
    KernelSpec("TrtLlmBf16ExpertsMonolithic", ActivationFormat.STANDARD,
               FI_TRTLLM_DEVICE + (SILU_ONLY, QuantSchemes((UNQUANTIZED,)), STANDARD, InputDtypes(("bfloat16",)), NoLoRA()),
               library_note="FlashInfer's TRTLLM-gen fused MoE (flashinfer.fused_moe.trtllm_bf16_moe), Blackwell only"),
    KernelSpec("TrtLlmFp8ExpertsMonolithic", ActivationFormat.STANDARD,
               FI_TRTLLM_DEVICE + (Activations((Activation.SILU, Activation.SWIGLUOAI)),
                                   QuantSchemes((FP8_BLOCK, FP8_TENSOR_STATIC)), TRTLLM_BLOCKS, AG_RS_ONLY,
                                   MaxExperts(2049, "TRTLLM routing"), STANDARD, NoLoRA()),
               library_note="FlashInfer's TRTLLM-gen fused MoE (flashinfer.fused_moe.trtllm_fp8_*_moe), Blackwell only"),
    KernelSpec("TrtLlmFp8ExpertsModular", ActivationFormat.STANDARD,
               FI_TRTLLM_DEVICE + (Activations((Activation.SILU, Activation.SWIGLUOAI)),
                                   QuantSchemes((FP8_BLOCK,)), TRTLLM_BLOCKS, AG_RS_ONLY, STANDARD, NoLoRA()),
               library_note="FlashInfer's TRTLLM-gen fused MoE (flashinfer.fused_moe.trtllm_fp8_block_scale_routed_moe), Blackwell only"),
    KernelSpec("TrtLlmNvFp4ExpertsMonolithic", ActivationFormat.STANDARD,
               FI_TRTLLM_DEVICE + (ALL_ACTIVATIONS, QuantSchemes((NVFP4,)), AG_RS_ONLY, STANDARD, NoLoRA()),
               library_note="FlashInfer's TRTLLM-gen fused MoE (flashinfer.fused_moe.trtllm_fp4_block_scale_moe), Blackwell only"),
    KernelSpec("TrtLlmNvFp4ExpertsModular", ActivationFormat.STANDARD,
               FI_TRTLLM_DEVICE + (ALL_ACTIVATIONS, QuantSchemes((NVFP4,)), STANDARD, NoLoRA()),
               library_note="FlashInfer's TRTLLM-gen fused MoE (flashinfer.fused_moe.trtllm_fp4_block_scale_routed_moe), Blackwell only"),
    KernelSpec("FlashInferCuteDSLExperts", ActivationFormat.STANDARD,
               (CudaCapability(families=(10,)), Importable(Library.FLASHINFER_CUTEDSL_MOE), SILU_ONLY,
                QuantSchemes((NVFP4,)), STANDARD, NoLoRA()),
               library_note="FlashInfer's CuTe DSL masked grouped GEMM (flashinfer.cute_dsl.grouped_gemm_nt_masked)"),
    KernelSpec("FlashInferCuteDSLBatchedExperts", ActivationFormat.BATCHED,
               (CudaCapability(families=(10,)), Importable(Library.FLASHINFER_CUTEDSL_MOE), SILU_ONLY,
                QuantSchemes((NVFP4,)), BATCHED, NoLoRA()),
               library_note="FlashInfer's CuTe DSL masked grouped GEMM (flashinfer.cute_dsl.grouped_gemm_nt_masked)"),
    KernelSpec("FlashInferB12xExperts", ActivationFormat.STANDARD,
               (CudaCapability(families=(12,)), Importable(Library.FLASHINFER_B12X_MOE), SILU_ONLY,
                QuantSchemes((NVFP4, NVFP4_W4A16)), STANDARD, NoLoRA()),
               library_note="FlashInfer's b12x SM12x NVFP4 MoE (flashinfer.fused_moe.B12xNvfp4Runner)"),
    KernelSpec("CutlassExpertsFp4", ActivationFormat.STANDARD,
               (CudaCapability(families=(10, 11, 12)), Importable(Library.VLLM_OPS), ALL_ACTIVATIONS,
                QuantSchemes((NVFP4,)), NO_EP, STANDARD, NoLoRA()),
               library_note="vLLM's own CUTLASS NVFP4 grouped GEMM (vllm._custom_ops)"),
    KernelSpec("TritonOrDeepGemmExperts", ActivationFormat.STANDARD,
               DEEPGEMM_DEVICE + TRITON_DEVICE + (SILU_ONLY, QuantSchemes((FP8_BLOCK,)), DEEPGEMM_BLOCKS, NO_FI_A2A,
                                                  STANDARD, NoLoRA()),
               library_note="DeepGEMM (deep_gemm) behind vLLM's Triton fallback"),
    KernelSpec("BatchedDeepGemmExperts", ActivationFormat.BATCHED,
               DEEPGEMM_DEVICE + (SILU_ONLY, QuantSchemes((FP8_BLOCK,)), DEEPGEMM_BLOCKS, BATCHED, NoLoRA()),
               library_note="DeepGEMM's masked grouped GEMM (deep_gemm)"),
    KernelSpec("TritonOrCutlassExperts", ActivationFormat.STANDARD,
               VLLM_CUTLASS_DEVICE + TRITON_DEVICE + (ALL_ACTIVATIONS, VLLM_CUTLASS_FP8, NO_EXPERT_MAP_A2A, STANDARD, NoLoRA()),
               library_note="vLLM's own CUTLASS FP8 grouped GEMM (vllm._custom_ops)"),
    KernelSpec("CutlassBatchedExpertsFp8", ActivationFormat.BATCHED,
               VLLM_CUTLASS_DEVICE + (ALL_ACTIVATIONS, VLLM_CUTLASS_FP8, BATCHED, NoLoRA()),
               library_note="vLLM's own CUTLASS FP8 grouped GEMM (vllm._custom_ops)"),
    KernelSpec("MarlinExperts", ActivationFormat.STANDARD,
               (CudaCapability(minimum=(7, 5)), Importable(Library.VLLM_OPS), ALL_ACTIVATIONS,
                QuantSchemes((FP8_BLOCK, FP8_CHANNEL_TOKEN, FP8_TENSOR_STATIC, NVFP4), weight_only=True),
                NO_FI_A2A, STANDARD),
               library_note="vLLM's Marlin weight-only kernels (vllm._custom_ops)"),
    KernelSpec("AiterExperts", ActivationFormat.STANDARD,
               (OnVendor((Vendor.ROCM,)), Importable(Library.AITER),
                EnvEnabled(("VLLM_ROCM_USE_AITER", "VLLM_ROCM_USE_AITER_MOE")),
                Activations((Activation.SILU, Activation.GELU, Activation.SWIGLUOAI)),
                QuantSchemes((UNQUANTIZED, FP8_BLOCK, FP8_TENSOR_STATIC, FP8_TENSOR_DYNAMIC, FP8_CHANNEL_TOKEN)),
                NO_FI_A2A, STANDARD, NoLoRA()),
               library_note="AMD's AITER fused MoE (aiter)"),
    KernelSpec("XPUExperts", ActivationFormat.STANDARD,
               (OnVendor((Vendor.XPU,)), QuantSchemes((UNQUANTIZED,)), STANDARD),
               library_note="the XPU platform's own MoE kernels"),
    KernelSpec("XPUExpertsFp8", ActivationFormat.STANDARD,
               (OnVendor((Vendor.XPU,)), QuantSchemes((FP8_TENSOR_DYNAMIC, FP8_TENSOR_STATIC, FP8_BLOCK)), STANDARD),
               library_note="the XPU platform's own MoE kernels"),
    KernelSpec("TPUExperts", ActivationFormat.STANDARD, (OnVendor((Vendor.TPU,)),),
               library_note="the TPU platform's own MoE path"),
    KernelSpec("OOTExperts", ActivationFormat.STANDARD, (OnVendor((Vendor.OUT_OF_TREE,)),),
               library_note="the out-of-tree platform plugin's own MoE path"),
)}

ON_CPU = OnVendor((Vendor.CPU,))

# When the FP8 oracle returns NONE, the platform runs the layer its own way;
# on a CPU that way is moe-fsm's FP8 emulation.
FALLBACK_KERNELS: dict[Vendor, tuple[str, ...]] = {Vendor.CPU: ("TorchExperts", "TorchBatchedExperts")}
