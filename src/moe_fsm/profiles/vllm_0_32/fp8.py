"""vLLM 0.32.0: ``select_fp8_moe_backend``, as its differences from 0.33.0's.

* the AITER backend's class is the single ``AiterExperts`` (0.33: block / tensor / channel classes);
* no per-model DeepGEMM auto-disable (0.33's ``should_auto_disable_deep_gemm``; moe-fsm models neither).
"""

from __future__ import annotations

from moe_fsm.profiles.derive import derived_policy
from moe_fsm.profiles.vllm_0_33.fp8 import POLICY as V033

POLICY = derived_policy(V033, kernels_of={"AITER": ("AiterExperts",)})
