"""vLLM 0.33.0's experts classes that only the MX and integer families use, with their support checks.

Each spec lists its requirements in the order vLLM's ``is_supported_config``
evaluates them: a class's own checks before or after the generic chain, as
its override has them (generic: device, activation, quantization scheme,
parallel config, activation format, VLLM_BATCH_INVARIANT, LoRA), so the first
failure is vLLM's reason. Sources are named per spec, relative to
``vllm/model_executor/layers/fused_moe/``; docs/vllm-0.33-families.md has the
reading. Activations are the intersection of a class's set with moe-fsm's
(silu, swigluoai, gelu). Classes the older families share (TritonExperts,
Marlin, Humming, FlashInfer CUTLASS, TRTLLM FP8, XPU, b12x, MoE-EP) live in
``kernels.py`` with their MX and integer schemes. ``impl`` names moe-fsm's
own kernel of a class's algorithm (the weight-quantized Triton MoE);
``SUBSTITUTES`` the classes moe-fsm builds as its torch experts of the same
numerics, where those take the scheme (build's business, never the decision's).
"""

from __future__ import annotations

from moe_fsm.backends.requirements import (
    Activations, Condition, CudaCapability, EnvEnabled, Importable, InputDtypes, NoLoRA, OnVendor, ParallelRule,
    QuantSchemes,
)
from moe_fsm.backends.specs import KernelSpec
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.layer import Activation
from moe_fsm.inputs.parallel import AllToAllKind
from moe_fsm.inputs.platform import Library, Vendor
from moe_fsm.inputs.quant import (
    INT8_ACTIVATION_SCALES, INT8_WEIGHT_SCALES, MXFP4_ACTIVATIONS, UINT8_STATIC_GROUP, W4A8_INT8_GROUP, W4A8_INT8_GROUPS,
    FP8_DYNAMIC_GROUP128, FP8_DYNAMIC_TOKEN, FP8_STATIC_BLOCK128, FP8_STATIC_TENSOR, INT4_STATIC_GROUP,
    INT4_STATIC_GROUP32, INT8_DYNAMIC_TOKEN, INT8_STATIC_CHANNEL, INT8_STATIC_GROUP, MXFP4_DYNAMIC, MXFP4_STATIC,
    MXFP8_DYNAMIC, MXFP8_STATIC, UINT4_STATIC_GROUP, UINT4_STATIC_GROUP32, W4A8_INT8_CHANNEL, W4A8_INT8_GROUP32,
    W4A8_INT8_GROUP64, W4A8_INT8_GROUP128,
)
from moe_fsm.profiles.seeds.kernels import KERNELS as SEEDS_KERNELS
from moe_fsm.profiles.vllm_0_33.kernels import (
    ALL, CUDA_ALIKE_OR_XPU, DEEP_GEMM_SUPPORTED, NO_A2A_BUT_AG_RS, NO_EP, NO_FI_A2A, NOT_BATCH_INVARIANT, SILU,
    SILU_SWIGLUOAI, STANDARD, TRITON_EXPERT_LIMIT, intermediate_per_partition,
)

OAI_ONLY = Activations((Activation.SWIGLUOAI,))
TRITON_MXFP4 = "moe_fsm.experts.triton_wq_experts:TritonMxfp4Experts"
TRITON_WNA16 = "moe_fsm.experts.triton_wq_experts:TritonWna16Experts"

# vLLM's quant keys: kInt4Static, kInt4Static32 (symmetric, "uint4b8"), their asymmetric uint4 forms, kInt8Static.
INT4_SYM = (INT4_STATIC_GROUP, INT4_STATIC_GROUP32)
INT4_EVERY = (*INT4_SYM, UINT4_STATIC_GROUP, UINT4_STATIC_GROUP32)
INT8_W8A8 = (INT8_STATIC_CHANNEL, INT8_DYNAMIC_TOKEN)  # kInt8StaticChannelSym x kInt8DynamicTokenSym


def weight_only(*weights) -> tuple:
    return tuple((w, None) for w in weights)


def _device(text: str, holds) -> Condition:
    return Condition(text, holds, lambda ctx: f"kernel does not support current device {ctx.platform.describe()}")


def _rocm(*prefixes: str):
    """vLLM's on_gfx* helpers: the ROCm device's gfx architecture."""
    return lambda ctx: ctx.platform.vendor is Vendor.ROCM and (ctx.platform.gcn_arch or "").startswith(prefixes)


def _cpu(arch: str, amx: bool = False) -> Condition:
    """current_platform.get_cpu_architecture() and, for the x86 kernels, torch.cpu._is_amx_tile_supported().

    vLLM's message names only the device; where the architecture is right and the tiles are missing, the
    reason says so, since that is what an operator on an AMD EPYC or a pre-Sapphire Rapids Xeon needs to read.
    """
    def fails(ctx) -> str:
        text = f"kernel does not support current device {ctx.platform.describe()}"
        if amx and ctx.platform.vendor is Vendor.CPU and ctx.platform.cpu_arch == arch:
            text += ", which has no AMX tiles (torch.cpu._is_amx_tile_supported() is False)"
        return text

    return Condition(f"a {arch} CPU" + (" with AMX tiles" if amx else ""),
                     lambda ctx: ctx.platform.vendor is Vendor.CPU and ctx.platform.cpu_arch == arch
                     and (ctx.platform.cpu_amx or not amx), fails)


def _mxfp8_activations(ctx) -> bool:
    """B12xExperts' W4A8 checks apply when the backend is asked about MXFP8 activations."""
    return ctx.layer.quant.activation == MXFP8_DYNAMIC


# gpt_oss_triton_kernels_moe._triton_kernel_moe_supports_current_device, then has_triton_kernels().
TRITON_KERNELS_DEVICE = (
    _device("CUDA 9.0 <= capability < 13.0, or ROCm gfx9 (gfx90a, gfx94x, gfx95x) / gfx11 / gfx12",
            lambda ctx: (ctx.platform.vendor is Vendor.CUDA and (9, 0) <= ctx.platform.capability < (13, 0))
            or _rocm("gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")(ctx)),
    Importable(Library.TRITON_KERNELS),
)
# rocm_aiter_ops.is_enabled() (VLLM_ROCM_USE_AITER, aiter on gfx9) and is_fused_moe_enabled() (+ VLLM_ROCM_USE_AITER_MOE).
AITER_SUPPORTED = (_device("ROCm CDNA3 or newer (gfx942, gfx950, gfx1250) with aiter importable",
                           lambda ctx: _rocm("gfx942", "gfx950", "gfx1250")(ctx) and ctx.platform.has(Library.AITER)),)
AITER_ON = (*AITER_SUPPORTED, EnvEnabled(("VLLM_ROCM_USE_AITER",)))
AITER_MOE_ON = (*AITER_SUPPORTED, EnvEnabled(("VLLM_ROCM_USE_AITER", "VLLM_ROCM_USE_AITER_MOE")))
SUPPORTS_MX = _device("ROCm with MX types (supports_mx: gfx95x, gfx1250)", _rocm("gfx95", "gfx1250"))
NO_FI_OR_DEEPEP_HT = ParallelRule(
    "no FlashInfer or DeepEP high-throughput all-to-all",
    lambda p: not (p.use_all2all_kernels and p.all2all in (AllToAllKind.FLASHINFER_ALL2ALLV,
                                                           AllToAllKind.DEEPEP_HIGH_THROUGHPUT)),
)
DP_AT_MOST_1_NO_A2A = ParallelRule("no all-to-all kernels and dp_size <= 1",
                                   lambda p: not p.use_all2all_kernels and p.dp_size <= 1)


def _spec(name, *requirements, fmt=ActivationFormat.STANDARD, impl=None, note=""):
    return KernelSpec(name, fmt, tuple(requirements), impl=impl, library_note=note)


KERNELS: dict[str, KernelSpec] = {k.name: k for k in (
    # -- MXFP4 ---------------------------------------------------------------------------------------------
    _spec("DeepGemmFP4Experts",  # experts/deep_gemm_moe.py
          DEEP_GEMM_SUPPORTED, CudaCapability(families=(10, 12)), SILU,
          QuantSchemes(((MXFP4_STATIC, FP8_DYNAMIC_GROUP128),)), NO_FI_A2A, STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="DeepGEMM's FP8 x FP4 grouped GEMM (deep_gemm)"),
    _spec("TrtLlmMxfp4ExpertsMonolithic",  # experts/trtllm_mxfp4_moe.py
          CudaCapability(families=(10,)), Importable(Library.FLASHINFER), SILU_SWIGLUOAI,
          QuantSchemes(((MXFP4_STATIC, None), (MXFP4_STATIC, MXFP8_DYNAMIC))), DP_AT_MOST_1_NO_A2A, STANDARD,
          NOT_BATCH_INVARIANT, NoLoRA(), note="FlashInfer's TRTLLM-gen MXFP4 fused MoE, Blackwell only"),
    _spec("TrtLlmMxfp4ExpertsModular",
          CudaCapability(families=(10,)), Importable(Library.FLASHINFER), SILU_SWIGLUOAI,
          QuantSchemes(((MXFP4_STATIC, None), (MXFP4_STATIC, MXFP8_DYNAMIC))), STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="FlashInfer's TRTLLM-gen MXFP4 routed MoE, Blackwell only"),
    _spec("TrtLlmMxfp4LoRAExperts",  # experts/trtllm_lora_moe.py: first for an explicit flashinfer_trtllm with LoRA
          CudaCapability(families=(10,)), Importable(Library.FLASHINFER_TRTLLM_MOE), SILU_SWIGLUOAI,
          QuantSchemes(((MXFP4_STATIC, None),)),
          ParallelRule("dp_size == 1 and no all-to-all kernels", lambda p: p.dp_size == 1 and not p.use_all2all_kernels),
          STANDARD, NOT_BATCH_INVARIANT, note="FlashInfer's TRTLLM-gen MXFP4 MoE with vLLM's LoRA hooks, Blackwell only"),
    # experts/cutlass_moe.py; the compiled mxfp4_experts_quant_supported(cap) is read as the SM100 family.
    _spec("CutlassExpertsMxfp4",
          CudaCapability(families=(10,)), Importable(Library.VLLM_OPS), ALL,
          QuantSchemes(((MXFP4_STATIC, MXFP4_DYNAMIC),)), NO_FI_OR_DEEPEP_HT, STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="vLLM's own CUTLASS MXFP4 x MXFP4 grouped GEMM (vllm._custom_ops)"),
    _spec("OAITritonMxfp4ExpertsMonolithic",  # experts/gpt_oss_triton_kernels_moe.py
          *TRITON_KERNELS_DEVICE, OAI_ONLY, QuantSchemes(((MXFP4_STATIC, None),)), DP_AT_MOST_1_NO_A2A, STANDARD,
          NOT_BATCH_INVARIANT, NoLoRA(), impl=TRITON_MXFP4,
          note="OpenAI's triton_kernels matmul_ogs MXFP4 MoE (gpt-oss), fused routing; moe-fsm runs its MXFP4 Triton MoE"),
    _spec("OAITritonExperts",
          *TRITON_KERNELS_DEVICE, OAI_ONLY, QuantSchemes(((MXFP4_STATIC, None),)), STANDARD, NOT_BATCH_INVARIANT,
          NoLoRA(), impl=TRITON_MXFP4,
          note="OpenAI's triton_kernels matmul_ogs MXFP4 MoE (gpt-oss), modular; moe-fsm runs its MXFP4 Triton MoE"),
    _spec("UnfusedOAITritonExperts",
          *TRITON_KERNELS_DEVICE, ALL, QuantSchemes(((MXFP4_STATIC, None),)), STANDARD, NOT_BATCH_INVARIANT,
          note="OpenAI's triton_kernels MXFP4 GEMMs with vLLM's activation between them; LoRA-capable"),
    _spec("AiterMxfp4Experts",  # experts/rocm_aiter_moe.py (AiterExperts' device check)
          *AITER_MOE_ON, ALL,
          QuantSchemes((), gated=(
              ("ROCm gfx950", _rocm("gfx950"), ((MXFP4_STATIC, None), (MXFP4_STATIC, MXFP4_DYNAMIC))),
              ("ROCm gfx942", _rocm("gfx942"), ((INT4_STATIC_GROUP32, None),)),
          )),
          NO_FI_A2A, STANDARD, NOT_BATCH_INVARIANT, NoLoRA(), note="AMD's AITER CK MXFP4 fused MoE (aiter)"),
    _spec("AiterW4A16ExpertsMonolithic",  # experts/aiter_mxfp4_w4a16_moe.py
          *AITER_ON, _device("ROCm gfx942, gfx950 or gfx1250", _rocm("gfx942", "gfx950", "gfx1250")), SILU_SWIGLUOAI,
          QuantSchemes(((MXFP4_STATIC, None),)), DP_AT_MOST_1_NO_A2A, STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="AMD's AITER Triton moe_gemm_a16w4 (aiter)"),
    _spec("AiterW4A8ExpertsMonolithic",  # experts/aiter_mxfp4_w4a8_moe.py
          *AITER_ON, _device("ROCm gfx950 or gfx1250", _rocm("gfx950", "gfx1250")), OAI_ONLY,
          QuantSchemes(((MXFP4_STATIC, FP8_STATIC_TENSOR),)),
          ParallelRule("no expert parallelism and dp_size <= 1", lambda p: not p.use_ep and p.dp_size <= 1),
          STANDARD, NOT_BATCH_INVARIANT, NoLoRA(), note="AMD's AITER Triton MXFP4 x FP8 MoE (aiter)"),
    _spec("AiterW4A4ExpertsMonolithic",  # experts/aiter_mxfp4_w4a4_moe.py
          *AITER_ON, _device("ROCm gfx1250", _rocm("gfx1250")), SILU_SWIGLUOAI,
          QuantSchemes(((MXFP4_STATIC, MXFP4_DYNAMIC),)), DP_AT_MOST_1_NO_A2A, STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="AMD's AITER Triton/Gluon moe_gemm_a4w4 (aiter)"),
    _spec("XPUExpertsMxFp4",  # experts/xpu_moe.py
          OnVendor((Vendor.XPU,)), ALL, QuantSchemes(((MXFP4_STATIC, None), (MXFP4_STATIC, MXFP4_DYNAMIC))), STANDARD,
          NOT_BATCH_INVARIANT, NoLoRA(), note="the XPU platform's MXFP4 MoE kernels"),
    _spec("CPUExpertsMxfp4",  # experts/cpu_moe.py
          _cpu("x86", amx=True), ALL, QuantSchemes(((MXFP4_STATIC, None),)), STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="vLLM's AMX MXFP4 CPU kernel; moe-fsm runs its torch experts of the same numerics"),
    # experts/ocp_mx_emulation_moe.py: amd-quark first, then TritonExperts' checks; any scheme.
    _spec("OCP_MXQuantizationEmulationTritonExperts",
          Condition("amd-quark importable", lambda ctx: ctx.platform.has(Library.AMD_QUARK),
                    "kernel requires amd-quark package"),
          CUDA_ALIKE_OR_XPU, ALL, NO_FI_A2A, STANDARD, TRITON_EXPERT_LIMIT,
          note="vLLM's OCP MX emulation (dequantize, then its Triton MoE); moe-fsm runs its torch experts"),
    # -- MXFP8 ---------------------------------------------------------------------------------------------
    _spec("DeepGemmExperts",  # experts/deep_gemm_moe.py (MXFP8 resolves to it directly, not the Triton wrapper)
          DEEP_GEMM_SUPPORTED, SILU,
          QuantSchemes(((FP8_STATIC_BLOCK128, FP8_DYNAMIC_GROUP128),), gated=(
              ("compute capability 10.x", lambda ctx: ctx.platform.is_capability_family(10),
               ((MXFP8_STATIC, MXFP8_DYNAMIC),)),
          )),
          NO_FI_A2A, STANDARD, NOT_BATCH_INVARIANT, NoLoRA(), note="DeepGEMM's grouped GEMM; MXFP8 1x32 on Blackwell"),
    # experts/mxfp8_native_moe.py, mxfp8_emulation_moe.py, aiter_mxfp8_moe.py: Mxfp8TritonExpertsBase(TritonExperts).
    _spec("Mxfp8NativeTritonExperts",
          SUPPORTS_MX, ALL, QuantSchemes(((MXFP8_STATIC, MXFP8_DYNAMIC),)), NO_FI_A2A, STANDARD, TRITON_EXPERT_LIMIT,
          note="vLLM's Triton dot_scaled MXFP8 MoE on CDNA4 matrix cores"),
    _spec("Mxfp8EmulationTritonExperts",
          ALL, QuantSchemes(((MXFP8_STATIC, MXFP8_DYNAMIC),)), NO_FI_A2A, STANDARD, TRITON_EXPERT_LIMIT,
         
          note="vLLM's MXFP8 emulation (its device check is always true); moe-fsm runs its torch experts"),
    _spec("AiterMxfp8Experts",  # AITER's gate mode (an aiter version feature) is taken as present with aiter
          SUPPORTS_MX, *AITER_MOE_ON, ALL, QuantSchemes(((MXFP8_STATIC, MXFP8_DYNAMIC),)), STANDARD,
          NOT_BATCH_INVARIANT, TRITON_EXPERT_LIMIT,
          Condition("SiLU (or SwiGLU-OAI uninterleaved)", lambda ctx: ctx.layer.activation is Activation.SILU,
                    lambda ctx: "kernel supports only SiLU or SwiGLU-OAI activation; "
                                f"got activation={ctx.layer.activation.value}"),
          note="AMD's AITER FlyDSL MXFP8 MoE (aiter)"),
    # -- INT8 W8A8: experts/cpu_moe.py ----------------------------------------------------------------------
    _spec("ZenCPUExpertsInt8",
          Importable(Library.ZENTORCH), ALL, QuantSchemes((INT8_W8A8,)), NO_EP, STANDARD, NOT_BATCH_INVARIANT,
          NoLoRA(), note="AMD zentorch's fused MoE (zentorch_fused_moe)"),
    _spec("PowerCPUExpertsInt8",
          _cpu("powerpc"), Importable(Library.VLLM_CPU_INT8_MOE), ALL, QuantSchemes((INT8_W8A8,)), NO_EP, STANDARD,
          NOT_BATCH_INVARIANT, NoLoRA(),
          Condition("float32 or bfloat16 activations", lambda ctx: ctx.layer.dtype in ("float32", "bfloat16"),
                    "kernel requires float32 or bfloat16 activations"),
          Condition("hidden size divisible by 16", lambda ctx: ctx.layer.hidden_size % 16 == 0,
                    "kernel requires hidden dim divisible by 16"),
          Condition("per-rank intermediate size divisible by 16", lambda ctx: intermediate_per_partition(ctx) % 16 == 0,
                    "kernel requires intermediate dim divisible by 16"),
          note="vLLM's POWER CPU INT8 MoE (torch.ops._C.cpu_fused_moe_int8)"),
    _spec("ArmCPUExpertsInt8",
          _cpu("arm"), Importable(Library.VLLM_CPU_INT8_MOE), ALL, QuantSchemes((INT8_W8A8,)), NO_EP, STANDARD,
          NOT_BATCH_INVARIANT, NoLoRA(),
          Condition("hidden size divisible by 32", lambda ctx: ctx.layer.hidden_size % 32 == 0,
                    "kernel requires hidden dim divisible by 32"),
          Condition("per-rank intermediate size divisible by 32", lambda ctx: intermediate_per_partition(ctx) % 32 == 0,
                    "kernel requires intermediate dim divisible by 32"),
          note="vLLM's Arm CPU INT8 MoE (torch.ops._C.cpu_fused_moe_int8)"),
    _spec("CPUExpertsInt8",
          _cpu("x86", amx=True), SILU, QuantSchemes((INT8_W8A8,)), STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          Condition("hidden size divisible by 32", lambda ctx: ctx.layer.hidden_size % 32 == 0,
                    "kernel requires hidden dim divisible by 32"),
          note="vLLM's AMX INT8 CPU kernel; moe-fsm runs its torch experts of the same numerics"),
    # -- INT WNA16 -----------------------------------------------------------------------------------------
    _spec("Rdna3WNA16Experts",  # experts/rdna3_moe.py
          _device("ROCm gfx1100", _rocm("gfx1100")), Importable(Library.VLLM_RDNA3_MOE), ALL,
          QuantSchemes(weight_only(*INT4_SYM)), NO_FI_A2A, STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="vLLM's RDNA3 GPTQ MoE HIP kernel (torch.ops._rocm_C.moe_gptq_gemm_rdna3)"),
    _spec("TrtLlmMxint4ExpertsMonolithic",  # experts/trtllm_mxint4_moe.py, utils/flashinfer_mxint4_moe.py
          CudaCapability(families=(10,)), EnvEnabled(("VLLM_USE_FLASHINFER_MOE_INT4",)),
          Importable(Library.FLASHINFER_TRTLLM_MOE), SILU_SWIGLUOAI, QuantSchemes(((INT4_STATIC_GROUP32, None),)),
          NO_A2A_BUT_AG_RS, STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="FlashInfer's TRTLLM-gen MXINT4 MoE, Blackwell only"),
    _spec("TritonWNA16Experts",  # experts/triton_moe.py (TritonExperts' device, LoRA and expert-count checks)
          CUDA_ALIKE_OR_XPU, ALL, QuantSchemes(weight_only(*INT4_EVERY, INT8_STATIC_GROUP), weight_only=True),
          NO_FI_A2A, STANDARD, TRITON_EXPERT_LIMIT, impl=TRITON_WNA16,
          note="vLLM's Triton fused MoE with INT4/INT8 dequantization in the GEMM (moe-fsm's weight-quantized Triton MoE)"),
    _spec("XPUExpertsWNA16",  # experts/xpu_moe.py
          OnVendor((Vendor.XPU,)), ALL, QuantSchemes(weight_only(*INT4_SYM)), STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="the XPU platform's INT4 MoE kernels"),
    _spec("cpu_moe.CPUExpertsInt4",  # experts/cpu_moe.py's CPUExpertsInt4 (the oracle's CPU backend)
          _cpu("x86", amx=True), SILU, QuantSchemes(((INT4_STATIC_GROUP, None),)), STANDARD, NOT_BATCH_INVARIANT,
          NoLoRA(),
          note="vLLM's AMX INT4 CPU kernel; moe-fsm runs its torch experts of the same numerics"),
    _spec("ZentorchExpertsInt4",  # experts/zentorch_moe.py
          Importable(Library.ZENTORCH), ALL, QuantSchemes(weight_only(*INT4_SYM)), NO_EP, STANDARD, NOT_BATCH_INVARIANT,
          NoLoRA(), Condition("bfloat16 activations", lambda ctx: ctx.layer.dtype == "bfloat16",
                              "kernel requires bfloat16 activations"),
          Condition("top_k >= 2", lambda ctx: ctx.layer.top_k >= 2, "kernel requires experts_per_token >= 2"),
          note="AMD zentorch's INT4 fused MoE (zentorch_fused_moe, zentorch_woq_repack_weight)"),
    _spec("Int4EmulationTritonExperts",  # experts/int4_emulation_moe.py
          OnVendor((Vendor.CUDA, Vendor.ROCM)), ALL, QuantSchemes(weight_only(*INT4_EVERY)), NO_FI_A2A, STANDARD,
          TRITON_EXPERT_LIMIT,
          note="vLLM's INT4 emulation (dequantize, then its Triton MoE); moe-fsm runs its torch experts"),
    # -- W4A8 (FP8 activations): experts/cutlass_moe.py; the dtype check comes before the generic chain ------
    _spec("CutlassExpertsW4A8Fp8",
          Condition("bfloat16 activations", lambda ctx: ctx.layer.dtype == "bfloat16",
                    lambda ctx: f"kernel does not support torch.{ctx.layer.dtype} input/output dtype"),
          CudaCapability(exact=((9, 0),)), Importable(Library.VLLM_OPS), ALL,
          QuantSchemes(((INT4_STATIC_GROUP, FP8_DYNAMIC_TOKEN),)), STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="vLLM's CUTLASS INT4 x FP8 grouped GEMM (cutlass_group_gemm_supported), Hopper only"),
    # -- W4A8-INT8 (CPU): experts/cpu_int4_moe.py's CPUExpertsInt4, own checks first ------------------------
    # The caller builds GroupShape(1, G) for the weight key, so a group other than 32/64/128 matches no key.
    _spec("cpu_int4_moe.CPUExpertsInt4",
          Condition("an Arm CPU", lambda ctx: ctx.platform.vendor is Vendor.CPU and ctx.platform.cpu_arch == "arm",
                    "kernel only supports Arm CPU"),
          InputDtypes(("float32", "bfloat16", "float16")),
          Condition("torch's _dyn_quant 4-bit ops", lambda ctx: ctx.platform.has(Library.TORCH_DYN_QUANT_4BIT),
                    "PyTorch does not support _dyn_quant_* 4bit ops. Install a newer version"),
          OnVendor((Vendor.CPU,)), SILU_SWIGLUOAI,
          QuantSchemes(weight_only(W4A8_INT8_CHANNEL, W4A8_INT8_GROUP128, W4A8_INT8_GROUP64, W4A8_INT8_GROUP32)),
          ParallelRule("ep_size == 1", lambda p: p.ep_size == 1), STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="vLLM's KleidiAI INT4 CPU MoE (torch.ops.aten._dyn_quant_matmul_4bit), Arm only"),
)}

# moe-fsm's torch experts dequantize every scheme the six families can hold (moe_fsm.quantize), beside the
# seeds' ones: the vllm-0.33 profile's TorchExperts says so, so it can stand in for the classes below.
_SEEDS_TORCH = SEEDS_KERNELS["TorchExperts"]
MX_INT_SCHEMES = (
    *((MXFP4_STATIC, a) for a in MXFP4_ACTIVATIONS.values()), (MXFP8_STATIC, MXFP8_DYNAMIC),
    *((w, a) for w in INT8_WEIGHT_SCALES.values() for a in INT8_ACTIVATION_SCALES.values()),
    *weight_only(*INT4_EVERY, INT8_STATIC_GROUP, UINT8_STATIC_GROUP), (INT4_STATIC_GROUP, FP8_DYNAMIC_TOKEN),
    *weight_only(*W4A8_INT8_GROUPS.values(), W4A8_INT8_GROUP, W4A8_INT8_CHANNEL),
)
KERNELS["TorchExperts"] = KernelSpec(
    "TorchExperts", _SEEDS_TORCH.activation_format,
    tuple(QuantSchemes((*r.pairs, *MX_INT_SCHEMES), r.weight_only, r.gated) if isinstance(r, QuantSchemes) else r
          for r in _SEEDS_TORCH.requirements),
    impl=_SEEDS_TORCH.impl, library_note=_SEEDS_TORCH.library_note,
)

# Kernels moe-fsm runs with its torch experts of the same numerics (where TorchExperts takes the scheme).
SUBSTITUTES: dict[str, str] = {name: "TorchExperts" for name in (
    "CPUExpertsMxfp4",
    "OCP_MXQuantizationEmulationTritonExperts",
    "Mxfp8EmulationTritonExperts",
    "CPUExpertsInt8",
    "cpu_moe.CPUExpertsInt4",
    "Int4EmulationTritonExperts",
    "cpu_int4_moe.CPUExpertsInt4",
)}
