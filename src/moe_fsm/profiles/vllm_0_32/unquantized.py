"""vLLM 0.32.0: ``select_unquantized_moe_backend``, as its differences from 0.33.0's.

* ``--moe-backend marlin`` is a ValueError for an unquantized layer (0.33 lets 'marlin', like 'humming',
  fall through to auto for unquantized layers of quantized models);
* the AITER backend's class is the single ``AiterExperts``.
"""

from __future__ import annotations

from dataclasses import replace

from moe_fsm.profiles.derive import derived_policy
from moe_fsm.profiles.vllm_0_33.unquantized import POLICY as V033

POLICY = derived_policy(
    V033,
    kernels_of={"AITER": ("AiterExperts",)},
    replace_steps={"explicit_user_choice": replace(V033.step("explicit_user_choice"), passthrough=("humming",))},
)
