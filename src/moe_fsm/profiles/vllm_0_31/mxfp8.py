"""vLLM 0.31.0: ``select_mxfp8_moe_backend`` (``oracle/mxfp8.py``), as its differences from 0.32.0's.

* the auto scan walks ``_SUPPORTED_BACKENDS`` as written (no ``prioritize_humming``): on SM90 MARLIN before
  HUMMING.
"""

from __future__ import annotations

from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.derive import derived_policy
from moe_fsm.profiles.vllm_0_31.humming import without_humming_first
from moe_fsm.profiles.vllm_0_32 import PROFILE as V032

_BASE = V032.policies[QuantFamily.MXFP8]
POLICY = derived_policy(_BASE, reorders=without_humming_first(_BASE.reorders))
