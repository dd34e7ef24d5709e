"""vLLM 0.31.0: ``select_mxfp4_moe_backend`` (``oracle/mxfp4.py``), as its differences from 0.32.0's.

* no ``CUTLASS_MXFP4_MXFP4`` backend (vLLM's CUTLASS MXFP4 x MXFP4) and no FlashInfer MoE-EP backends
  (``FLASHINFER_MOE_EP_CUTEDSL`` / ``_DEEP_GEMM``, nor the names ``flashinfer_moe_ep_cutedsl`` /
  ``flashinfer_moe_ep_mega_deep_gemm``);
* ``_get_priority_backends_for_gpt_oss`` has no HUMMING (``humming`` is still a name a user may ask for), no
  consumer-Blackwell rule (TRITON keeps its place on SM12x) and no ``prioritize_humming``;
* ``_filter_by_activation``: a checkpoint that declares an activation key (MXFP8, FP8, MXFP4) keeps only the
  backends of that key (and EMULATION), with no BF16 variants after them, so where none of those runs the
  oracle raises instead of falling back to BF16 activations. (The auto scan then checks every remaining backend
  with the requested key, which is each one's own key.)
"""

from __future__ import annotations

from dataclasses import replace

from moe_fsm.fsm.activation_order import ActivationOrder
from moe_fsm.fsm.policy import frozen
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.derive import derived_policy
from moe_fsm.profiles.vllm_0_32 import PROFILE as V032

_BASE = V032.policies[QuantFamily.MXFP4]
NEW_IN_032 = ("CUTLASS_MXFP4_MXFP4", "FLASHINFER_MOE_EP_CUTEDSL")
NAMES_NEW_IN_032 = ("flashinfer_moe_ep_cutedsl", "flashinfer_moe_ep_mega_deep_gemm")
ONLY_MATCHING = ActivationOrder(sixteen_bit_fallback=False)

_explicit = _BASE.step("explicit_user_choice")
_auto = _BASE.step("auto_scan")
ALTERNATIVES = frozen({name: tuple(b for b in backends if b not in NEW_IN_032)
                       for name, backends in _explicit.alternatives.items() if name not in NAMES_NEW_IN_032})

POLICY = derived_policy(
    _BASE,
    drop_backends=NEW_IN_032,
    replace_steps={
        "explicit_user_choice": replace(
            _explicit, alternatives=ALTERNATIVES, activation_order=ONLY_MATCHING,
            refusals=frozen({k: v for k, v in _explicit.refusals.items() if k not in NAMES_NEW_IN_032})),
        "auto_scan": replace(_auto, activation_order=ONLY_MATCHING),
    },
    reorders=(),
)
POLICY = replace(POLICY, priority=frozen({vendor: tuple(b for b in order if b != "HUMMING")
                                          for vendor, order in POLICY.priority.items()}))
