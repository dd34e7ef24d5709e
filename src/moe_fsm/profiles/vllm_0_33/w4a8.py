"""vLLM 0.33.0: ``select_w4a8_moe_backend`` (``fused_moe/oracle/w4a8.py``): INT4 weights, dynamic per-token FP8 activations.

CUTLASS (Hopper only) then Humming; a named backend narrows that list, and
when nothing in it runs the oracle raises NotImplementedError listing every
kernel's reason, named backend or not.
"""

from __future__ import annotations

from moe_fsm.backends.specs import backends
from moe_fsm.fsm.candidate_steps import ExplicitAlternatives
from moe_fsm.fsm.policy import FamilyPolicy, frozen
from moe_fsm.fsm.steps import AutoScan
from moe_fsm.inputs.quant import QuantFamily

FAMILY = QuantFamily.W4A8

POLICY = FamilyPolicy(
    family=FAMILY,
    label="W4A8",
    steps=(
        ExplicitAlternatives("explicit_user_choice", alternatives=frozen({"cutlass": ("CUTLASS",), "humming": ("HUMMING",)}),
                             on_failure="exhausted"),
        AutoScan("auto_scan"),
    ),
    backends=frozen(backends(
        FAMILY,
        ("CUTLASS", ["CutlassExpertsW4A8Fp8"]),
        ("HUMMING", ["BatchedHummingGroupedExperts", "HummingGroupedExperts", "HummingIndexedExperts"]),
    )),
    user_names=frozen({"cutlass": "CUTLASS", "humming": "HUMMING"}),
    batched_variants=frozen({}),
    priority=frozen({None: ("CUTLASS", "HUMMING")}),
    unsupported_message="W4A8 MoE backend {backend} does not support the deployment configuration since {reason}.",
    exhausted_message="No W4A8 MoE backend supports the deployment configuration.",
)
