"""vLLM 0.33.0's experts classes for the unquantized, FP8 and NVFP4 oracles, with their support checks.

Each ``KernelSpec`` is one class that ``backend_to_kernel_cls`` names, its
requirements taken from the class's ``is_supported_config`` and ``_supports_*``
methods (``vllm/model_executor/layers/fused_moe/experts/*.py``; the common
chain is ``FusedMoEExperts.is_supported_config`` in ``modular_kernel.py``:
device, activation, quantization scheme, parallel config, routing, format,
VLLM_BATCH_INVARIANT, LoRA). moe-fsm's inputs cover gated SiLU / SwiGLU-OAI /
GELU layers routed by plain top-k renormalize with router logits in the input
dtype; checks on anything else (hash routing, expert bias, EPLB, sequence
parallelism) always pass for them and are left out. Where vLLM checks no
library, none is required here either (Marlin and TritonExperts ask only the
device). docs/vllm-0.33-oracles.md has the notes, class by class.
"""

from __future__ import annotations

from moe_fsm.backends.requirements import (
    Activations, Condition, CudaCapability, EnvOff, Format, Importable, LoRAEnabled, NoLoRA, OnVendor, ParallelRule,
    QuantSchemes,
)
from moe_fsm.backends.specs import KernelSpec
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.layer import Activation
from moe_fsm.inputs.parallel import AllToAllKind
from moe_fsm.inputs.platform import Library, Vendor
from moe_fsm.inputs.quant import (
    FP8_DYNAMIC_GROUP128, FP8_DYNAMIC_TENSOR, FP8_DYNAMIC_TOKEN, FP8_STATIC_BLOCK128, FP8_STATIC_CHANNEL,
    FP8_STATIC_TENSOR, INT4_STATIC_GROUP, INT4_STATIC_GROUP32, INT8_DYNAMIC_TENSOR, INT8_DYNAMIC_TOKEN,
    INT8_STATIC_CHANNEL, INT8_STATIC_GROUP, INT8_STATIC_TENSOR, MXFP4_DYNAMIC, MXFP4_STATIC, MXFP8_DYNAMIC,
    MXFP8_STATIC, NVFP4_DYNAMIC, NVFP4_STATIC, UINT4_STATIC_GROUP, UINT4_STATIC_GROUP32,
)
from moe_fsm.profiles.seeds.kernels import KERNELS as SEEDS

STANDARD = Format(ActivationFormat.STANDARD)
BATCHED = Format(ActivationFormat.BATCHED)
ALL = Activations((Activation.SILU, Activation.SWIGLUOAI, Activation.GELU))
SILU = Activations((Activation.SILU,))
SILU_SWIGLUOAI = Activations((Activation.SILU, Activation.SWIGLUOAI))
SILU_GELU = Activations((Activation.SILU, Activation.GELU))
NOT_BATCH_INVARIANT = EnvOff("VLLM_BATCH_INVARIANT", "batch invariance")

UNQUANTIZED = (None, None)
FP8_BLOCK = (FP8_STATIC_BLOCK128, FP8_DYNAMIC_GROUP128)
FP8_CHANNEL_TOKEN = (FP8_STATIC_CHANNEL, FP8_DYNAMIC_TOKEN)
FP8_TENSOR_TOKEN = (FP8_STATIC_TENSOR, FP8_DYNAMIC_TOKEN)
FP8_TENSOR_STATIC = (FP8_STATIC_TENSOR, FP8_STATIC_TENSOR)
FP8_TENSOR_DYNAMIC = (FP8_STATIC_TENSOR, FP8_DYNAMIC_TENSOR)
FP8_TRITON = (FP8_BLOCK, FP8_CHANNEL_TOKEN, FP8_TENSOR_TOKEN, FP8_TENSOR_STATIC, FP8_TENSOR_DYNAMIC)
NVFP4 = (NVFP4_STATIC, NVFP4_DYNAMIC)
NVFP4_W4A16 = (NVFP4_STATIC, None)
# The MX and integer families' keys (vLLM's kMxfp4Static, kMxfp8Static/Dynamic, kInt4Static(32)(Asym), kInt8Static,
# kInt8StaticChannelSym x kInt8DynamicTokenSym, ...), for the classes those families share with the ones above.
MXFP4_W4A16 = (MXFP4_STATIC, None)
MXFP4_MXFP8 = (MXFP4_STATIC, MXFP8_DYNAMIC)
MXFP8 = (MXFP8_STATIC, MXFP8_DYNAMIC)
INT4_EVERY = (INT4_STATIC_GROUP, INT4_STATIC_GROUP32, UINT4_STATIC_GROUP, UINT4_STATIC_GROUP32)
INT8_W8A8 = (INT8_STATIC_CHANNEL, INT8_DYNAMIC_TOKEN)
INT8_TENSOR = (INT8_STATIC_TENSOR, INT8_DYNAMIC_TENSOR)
MARLIN_MX_INT_WEIGHTS = tuple((w, None) for w in (MXFP4_STATIC, MXFP8_STATIC, *INT4_EVERY, INT8_STATIC_GROUP))
HUMMING_MX_INT = (
    MXFP4_W4A16, (MXFP4_STATIC, MXFP4_DYNAMIC), MXFP4_MXFP8, (MXFP4_STATIC, FP8_DYNAMIC_TOKEN),
    (MXFP4_STATIC, FP8_DYNAMIC_GROUP128), (MXFP4_STATIC, INT8_DYNAMIC_TOKEN),
    (MXFP8_STATIC, None), (MXFP8_STATIC, FP8_DYNAMIC_TOKEN), MXFP8,
    (INT4_STATIC_GROUP, None), (INT4_STATIC_GROUP, FP8_DYNAMIC_TOKEN),
    (INT8_STATIC_GROUP, None), (INT8_STATIC_GROUP, FP8_DYNAMIC_TOKEN),
    (INT8_STATIC_CHANNEL, None), INT8_W8A8,
    # _is_supported_wna16_weight_key: unsigned integer weights whose groups have a width (not the generic -1)
    *((w, a) for w in (INT4_STATIC_GROUP32, UINT4_STATIC_GROUP32) for a in (None, FP8_DYNAMIC_TOKEN, INT8_DYNAMIC_TOKEN)),
)


def _a2a(p, *kinds) -> bool:
    return p.use_all2all_kernels and p.all2all in kinds


NO_FI_A2A = ParallelRule("no FlashInfer all-to-all", lambda p: not _a2a(p, AllToAllKind.FLASHINFER_ALL2ALLV))
NO_FI_OR_DEEPEP_HT = ParallelRule(
    "no FlashInfer or DeepEP high-throughput all-to-all",
    lambda p: not _a2a(p, AllToAllKind.FLASHINFER_ALL2ALLV, AllToAllKind.DEEPEP_HIGH_THROUGHPUT),
)
NO_A2A_BUT_AG_RS = ParallelRule(
    "no all-to-all kernels other than all-gather/reduce-scatter",
    lambda p: not p.use_all2all_kernels or p.all2all is AllToAllKind.ALLGATHER_REDUCESCATTER,
)
NO_A2A = ParallelRule("no all-to-all kernels", lambda p: not p.use_all2all_kernels)
A2A_NOT_AG_RS_OR_DEEPEP_HT = ParallelRule(
    "all-to-all kernels other than all-gather/reduce-scatter and DeepEP high-throughput",
    lambda p: p.use_all2all_kernels and p.all2all not in (AllToAllKind.ALLGATHER_REDUCESCATTER,
                                                          AllToAllKind.DEEPEP_HIGH_THROUGHPUT),
)
NO_EP = ParallelRule("no expert parallelism", lambda p: not p.use_ep)

CUDA_ALIKE_OR_XPU = OnVendor((Vendor.CUDA, Vendor.ROCM, Vendor.XPU))
BLACKWELL_TRTLLM = (CudaCapability(families=(10,)), Importable(Library.FLASHINFER_TRTLLM_MOE))
AITER_ENABLED = Condition(
    "ROCm CDNA3+ with aiter importable, VLLM_ROCM_USE_AITER=1 and VLLM_ROCM_USE_AITER_MOE=1 (rocm_aiter_ops.is_fused_moe_enabled)",
    lambda ctx: ctx.platform.vendor is Vendor.ROCM and ctx.platform.has(Library.AITER)
    and (ctx.platform.gcn_arch or "").startswith(("gfx942", "gfx950"))
    and ctx.env.value("VLLM_ROCM_USE_AITER") and ctx.env.value("VLLM_ROCM_USE_AITER_MOE"),
    "kernel does not support current device. AITER MoE is not enabled — set VLLM_ROCM_USE_AITER=1 and "
    "VLLM_ROCM_USE_AITER_MOE=1 to enable it",
)
DEEP_GEMM_SUPPORTED = Condition(
    "is_deep_gemm_supported(): compute capability 9.0, 10.x or 12.x, VLLM_USE_DEEP_GEMM on, deep_gemm importable",
    lambda ctx: (ctx.platform.is_capability(9, 0) or ctx.platform.is_capability_family(10)
                 or ctx.platform.is_capability_family(12))
    and bool(ctx.env.value("VLLM_USE_DEEP_GEMM")) and ctx.platform.has(Library.DEEP_GEMM),
    "kernel does not support current device (DeepGEMM needs compute capability 9.0, 10.x or 12.x, "
    "VLLM_USE_DEEP_GEMM on and deep_gemm importable)",
)
CUTLASS_GROUP_GEMM = Condition(
    "cutlass_group_gemm_supported(): vLLM's compiled ops on compute capability 9.0 to 10.x",
    lambda ctx: ctx.platform.capability is not None and (9, 0) <= ctx.platform.capability < (11, 0)
    and ctx.platform.has(Library.VLLM_OPS),
    "kernel does not support current device (vLLM's CUTLASS grouped GEMM needs compute capability 9.0-10.x)",
)
def cpu_device(arch: str, amx: bool = False, note: str = "") -> Condition:
    """``_supports_current_device`` of vLLM's CPU experts: ``current_platform.get_cpu_architecture()`` and, for
    the x86 kernels, ``torch.cpu._is_amx_tile_supported()`` (PlatformFacts.cpu_arch / cpu_amx)."""
    return Condition(
        f"{'an' if arch in ('x86', 'arm') else 'a'} {arch} CPU" + (" with AMX tiles" if amx else "") + note,
        lambda ctx: ctx.platform.vendor is Vendor.CPU and ctx.platform.cpu_arch == arch
        and (ctx.platform.cpu_amx or not amx),
        lambda ctx: f"kernel does not support current device {ctx.platform.device_name} "
                    f"(needs {'an' if arch in ('x86', 'arm') else 'a'} {arch} CPU{' with AMX tiles' if amx else ''})",
    )


X86_AMX = cpu_device("x86", amx=True)
# CPUExpertsFp8W8A8._supports_current_device: is_cpu() and cpu_has_amx_fp8(), a compiled probe of the CPU's
# AMX-FP8 instructions. moe-fsm's PlatformFacts record AMX tiles (cpu_amx) but not AMX-FP8, so this cannot be
# checked from the facts moe-fsm has: it is taken as absent, and the reason says so.
AMX_FP8 = Condition(
    "a CPU with native AMX-FP8 (vLLM's cpu_has_amx_fp8(); not a fact moe-fsm's platform facts record: taken as absent)",
    lambda ctx: False,
    lambda ctx: f"kernel does not support current device {ctx.platform.device_name} (needs native AMX-FP8, "
                "vLLM's cpu_has_amx_fp8(); moe-fsm's platform facts do not record AMX-FP8, so it is taken as absent)",
)
CPU_BF16_ONLY = Condition("bfloat16 activations", lambda ctx: ctx.layer.dtype == "bfloat16",
                          "kernel requires bfloat16 activations")


def _fp8_hardware(ctx) -> bool:
    """current_platform.supports_fp8(): CUDA 8.9+, ROCm CDNA/RDNA, and XPU (XPUPlatform says True)."""
    return ctx.platform.supports_fp8 or ctx.platform.vendor is Vendor.XPU


def _batched_fp8_hardware(ctx) -> bool:
    """BatchedTritonExperts: ROCm CDNA3+ (or RDNA4), or CUDA 8.9+."""
    p = ctx.platform
    if p.vendor is Vendor.ROCM:
        return (p.gcn_arch or "").startswith(("gfx942", "gfx950", "gfx1250", "gfx1200", "gfx1201"))
    return p.vendor is Vendor.CUDA and p.has_capability(8, 9)


def _int8_hardware(ctx) -> bool:
    """TritonExperts' INT8 pairs: CUDA 7.5+ (Turing INT8 tensor cores), ROCm, XPU."""
    p = ctx.platform
    return p.vendor in (Vendor.ROCM, Vendor.XPU) or (p.vendor is Vendor.CUDA and p.has_capability(7, 5))


def _humming_gemm_type(kind: str) -> Condition:
    """HummingExpertsBase.is_supported_config, after the generic chain: the class's gemm type is the preferred one.

    get_humming_moe_gemm_type: VLLM_HUMMING_MOE_GEMM_TYPE when set and not auto
    (grouped means grouped_contiguous), else grouped_contiguous with expert
    parallelism, else indexed.
    """
    def preferred(ctx) -> str:
        env = ctx.env.value("VLLM_HUMMING_MOE_GEMM_TYPE")
        if env and env != "auto":
            return "grouped_contiguous" if env == "grouped" else env
        return "grouped_contiguous" if ctx.parallel.use_ep else "indexed"

    return Condition(f"the preferred Humming gemm type is {kind}", lambda ctx: preferred(ctx) == kind,
                     lambda ctx: f"preferred gemm type {preferred(ctx)} != supported gemm type {kind}")


def _cap_at_least(major, minor=0):
    return lambda ctx: ctx.platform.has_capability(major, minor)


def _padded_experts_below_1024(ctx) -> bool:
    if ctx.platform.vendor not in (Vendor.CUDA, Vendor.ROCM):
        return True
    return -(-ctx.layer.num_experts // 32) * 32 < 1024


TRITON_EXPERT_LIMIT = Condition("fewer than 1024 padded experts on CUDA/ROCm (moe_align_block_size)",
                                _padded_experts_below_1024,
                                "kernel's moe_align_block_size requires fewer than 1024 padded experts")
AT_MOST_2048_EXPERTS = Condition("at most 2048 experts (FlashInfer TRTLLM routing)",
                                 lambda ctx: ctx.layer.num_experts <= 2048,
                                 "FlashInfer TRTLLM routing supports at most 2048 experts")
ROUTER_LOGITS_BF16_FP32 = Condition("router logits (the input dtype) bfloat16 or float32",
                                    lambda ctx: ctx.layer.dtype in ("bfloat16", "float32"),
                                    "kernel does not support router logits dtype float16")
BF16_ONLY = Condition("bfloat16 activations", lambda ctx: ctx.layer.dtype == "bfloat16",
                      "kernel does not support this input/output dtype (bfloat16 only)")
HALF_ONLY = Condition("float16 or bfloat16 activations", lambda ctx: ctx.layer.dtype in ("bfloat16", "float16"),
                      "kernel does not support this input/output dtype")
TRTLLM_FP8_CLAMP = Condition(
    "a SwiGLU clamp only with block-scaled FP8 or MXFP8 and SiLU",
    lambda ctx: ctx.layer.swiglu_limit is None or (
        (ctx.layer.quant.weight, ctx.layer.quant.activation) in (FP8_BLOCK, MXFP8)
        and ctx.layer.activation is Activation.SILU),
    "the TRTLLM FP8 kernels apply the SwiGLU alpha/beta/clamp parameters only for block-scaled weights with a "
    "SwiGLU activation",
)
TRTLLM_LORA_INTERMEDIATE = Condition(
    "per-partition intermediate size a multiple of 128 (the oracle's TRTLLM LoRA gate)",
    lambda ctx: intermediate_per_partition(ctx) % 128 == 0,
    "the FlashInfer TRTLLM LoRA kernel needs the per-partition intermediate size to be a multiple of 128",
)


def intermediate_per_partition(ctx) -> int:
    """vLLM's intermediate_size_per_partition: TP is flattened across DP; with EP experts are whole."""
    p = ctx.parallel
    return ctx.layer.intermediate_size // (1 if p.use_ep else p.tp_size * p.dp_size)


NO_EXPERT_BIAS = Condition("no expert biases", lambda ctx: not ctx.layer.bias, "kernel does not support expert biases")


def _mxfp4_w4a8(ctx) -> bool:
    """b12x's MXFP4 W4A8 path: MXFP4 weights asked about MXFP8 activations."""
    return (ctx.layer.quant.weight, ctx.layer.quant.activation) == MXFP4_MXFP8


B12X_MXFP4 = (
    Condition("MXFP4: per-rank intermediate size divisible by 32",
              lambda ctx: ctx.layer.quant.weight != MXFP4_STATIC
              or intermediate_per_partition(ctx) % 32 == 0,
              "MXFP4 requires the per-rank intermediate size to be divisible by 32"),
    Condition("MXFP4 W4A8: SiLU", lambda ctx: not _mxfp4_w4a8(ctx) or ctx.layer.activation is Activation.SILU,
              "MXFP4 W4A8 supports only SiLU and SiTU"),
    Condition("MXFP4 W4A8: hidden size divisible by 256", lambda ctx: not _mxfp4_w4a8(ctx) or ctx.layer.hidden_size % 256 == 0,
              "MXFP4 W4A8 requires hidden size divisible by 256 and per-rank intermediate size divisible by 32"),
)


def cpu_grouped_gemm(output_alignment: int, reduction_alignment: int) -> Condition:
    """CPUUnquantizedExperts._supports_grouped_gemm with a class's alignments: hidden size and the per-partition
    intermediate size (padded to lcm(output, reduction) unless SwiGLU-OAI) divisible by each."""
    import math

    lcm = math.lcm(output_alignment, reduction_alignment)

    def padded(ctx) -> int:
        per_partition = intermediate_per_partition(ctx)
        return per_partition if ctx.layer.activation is Activation.SWIGLUOAI else -(-per_partition // lcm) * lcm

    def failure(ctx) -> str:
        size = padded(ctx)
        if ctx.layer.hidden_size % output_alignment or size % output_alignment:
            return f"kernel requires hidden and intermediate dimensions divisible by {output_alignment}"
        return f"kernel requires reduction dimensions divisible by {reduction_alignment}"

    return Condition(
        f"hidden and (padded) intermediate sizes divisible by {output_alignment} and {reduction_alignment}",
        lambda ctx: all(ctx.layer.hidden_size % a == 0 and padded(ctx) % a == 0
                        for a in (output_alignment, reduction_alignment)),
        failure,
    )


def _zentorch_or(grouped_gemm: Condition) -> Condition:
    """CPUUnquantizedExperts.is_supported_config after the generic chain: zentorch's fused MoE takes any gated
    SiLU / SwiGLU-OAI / GELU layer (is_zentorch_moe_config_supported), else the grouped GEMM's alignment."""
    return Condition(
        f"zentorch's fused MoE (zentorch_fused_moe), or {grouped_gemm.text}",
        lambda ctx: ctx.platform.has(Library.ZENTORCH) or grouped_gemm.holds(ctx),
        grouped_gemm.failure_text,
    )


def _spec(name, fmt, *requirements, impl=None, note=""):
    return KernelSpec(name, fmt, tuple(requirements), impl=impl, library_note=note)


S, B = ActivationFormat.STANDARD, ActivationFormat.BATCHED
TRITON_IMPL = SEEDS["TritonExperts"].impl
BATCHED_TRITON_IMPL = SEEDS["BatchedTritonExperts"].impl
FI_CUTLASS_IMPL = SEEDS["FlashInferExperts"].impl

KERNELS: dict[str, KernelSpec] = {k.name: k for k in (
    # -- Triton (experts/triton_moe.py, fused_batched_moe.py) --------------------------------------------
    _spec("TritonExperts", S, CUDA_ALIKE_OR_XPU, ALL,
          QuantSchemes((UNQUANTIZED,), gated=(("with INT8 hardware (CUDA 7.5+, ROCm, XPU)", _int8_hardware,
                                               (INT8_W8A8, INT8_TENSOR)),
                                              ("with FP8 hardware", _fp8_hardware, FP8_TRITON))),
          NO_FI_A2A, STANDARD, TRITON_EXPERT_LIMIT, impl=TRITON_IMPL),
    _spec("BatchedTritonExperts", B, CUDA_ALIKE_OR_XPU, ALL,
          QuantSchemes((UNQUANTIZED,), gated=(("with FP8 hardware (CUDA 8.9+, ROCm CDNA3+)", _batched_fp8_hardware,
                                               FP8_TRITON),)),
          BATCHED, NOT_BATCH_INVARIANT, NoLoRA(), impl=BATCHED_TRITON_IMPL),
    # -- FlashInfer CUTLASS (experts/flashinfer_cutlass_moe.py) -------------------------------------------
    _spec("FlashInferExperts", S,
          CudaCapability(exact=((9, 0),), families=(10, 12)), Importable(Library.FLASHINFER_CUTLASS_MOE),
          SILU_SWIGLUOAI,
          QuantSchemes((), gated=(
              ("compute capability 9.0+", _cap_at_least(9), (UNQUANTIZED, FP8_TENSOR_STATIC)),
              ("compute capability 9.0 exactly", lambda ctx: ctx.platform.is_capability(9, 0), (FP8_BLOCK, MXFP4_W4A16)),
              ("compute capability 10.0+", _cap_at_least(10), (NVFP4, MXFP4_MXFP8)),
          )),
          STANDARD, NOT_BATCH_INVARIANT, NoLoRA(), impl=FI_CUTLASS_IMPL,
          note="flashinfer.fused_moe.cutlass_fused_moe"),
    # -- FlashInfer TRTLLM BF16 (experts/trtllm_bf16_moe.py, trtllm_lora_moe.py) --------------------------
    _spec("TrtLlmBf16ExpertsMonolithic", S, *BLACKWELL_TRTLLM, SILU, QuantSchemes((UNQUANTIZED,)), NO_A2A_BUT_AG_RS,
          STANDARD, NOT_BATCH_INVARIANT, NoLoRA(), AT_MOST_2048_EXPERTS,
          note="FlashInfer's TRTLLM-gen BF16 fused MoE, Blackwell only"),
    _spec("TrtLlmBf16ExpertsModular", S, *BLACKWELL_TRTLLM, SILU, QuantSchemes((UNQUANTIZED,)),
          A2A_NOT_AG_RS_OR_DEEPEP_HT, STANDARD, NOT_BATCH_INVARIANT, NoLoRA(), AT_MOST_2048_EXPERTS,
          note="FlashInfer's TRTLLM-gen BF16 routed MoE, Blackwell only"),
    _spec("TrtLlmBf16LoRAExperts", S, *BLACKWELL_TRTLLM, SILU, QuantSchemes((UNQUANTIZED,)), NO_A2A_BUT_AG_RS,
          STANDARD, NOT_BATCH_INVARIANT, TRTLLM_LORA_INTERMEDIATE, LoRAEnabled(),
          note="FlashInfer's TRTLLM-gen BF16 MoE with LoRA deltas (reached only from the LoRA step)"),
    # -- AITER (experts/rocm_aiter_moe.py) ----------------------------------------------------------------
    *(_spec(name, S, AITER_ENABLED, ALL, QuantSchemes(pairs), NO_FI_A2A, STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
            note="AMD's AITER fused MoE (aiter)")
      for name, pairs in (
          ("AiterUnquantizedExperts", (UNQUANTIZED,)),
          ("AiterFp8BlockExperts", (FP8_BLOCK,)),
          ("AiterFp8TensorExperts", (FP8_TENSOR_STATIC, FP8_TENSOR_DYNAMIC)),
          ("AiterFp8ChannelExperts", (FP8_CHANNEL_TOKEN,)),
      )),
    # -- XPU (experts/xpu_moe.py) -------------------------------------------------------------------------
    _spec("XPUExperts", S, OnVendor((Vendor.XPU,)), ALL,
          QuantSchemes((UNQUANTIZED, (FP8_STATIC_TENSOR, None), FP8_TENSOR_DYNAMIC)), STANDARD, NOT_BATCH_INVARIANT,
          NoLoRA(), note="the XPU platform's MoE kernels (vllm_xpu_kernels)"),
    _spec("XPUExpertsFp8", S, OnVendor((Vendor.XPU,)), ALL,
          QuantSchemes(((FP8_STATIC_TENSOR, None), FP8_TENSOR_DYNAMIC)), STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="the XPU platform's MoE kernels (vllm_xpu_kernels)"),
    _spec("XPUExpertsMxFp8", S, OnVendor((Vendor.XPU,)), ALL, QuantSchemes(((MXFP8_STATIC, None), MXFP8)), STANDARD,
          NOT_BATCH_INVARIANT,
          NoLoRA(), note="the XPU platform's MXFP8 MoE kernels"),
    _spec("XPUExpertsBlockFp8", S, OnVendor((Vendor.XPU,)), ALL, QuantSchemes((FP8_BLOCK,)), STANDARD,
          NOT_BATCH_INVARIANT, NoLoRA(), note="the XPU platform's block-FP8 MoE kernels"),
    # -- CPU (experts/cpu_moe.py): the x86 AMX / Arm NEON / Power VSX grouped GEMMs, then the portable one ----
    # Each variant: its device (architecture; x86 also AMX tiles), the generic chain, then bfloat16 and its
    # grouped GEMM alignment (output, reduction); the portable class: zentorch's fused MoE or alignment (32, 1).
    *(_spec(name, S, device, ALL, QuantSchemes((UNQUANTIZED,)), STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
            CPU_BF16_ONLY, cpu_grouped_gemm(*alignment), note=f"vLLM's CPU MoE kernels ({isa} grouped GEMM)")
      for name, device, alignment, isa in (
          ("X86CPUUnquantizedExperts", X86_AMX, (32, 32), "AMX"),
          # vLLM also refuses macOS (sys.platform == "darwin"); moe-fsm's Arm CPU facts describe a Linux host.
          ("ArmCPUUnquantizedExperts", cpu_device("arm", note=" (not macOS: moe-fsm's Arm facts are a Linux host)"),
           (32, 4), "NEON"),
          ("PowerCPUUnquantizedExperts", cpu_device("powerpc"), (16, 2), "VSX"))),
    _spec("CPUUnquantizedExperts", S, OnVendor((Vendor.CPU,)), ALL, QuantSchemes((UNQUANTIZED,)), STANDARD,
          NOT_BATCH_INVARIANT, NoLoRA(), _zentorch_or(cpu_grouped_gemm(32, 1)),
          note="vLLM's portable CPU MoE"),
    _spec("CPUExpertsFp8", S, X86_AMX, SILU_GELU, QuantSchemes((FP8_BLOCK,)), STANDARD,
          NOT_BATCH_INVARIANT, NoLoRA(), note="vLLM's AMX FP8 W8A16 CPU MoE"),
    _spec("CPUExpertsFp8W8A8", S, AMX_FP8, SILU, QuantSchemes((FP8_BLOCK,)), STANDARD,
          NOT_BATCH_INVARIANT, NoLoRA(), note="vLLM's AMX-FP8 W8A8 CPU MoE"),
    # -- FlashInfer TRTLLM FP8 (experts/trtllm_fp8_moe.py): SiLU only (the packed SwiGLU-OAI layout only) -
    _spec("TrtLlmFp8ExpertsMonolithic", S, *BLACKWELL_TRTLLM, SILU, QuantSchemes((FP8_BLOCK, FP8_TENSOR_STATIC, MXFP8)),
          NO_A2A_BUT_AG_RS, ROUTER_LOGITS_BF16_FP32, STANDARD, NOT_BATCH_INVARIANT, NoLoRA(), TRTLLM_FP8_CLAMP,
          AT_MOST_2048_EXPERTS, note="FlashInfer's TRTLLM-gen FP8 fused MoE, Blackwell only"),
    _spec("TrtLlmFp8ExpertsModular", S, *BLACKWELL_TRTLLM, SILU, QuantSchemes((FP8_BLOCK, MXFP8)),
          ParallelRule("no all-to-all kernels other than all-gather/reduce-scatter, DeepEP v2 or FlashInfer",
                       lambda p: not p.use_all2all_kernels or p.all2all in (
                           AllToAllKind.ALLGATHER_REDUCESCATTER, AllToAllKind.FLASHINFER_ALL2ALLV)),
          STANDARD, NOT_BATCH_INVARIANT, NoLoRA(), TRTLLM_FP8_CLAMP, AT_MOST_2048_EXPERTS,
          note="FlashInfer's TRTLLM-gen FP8 routed MoE, Blackwell only"),
    # -- DeepGEMM (experts/triton_deep_gemm_moe.py, batched_deep_gemm_moe.py) ------------------------------
    _spec("TritonOrDeepGemmExperts", S, DEEP_GEMM_SUPPORTED, CUDA_ALIKE_OR_XPU, SILU,
          QuantSchemes((), gated=(("with FP8 hardware", _fp8_hardware, (FP8_BLOCK,)),)), NO_FI_A2A, STANDARD,
          NOT_BATCH_INVARIANT, NoLoRA(), note="DeepGEMM (deep_gemm) behind vLLM's Triton fallback"),
    _spec("BatchedDeepGemmExperts", B, DEEP_GEMM_SUPPORTED, SILU, QuantSchemes((FP8_BLOCK,)), BATCHED,
          NOT_BATCH_INVARIANT, NoLoRA(), note="DeepGEMM's masked grouped GEMM (deep_gemm)"),
    # -- vLLM CUTLASS (experts/triton_cutlass_moe.py, cutlass_moe.py) --------------------------------------
    _spec("TritonOrCutlassExperts", S, CUTLASS_GROUP_GEMM, CUDA_ALIKE_OR_XPU, ALL,
          QuantSchemes((FP8_CHANNEL_TOKEN, FP8_TENSOR_DYNAMIC, FP8_TENSOR_STATIC)), NO_FI_OR_DEEPEP_HT, STANDARD,
          NOT_BATCH_INVARIANT, NoLoRA(), note="vLLM's own CUTLASS FP8 grouped GEMM (vllm._custom_ops)"),
    _spec("CutlassBatchedExpertsFp8", B, CUTLASS_GROUP_GEMM, ALL,
          QuantSchemes((FP8_CHANNEL_TOKEN, FP8_TENSOR_DYNAMIC, FP8_TENSOR_STATIC)), BATCHED, NOT_BATCH_INVARIANT,
          NoLoRA(), note="vLLM's own CUTLASS FP8 grouped GEMM (vllm._custom_ops)"),
    _spec("CutlassExpertsFp4", S, CudaCapability(families=(10, 11, 12)), ALL, QuantSchemes((NVFP4,)),
          NO_FI_OR_DEEPEP_HT, STANDARD, NoLoRA(),
          note="vLLM's own CUTLASS NVFP4 grouped GEMM (vllm._custom_ops); batch invariant, expert parallel"),
    # -- Marlin, Humming, HPC ------------------------------------------------------------------------------
    _spec("MarlinExperts", S, CudaCapability(minimum=(7, 5)), ALL,
          QuantSchemes((FP8_BLOCK, FP8_CHANNEL_TOKEN, FP8_TENSOR_STATIC, NVFP4, *MARLIN_MX_INT_WEIGHTS), weight_only=True),
          NO_FI_A2A, STANDARD, NOT_BATCH_INVARIANT,
          note="vLLM's Marlin weight-only kernels (vllm._custom_ops); LoRA-capable"),
    _spec("BatchedMarlinExperts", B, CudaCapability(minimum=(7, 5)), ALL,
          QuantSchemes((FP8_BLOCK, FP8_CHANNEL_TOKEN, FP8_TENSOR_STATIC, NVFP4, *MARLIN_MX_INT_WEIGHTS), weight_only=True),
          NO_FI_A2A, BATCHED, NOT_BATCH_INVARIANT, NoLoRA(),
          note="vLLM's Marlin weight-only kernels, batched format (vllm._custom_ops)"),
    *(_spec(name, fmt, Importable(Library.HUMMING), CudaCapability(minimum=(7, 5)), ALL,
            QuantSchemes((FP8_BLOCK, FP8_CHANNEL_TOKEN, FP8_TENSOR_STATIC, FP8_TENSOR_TOKEN, NVFP4, NVFP4_W4A16,
                          (FP8_STATIC_BLOCK128, FP8_DYNAMIC_TOKEN), (FP8_STATIC_CHANNEL, FP8_STATIC_TENSOR),
                          (FP8_STATIC_CHANNEL, FP8_DYNAMIC_GROUP128), (FP8_STATIC_TENSOR, FP8_DYNAMIC_GROUP128),
                          *HUMMING_MX_INT)),
            Format(fmt), NoLoRA(), _humming_gemm_type(kind), note="the humming MoE kernels (humming)")
      for name, fmt, kind in (("BatchedHummingGroupedExperts", B, "grouped_masked"),
                              ("HummingGroupedExperts", S, "grouped_contiguous"),
                              ("HummingIndexedExperts", S, "indexed"))),
    _spec("HPCExperts", S, CudaCapability(exact=((9, 0),)), Importable(Library.HPC), SILU,
          QuantSchemes((FP8_TENSOR_STATIC, FP8_BLOCK)), STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="Tencent's hpc-ops MoE (hpc), Hopper only"),
    # -- NVFP4: FlashInfer TRTLLM, CuTe DSL, b12x; vLLM's b12x; emulation ------------------------------------
    _spec("TrtLlmNvFp4ExpertsMonolithic", S, *BLACKWELL_TRTLLM, SILU_GELU, QuantSchemes((NVFP4,)), NO_A2A,
          ROUTER_LOGITS_BF16_FP32, STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="FlashInfer's TRTLLM-gen NVFP4 fused MoE, Blackwell only"),
    _spec("TrtLlmNvFp4ExpertsModular", S, *BLACKWELL_TRTLLM, SILU_GELU, QuantSchemes((NVFP4,)), STANDARD,
          NOT_BATCH_INVARIANT, NoLoRA(), note="FlashInfer's TRTLLM-gen NVFP4 routed MoE, Blackwell only"),
    _spec("FlashInferCuteDSLExperts", S, CudaCapability(families=(10,)), Importable(Library.FLASHINFER_CUTEDSL_MOE),
          SILU_SWIGLUOAI, QuantSchemes((NVFP4,)), STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="FlashInfer's CuTe DSL NVFP4 MoE"),
    _spec("FlashInferCuteDSLBatchedExperts", B, CudaCapability(families=(10,)),
          Importable(Library.FLASHINFER_CUTEDSL_MOE), SILU, QuantSchemes((NVFP4,)), BATCHED, NOT_BATCH_INVARIANT,
          NoLoRA(), note="FlashInfer's CuTe DSL masked grouped GEMM"),
    _spec("FlashInferB12xExperts", S, CudaCapability(families=(12,)), Importable(Library.FLASHINFER_B12X_MOE), SILU,
          QuantSchemes((NVFP4, NVFP4_W4A16)), NO_EP, STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="FlashInfer's b12x SM12x NVFP4 MoE"),
    # b12x.py B12xExperts: its own checks (bias, dtype, the MXFP4 shape and W4A8 rules), then the generic chain.
    _spec("B12xExperts", S, NO_EXPERT_BIAS, HALF_ONLY, *B12X_MXFP4, CudaCapability(families=(12,)),
          Importable(Library.B12X), SILU, QuantSchemes((NVFP4, NVFP4_W4A16, MXFP4_MXFP8, MXFP4_W4A16)), NO_A2A, NO_EP,
          STANDARD, NOT_BATCH_INVARIANT, NoLoRA(),
          note="the b12x package's fused MoE (b12x)"),
    _spec("FlashInferMoeEpExperts", S, Condition(
              "compute capability 10.0 or 10.3", lambda ctx: ctx.platform.capability in ((10, 0), (10, 3)),
              "kernel does not support current device (needs compute capability 10.0 or 10.3)"),
          SILU, QuantSchemes((NVFP4, MXFP4_W4A16)),
          ParallelRule("expert parallelism in the standard format",
                       lambda p: p.use_ep and not p.batched_activation_format),
          STANDARD, NOT_BATCH_INVARIANT, NoLoRA(), BF16_ONLY, NO_EXPERT_BIAS,
          note="FlashInfer's MoE-EP megakernel (CuTe DSL)"),
    _spec("Nvfp4QuantizationEmulationTritonExperts", S, NoLoRA(), CUDA_ALIKE_OR_XPU, ALL, QuantSchemes((NVFP4,)),
          NO_FI_A2A, STANDARD, TRITON_EXPERT_LIMIT,
          note="vLLM's NVFP4 emulation on its Triton experts"),
)}

# Kernels moe-fsm does not implement but runs with the same numerics (build's business, never the decision's).
SUBSTITUTES: dict[str, str] = {"Nvfp4QuantizationEmulationTritonExperts": "TorchExperts",
                               "CPUUnquantizedExperts": "TorchExperts", "X86CPUUnquantizedExperts": "TorchExperts",
                               "ArmCPUUnquantizedExperts": "TorchExperts", "PowerCPUUnquantizedExperts": "TorchExperts"}

# Where the FP8 oracle returns NONE the platform runs the layer itself; on a CPU moe-fsm runs its emulation.
FALLBACK_KERNELS: dict[Vendor, tuple[str, ...]] = {Vendor.CPU: ("TorchExperts", "TorchBatchedExperts")}
KERNELS.update({name: SEEDS[name] for name in ("TorchExperts", "TorchBatchedExperts")})
