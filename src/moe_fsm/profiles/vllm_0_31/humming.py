"""vLLM 0.31.0 has no ``prioritize_humming`` (``quantization/utils/humming/priority.py`` is new in 0.32.0).

0.32's FP8, MXFP8, WNA16, MXFP4 and NVFP4 oracles pass their priority lists through it (Humming just ahead of
Marlin on SM90); in 0.31 each list is scanned in its written order, so those policies drop that reorder.
"""

from __future__ import annotations

from moe_fsm.profiles.vllm_0_33.fp8 import HUMMING_FIRST


def without_humming_first(reorders: tuple) -> tuple:
    return tuple(r for r in reorders if r is not HUMMING_FIRST)
