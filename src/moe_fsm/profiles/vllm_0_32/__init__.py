"""The ``vllm-0.32`` profile: vLLM 0.32.0's MoE oracles, written as their differences from ``vllm-0.33``.

Read from the 0.32.0 wheel (``vllm/model_executor/layers/fused_moe/oracle/*.py`` and the experts classes'
support checks), diffed against 0.33.0: each module here names what 0.32 does differently, and every family
and kernel class not named is 0.33's (the MXFP8, INT8, WNA16, W4A8 and NVFP4 oracles are unchanged between
the two releases). ``tools/vllm_parity.py --vllm-version 0.32.0`` compares it with vLLM's own functions.
"""

from __future__ import annotations

from moe_fsm.profiles.derive import derived_profile
from moe_fsm.profiles.vllm_0_32 import fp8, mxfp4, unquantized
from moe_fsm.profiles.vllm_0_32.kernels import DROPPED, KERNELS
from moe_fsm.profiles.vllm_0_33 import PROFILE as V033

PROFILE = derived_profile(
    V033,
    name="vllm-0.32",
    about="vLLM 0.32.0's oracles (vllm/model_executor/layers/fused_moe/oracle/), as differences from vllm-0.33",
    vllm_version=(0, 32),
    policies=(unquantized.POLICY, fp8.POLICY, mxfp4.POLICY),
    kernels=KERNELS,
    drop_kernels=DROPPED,
)
