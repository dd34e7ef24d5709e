"""vLLM 0.31.0: ``select_wna16_moe_backend`` (``oracle/int_wna16.py``), as its differences from 0.32.0's.

* ``_get_priority_backends`` returns its list without ``prioritize_humming``: on SM90 MARLIN / BATCHED_MARLIN /
  TRITON stay ahead of HUMMING.
"""

from __future__ import annotations

from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.derive import derived_policy
from moe_fsm.profiles.vllm_0_31.humming import without_humming_first
from moe_fsm.profiles.vllm_0_32 import PROFILE as V032

_BASE = V032.policies[QuantFamily.INT_WNA16]
POLICY = derived_policy(_BASE, reorders=without_humming_first(_BASE.reorders))
