"""The machine, env and model facts SGLang 0.5.23's MoE resolution asks, as conditions on the decision's inputs.

SGLang asks its platform context (``srt/runtime_context.py``: ``is_sm90`` ... ``is_blackwell``, each a CUDA
major family with CUDA 12.3/12.8 or newer, which moe-fsm's facts do not record and assume), ``is_hip``,
``is_gfx95_supported()``, importable packages, and its env. Each is one ``Condition`` here, read from
``PlatformFacts``, the env snapshot and the layer's ``ModelFacts``; a rule combines them with conditions on the
server arguments resolved so far (``fsm/runner_steps.py``).
"""

from __future__ import annotations

from moe_fsm.backends.requirements import Condition, CudaCapability, Importable, OnVendor
from moe_fsm.inputs.layer import Activation
from moe_fsm.inputs.model_facts import ModelFacts
from moe_fsm.inputs.platform import Library, Vendor
from moe_fsm.inputs.quant import FP8_STATIC_BLOCK128, FP8_STATIC_CHANNEL, QuantFamily

NO_FACTS = ModelFacts()


def model(ctx) -> ModelFacts:
    return ctx.layer.model or NO_FACTS


CUDA = OnVendor((Vendor.CUDA,))
HIP = OnVendor((Vendor.ROCM,))
SM90 = CudaCapability(families=(9,))
SM100 = CudaCapability(families=(10,))
SM110 = CudaCapability(families=(11,))
SM120 = CudaCapability(families=(12,))
BLACKWELL = CudaCapability(families=(10, 11, 12))
AMPERE_TO_HOPPER = CudaCapability(families=(8, 9))  # (8, 0) <= capability < (10, 0)
GFX95 = Condition("a ROCm gfx95x GPU (is_gfx95_supported)",
                  lambda ctx: ctx.platform.vendor is Vendor.ROCM and (ctx.platform.gcn_arch or "").startswith("gfx95"),
                  "not a ROCm gfx95x GPU")
NOT_CPU = Condition("not a CPU (device != cpu)", lambda ctx: ctx.platform.vendor is not Vendor.CPU,
                    "the device is a CPU")
AMX_CPU = Condition("a CPU with AMX tiles (is_cpu() and has_amx)",
                    lambda ctx: ctx.platform.vendor is Vendor.CPU and ctx.platform.cpu_amx, "not a CPU with AMX tiles")
NOT_AMX_CPU = Condition("not a CPU with AMX tiles", lambda ctx: not AMX_CPU.holds(ctx), "a CPU with AMX tiles")
TRITON_KERNELS = Importable(Library.TRITON_KERNELS)
FLASHINFER = Importable(Library.FLASHINFER)


def negated(requirement, text: str | None = None) -> Condition:
    """Holds where ``requirement`` fails (the engine's ``not``)."""
    return Condition(text or f"not: {requirement.description}", lambda ctx: requirement.failure(ctx) is not None,
                     f"it holds: {requirement.description}")


SM110_OR_SM120 = CudaCapability(families=(11, 12))


def env_on(name: str) -> Condition:
    return Condition(f"{name} on", lambda ctx: bool(ctx.env.value(name)), f"{name} is off")


AITER = Condition("SGLANG_USE_AITER on a ROCm GPU (_use_aiter)",
                  lambda ctx: ctx.platform.vendor is Vendor.ROCM and bool(ctx.env.value("SGLANG_USE_AITER")),
                  "SGLANG_USE_AITER is off or this is not a ROCm GPU")
AITER_OR_HIP_INT4 = Condition(
    "SGLANG_USE_AITER or SGLANG_INT4_WEIGHT on a ROCm GPU (_use_aiter or _use_hip_int4)",
    lambda ctx: ctx.platform.vendor is Vendor.ROCM
    and bool(ctx.env.value("SGLANG_USE_AITER") or ctx.env.value("SGLANG_INT4_WEIGHT")),
    "neither SGLANG_USE_AITER nor SGLANG_INT4_WEIGHT is on a ROCm GPU")
JIT_DEEPGEMM = Condition(
    "DeepGEMM's JIT kernels are on (deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM: CUDA SM90 or newer, "
    "SGLANG_ENABLE_JIT_DEEPGEMM on, deep_gemm importable)",
    lambda ctx: ctx.platform.vendor is Vendor.CUDA and ctx.platform.has_capability(9, 0)
    and bool(ctx.env.value("SGLANG_ENABLE_JIT_DEEPGEMM")) and ctx.platform.has(Library.DEEP_GEMM),
    "DeepGEMM's JIT kernels are off (needs CUDA SM90+, SGLANG_ENABLE_JIT_DEEPGEMM on and deep_gemm importable)")


def architecture(*names: str, text: str | None = None) -> Condition:
    """The model's architecture is one of ``names`` (``text`` names a long list)."""
    shown = text or (names[0] if len(names) == 1 else f"one of {list(names)}")
    return Condition(f"architecture is {shown}", lambda ctx: model(ctx).architecture in names,
                     lambda ctx: f"architecture is {model(ctx).architecture!r}")


def not_architecture_prefix(prefix: str) -> Condition:
    return Condition(f"architecture does not start with {prefix!r}",
                     lambda ctx: not (model(ctx).architecture or "").startswith(prefix),
                     lambda ctx: f"architecture is {model(ctx).architecture!r}")


DRAFT = Condition("the layer belongs to the speculative draft model", lambda ctx: model(ctx).draft,
                  "the layer belongs to the target model")
LORA = Condition("the layer has LoRA adapters", lambda ctx: ctx.layer.lora, "no LoRA")

# What a quantization method's construction reads of the layer's scheme.
FP8_BLOCK_128 = Condition("128x128 block FP8 weights", lambda ctx: ctx.layer.quant.weight == FP8_STATIC_BLOCK128,
                          "the weights are not 128x128 block FP8")
FP8_DYNAMIC_ACT = Condition("dynamic FP8 activation scales",
                            lambda ctx: ctx.layer.quant.activation is not None
                            and not ctx.layer.quant.activation.static,
                            "static FP8 activation scales")
FP8_CHANNEL_WEIGHTS = Condition("per-channel FP8 weight scales (weight strategy CHANNEL)",
                                lambda ctx: ctx.layer.quant.weight == FP8_STATIC_CHANNEL,
                                "the FP8 weight scales are not per channel")
MXFP8_LAYER = Condition("MXFP8 experts (use_mxfp8)", lambda ctx: ctx.layer.family is QuantFamily.MXFP8,
                        "not MXFP8 experts")


def _wna16_triton_ok(ctx) -> bool:
    """compressed-tensors' _is_wna16_triton_moe_supported: 4-bit symmetric INT groups of 32 or 128, no actorder."""
    q = ctx.layer.quant
    return (q.weight_bits == 4 and q.group_size in (32, 128) and not q.zero_point and not q.act_order)


WNA16_TRITON_OK = Condition(
    "4-bit symmetric INT weights in groups of 32 or 128 without activation order "
    "(_is_wna16_triton_moe_supported)", _wna16_triton_ok,
    "not 4-bit symmetric INT weights in groups of 32 or 128 without activation order")
KIMI_INT4 = Condition(
    "compressed-tensors INT4 weights in groups of 32 (the Kimi K2 / K2.5 thinking recipe)",
    lambda ctx: ctx.layer.family is QuantFamily.INT_WNA16 and ctx.layer.quant.checkpoint == "compressed-tensors"
    and ctx.layer.quant.weight_bits == 4 and ctx.layer.quant.group_size == 32,
    "not compressed-tensors INT4 weights in groups of 32")
SWIGLU_OAI = Condition(
    "SwiGLU-OAI experts (gemm1_alpha or gemm1_clamp_limit set)",
    lambda ctx: ctx.layer.activation is Activation.SWIGLUOAI or ctx.layer.swiglu_limit is not None,
    "not SwiGLU-OAI experts")
OAI_ON_GFX95 = Condition("SwiGLU-OAI experts on a ROCm gfx95x GPU",
                         lambda ctx: GFX95.holds(ctx) and SWIGLU_OAI.holds(ctx),
                         "not SwiGLU-OAI experts on a ROCm gfx95x GPU")
TORCH_CAPABILITY_9 = Condition(
    "torch.cuda.get_device_capability() has major 9 (CUDA 9.x, or a ROCm gfx9 GPU, which torch reports as 9.x)",
    lambda ctx: ctx.platform.is_capability_family(9)
    or (ctx.platform.vendor is Vendor.ROCM and (ctx.platform.gcn_arch or "").startswith("gfx9")),
    "torch's device capability major is not 9 (or torch has no CUDA device here)")
