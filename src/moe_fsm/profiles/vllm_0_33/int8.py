"""vLLM 0.33.0: ``select_int8_moe_backend`` (``fused_moe/oracle/int8.py``), INT8 W8A8.

Triton, then Humming, then the CPU kernels (zentorch, POWER, Arm, x86 AMX),
on every platform and without the Humming-before-Marlin rule.
"""

from __future__ import annotations

from moe_fsm.backends.specs import backends
from moe_fsm.fsm.policy import FamilyPolicy, frozen
from moe_fsm.fsm.steps import AutoScan, ExplicitChoice
from moe_fsm.inputs.quant import QuantFamily

FAMILY = QuantFamily.INT8

POLICY = FamilyPolicy(
    family=FAMILY,
    label="Int8",
    steps=(ExplicitChoice("explicit_user_choice"), AutoScan("auto_scan")),
    backends=frozen(backends(
        FAMILY,
        ("TRITON", ["TritonExperts"]),
        ("HUMMING", ["BatchedHummingGroupedExperts", "HummingGroupedExperts", "HummingIndexedExperts"]),
        ("CPU", ["ZenCPUExpertsInt8", "PowerCPUExpertsInt8", "ArmCPUExpertsInt8", "CPUExpertsInt8"]),
    )),
    user_names=frozen({"triton": "TRITON", "humming": "HUMMING"}),
    batched_variants=frozen({}),
    priority=frozen({None: ("TRITON", "HUMMING", "CPU")}),
    unsupported_message="Int8 MoE backend {backend} does not support the deployment configuration since {reason}.",
    exhausted_message="No Int8 MoE backend supports the deployment configuration.",
)
