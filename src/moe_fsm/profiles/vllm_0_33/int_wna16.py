"""vLLM 0.33.0: ``select_wna16_moe_backend`` (``fused_moe/oracle/int_wna16.py``): INT4/INT8 weights, 16-bit activations.

Before a backend's kernels are asked, the oracle checks the checkpoint
(``_backend_incompatibility_reason``): its format (GPTQ, AWQ,
compressed-tensors, MoeWNA16), zero points, whether biases may be present
(GPTQ and AWQ say they may), activation ordering, the group size, and
Marlin's shape rule. Those checks are each backend's extra requirements here,
in vLLM's order and words; an explicit backend that fails one is a ValueError,
the auto scan skips it. CPUs scan zentorch then the AMX kernel, XPUs their
own kernel, everything else RDNA3, FlashInfer MXINT4, Marlin, Triton,
Humming, emulation (Humming before Marlin on CUDA 9.0).
"""

from __future__ import annotations

from moe_fsm.backends.requirements import Condition
from moe_fsm.backends.specs import backends
from moe_fsm.fsm.policy import FamilyPolicy, frozen
from moe_fsm.fsm.steps import AutoScan, ExplicitChoice
from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.vllm_0_33.fp8 import HUMMING_FIRST
from moe_fsm.profiles.vllm_0_33.kernels import intermediate_per_partition

FAMILY = QuantFamily.INT_WNA16
GPTQ, AWQ, CT, MOE_WNA16 = "gptq", "awq", "compressed-tensors", "moe_wna16"


def _checkpoint(ctx) -> str:
    return ctx.layer.quant.checkpoint


def _may_have_bias(ctx) -> bool:
    """GPTQ and AWQ pass may_have_bias=True; compressed-tensors and MoeWNA16 pass False."""
    return _checkpoint(ctx) in (GPTQ, AWQ)


def _group(ctx) -> int:
    return ctx.layer.quant.group_size


def _marlin_shape(ctx) -> bool:
    """check_moe_marlin_supports_config with allow_tile_padding (True except for MoeWNA16, which never gets here)."""
    if ctx.platform.vendor is Vendor.ROCM:
        return False
    group = _group(ctx)
    intermediate = intermediate_per_partition(ctx)
    shape = ctx.layer.hidden_size % 128 == 0 and (group <= 0 or intermediate % group == 0)
    return shape and group in (-1, 32, 64, 128)


def _not(text: str, predicate, reason: str) -> Condition:
    return Condition(text, lambda ctx: not predicate(ctx), reason)


NO_MOE_WNA16 = _not("not a MoeWNA16 checkpoint", lambda ctx: _checkpoint(ctx) == MOE_WNA16,
                    "the MoeWNA16 checkpoint layout is not supported")
MARLIN_LAYER = (
    Condition("Marlin's shape and group-size rule (hidden % 128, group in -1/32/64/128, not ROCm)", _marlin_shape,
              "Marlin not supported for this layer"),
    NO_MOE_WNA16,
)
NO_GROUP_ACT_ORDER = _not("no compressed-tensors group activation ordering",
                          lambda ctx: _checkpoint(ctx) == CT and ctx.layer.quant.act_order,
                          "group activation ordering is not supported")
NO_GPTQ_ACT_ORDER = _not("no GPTQ desc_act", lambda ctx: _checkpoint(ctx) == GPTQ and ctx.layer.quant.act_order,
                         "GPTQ activation ordering is not supported")

INCOMPATIBLE = {
    "FLASHINFER_TRTLLM": (
        _not("no zero points and no expert bias", lambda ctx: ctx.layer.quant.zero_point or _may_have_bias(ctx),
             "zero points and bias are not supported"),
    ),
    "RDNA3": (
        Condition("a compressed-tensors checkpoint", lambda ctx: _checkpoint(ctx) == CT,
                  "only compressed-tensors checkpoints are supported"),
        _not("symmetric weights", lambda ctx: ctx.layer.quant.zero_point, "asymmetric checkpoints are not supported"),
        _not("no expert bias", _may_have_bias, "expert bias is not supported"),
        NO_GROUP_ACT_ORDER,
        Condition("group-wise scales", lambda ctx: _group(ctx) > 0, "only group-wise scales are supported"),
    ),
    "ZEN_CPU": (
        Condition("VLLM_CPU_INT4_W4A8 on", lambda ctx: ctx.env.value("VLLM_CPU_INT4_W4A8"),
                  "VLLM_CPU_INT4_W4A8=0 disables the DA8W4 path"),
        _not("no zero points", lambda ctx: ctx.layer.quant.zero_point, "zero points are not supported"),
        _not("not a MoeWNA16 checkpoint", lambda ctx: _checkpoint(ctx) == MOE_WNA16,
             "the MoeWNA16 weight layout is not supported"),
        NO_GPTQ_ACT_ORDER,
        NO_GROUP_ACT_ORDER,
        Condition("group-quantized weights", lambda ctx: _group(ctx) > 0, "DA8W4 requires group-quantized weights"),
        Condition("group size a multiple of 4", lambda ctx: _group(ctx) % 4 == 0,
                  lambda ctx: f"group size {_group(ctx)} is not a multiple of 4"),
    ),
    "TRITON": (
        _not("no expert bias", _may_have_bias, "expert bias is not supported"),
        _not("not an AutoAWQ checkpoint", lambda ctx: _checkpoint(ctx) == AWQ,
             "the AutoAWQ weight layout is not supported"),
        NO_GPTQ_ACT_ORDER,
        NO_GROUP_ACT_ORDER,
    ),
    "MARLIN": MARLIN_LAYER,
    "BATCHED_MARLIN": MARLIN_LAYER,
    "EMULATION": (NO_MOE_WNA16,),
}

POLICY = FamilyPolicy(
    family=FAMILY,
    label="WNA16",
    steps=(ExplicitChoice("explicit_user_choice"), AutoScan("auto_scan")),
    backends=frozen(backends(
        FAMILY,
        *((name, kernels, INCOMPATIBLE.get(name, ())) for name, kernels in (
            ("RDNA3", ["Rdna3WNA16Experts"]),
            ("FLASHINFER_TRTLLM", ["TrtLlmMxint4ExpertsMonolithic"]),
            ("MARLIN", ["MarlinExperts"]),
            ("BATCHED_MARLIN", ["BatchedMarlinExperts"]),
            ("TRITON", ["TritonWNA16Experts"]),
            ("HUMMING", ["BatchedHummingGroupedExperts", "HummingGroupedExperts", "HummingIndexedExperts"]),
            ("EMULATION", ["Int4EmulationTritonExperts"]),
            ("XPU", ["XPUExpertsWNA16"]),
            ("CPU", ["cpu_moe.CPUExpertsInt4"]),
            ("ZEN_CPU", ["ZentorchExpertsInt4"]),
        )),
    )),
    user_names=frozen({
        "triton": "TRITON",
        "marlin": "MARLIN",
        "humming": "HUMMING",
        "flashinfer_trtllm": "FLASHINFER_TRTLLM",
        "emulation": "EMULATION",
        "rdna3": "RDNA3",
    }),
    batched_variants=frozen({}),
    priority=frozen({
        Vendor.CPU: ("ZEN_CPU", "CPU"),
        Vendor.XPU: ("XPU",),
        None: ("RDNA3", "FLASHINFER_TRTLLM", "MARLIN", "BATCHED_MARLIN", "TRITON", "HUMMING", "EMULATION"),
    }),
    reorders=(HUMMING_FIRST,),
    unsupported_message="WNA16 MoE backend '{backend}' does not support the deployment configuration since {reason}.",
    exhausted_message="No WNA16 MoE backend supports the deployment configuration.",
)
