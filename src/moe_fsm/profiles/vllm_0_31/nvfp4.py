"""vLLM 0.31.0: ``select_nvfp4_moe_backend`` (``oracle/nvfp4.py``), as its differences from 0.32.0's.

* no ``FLASHINFER_MOE_EP_CUTEDSL`` backend (nor the name ``flashinfer_moe_ep_cutedsl``; the FlashInfer MoE-EP
  megakernel, ``experts/flashinfer_moe_ep.py``, is new in 0.32);
* ``AVAILABLE_BACKENDS`` without ``prioritize_humming``: on SM90 MARLIN before HUMMING.

(``CutlassExpertsFp4``'s refusal of expert parallelism is a kernel condition: ``kernels.py``.)
"""

from __future__ import annotations

from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.derive import derived_policy
from moe_fsm.profiles.vllm_0_31.humming import without_humming_first
from moe_fsm.profiles.vllm_0_32 import PROFILE as V032

_BASE = V032.policies[QuantFamily.NVFP4]
POLICY = derived_policy(
    _BASE,
    drop_backends=("FLASHINFER_MOE_EP_CUTEDSL",),
    reorders=without_humming_first(_BASE.reorders),
    clamp_backends=_BASE.clamp_backends - {"FLASHINFER_MOE_EP_CUTEDSL"},
)
