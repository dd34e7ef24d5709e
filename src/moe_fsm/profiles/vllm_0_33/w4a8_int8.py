"""vLLM 0.33.0: ``select_w4a8_int8_moe_backend`` (``fused_moe/oracle/w4a8_int8.py``): INT4 weights, INT8 activations, CPU.

The oracle has backends on CPU platforms only and says so before it looks
at any request; its one kernel (``cpu_int4_moe.CPUExpertsInt4``, KleidiAI)
runs on Arm CPUs only, so an x86 CPU gets NotImplementedError.
"""

from __future__ import annotations

from moe_fsm.backends.requirements import OnVendor
from moe_fsm.backends.specs import backends
from moe_fsm.fsm.candidate_steps import PlatformGate
from moe_fsm.fsm.policy import FamilyPolicy, frozen
from moe_fsm.fsm.steps import AutoScan, ExplicitChoice
from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.quant import QuantFamily

FAMILY = QuantFamily.W4A8_INT8

POLICY = FamilyPolicy(
    family=FAMILY,
    label="W4A8 Int8",
    steps=(
        PlatformGate("platform_gate", needs=(OnVendor((Vendor.CPU,)),),
                     message="W4A8 Int8 MoE is only supported on CPU platforms"),
        ExplicitChoice("explicit_user_choice"),
        AutoScan("auto_scan"),
    ),
    backends=frozen(backends(FAMILY, ("CPU_INT4", ["cpu_int4_moe.CPUExpertsInt4"]))),
    user_names=frozen({"cpu": "CPU_INT4"}),
    batched_variants=frozen({}),
    priority=frozen({Vendor.CPU: ("CPU_INT4",), None: ()}),
    unsupported_message="W4A8 Int8 MoE backend {backend} does not support the deployment configuration since {reason}.",
    exhausted_message="No W4A8 Int8 MoE backend supports the deployment configuration.",
)
