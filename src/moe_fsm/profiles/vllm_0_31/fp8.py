"""vLLM 0.31.0: ``select_fp8_moe_backend`` (``oracle/fp8.py``), as its differences from 0.32.0's.

* ``_get_priority_backends`` returns its list without ``prioritize_humming``: on SM90 MARLIN stays ahead of
  HUMMING.
"""

from __future__ import annotations

from moe_fsm.profiles.derive import derived_policy
from moe_fsm.profiles.vllm_0_31.humming import without_humming_first
from moe_fsm.profiles.vllm_0_32.fp8 import POLICY as V032

POLICY = derived_policy(V032, reorders=without_humming_first(V032.reorders))
