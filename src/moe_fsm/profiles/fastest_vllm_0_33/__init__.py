"""The ``fastest-vllm-0.33`` profile: vLLM 0.33's rules, with the auto scan ordered by measured speed.

Every family policy of ``vllm-0.33`` gets one more state, ``measured_scan`` (``fsm/measured_steps.py``), just
before its ``auto_scan``. What vLLM decides before the scan (LoRA, TPU/OOT shortcuts, an explicit
``--backend``, env overrides) is unchanged, and so is every backend's support check; where the decision's
speed table has figures for this device and layer shape, the candidates the scan would accept (and moe-fsm's
TORCH_GROUPED_MM, which vLLM never scans) are ordered by them, never picking one slower than vLLM's own choice
at a measured token count. Without a table, on another device or for an unmeasured shape, the guard fails and
the base's auto scan decides as vLLM 0.33 does. ``moe-fsm measure`` writes the table.
"""

from __future__ import annotations

from dataclasses import replace

from moe_fsm.fsm.measured_steps import MeasuredScan
from moe_fsm.profiles.derive import derived_policy, derived_profile
from moe_fsm.profiles.vllm_0_33 import PROFILE as V033

# Backends moe-fsm can run that vLLM's scans do not list: measured and compared all the same.
MEASURED_EXTRAS = ("TORCH_GROUPED_MM",)

PROFILE = replace(
    derived_profile(
        V033,
        name="fastest-vllm-0.33",
        about="vLLM 0.33.0's oracles, with the auto scan's candidates ordered by a measured speed table "
              "(moe-fsm measure) for this device and layer shape",
        vllm_version=None,
        policies=[
            derived_policy(policy, insert_before={
                "auto_scan": (MeasuredScan("measured_scan", measured_extras=MEASURED_EXTRAS),),
            })
            for policy in V033.policies.values()
        ],
    ),
    reads_speed_table=True,
)
