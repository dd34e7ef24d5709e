"""The ``vllm-0.31`` profile: vLLM 0.31.0's MoE oracles, written as their differences from ``vllm-0.32``.

Read from the 0.31.0 wheel (``vllm/model_executor/layers/fused_moe/oracle/*.py`` and the experts classes'
support checks), diffed against 0.32.0: each module here names what 0.31 does differently, and every family
and kernel class not named is 0.32's (the unquantized, INT8, W4A8 and W4A8-INT8 oracles are unchanged between
the two releases). ``tools/vllm_parity.py --vllm-version 0.31.0`` compares it with vLLM's own functions.
"""

from __future__ import annotations

from moe_fsm.profiles.derive import derived_profile
from moe_fsm.profiles.vllm_0_31 import fp8, int_wna16, mxfp4, mxfp8, nvfp4
from moe_fsm.profiles.vllm_0_31.kernels import DROPPED, KERNELS
from moe_fsm.profiles.vllm_0_32 import PROFILE as V032

PROFILE = derived_profile(
    V032,
    name="vllm-0.31",
    about="vLLM 0.31.0's oracles (vllm/model_executor/layers/fused_moe/oracle/), as differences from vllm-0.32",
    vllm_version=(0, 31),
    policies=(fp8.POLICY, int_wna16.POLICY, mxfp4.POLICY, mxfp8.POLICY, nvfp4.POLICY),
    kernels=KERNELS,
    drop_kernels=DROPPED,
)
