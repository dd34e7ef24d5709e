"""The ``vllm-0.33`` profile: vLLM 0.33.0's MoE oracles, read from its source.

Facts from ``vllm/model_executor/layers/fused_moe/oracle/{unquantized,fp8,nvfp4}.py``
and the experts classes' ``is_supported_config`` / ``_supports_*`` methods; the
notes are in docs/vllm-0.33-oracles.md, and tools/vllm_parity.py compares this
profile with vLLM's own functions.
"""

from __future__ import annotations

from types import MappingProxyType

from moe_fsm.profiles.profile import Profile, family_policies
from moe_fsm.profiles.vllm_0_33.env import ENV
from moe_fsm.profiles.vllm_0_33.kernels import FALLBACK_KERNELS, KERNELS, SUBSTITUTES
from moe_fsm.profiles.vllm_0_33.kernels_mx_int import KERNELS as MX_INT_KERNELS
from moe_fsm.profiles.vllm_0_33.kernels_mx_int import SUBSTITUTES as MX_INT_SUBSTITUTES

PROFILE = Profile(
    name="vllm-0.33",
    about="vLLM 0.33.0's oracles (vllm/model_executor/layers/fused_moe/oracle/) and experts support checks",
    vllm_version=(0, 33),
    policies=family_policies(__name__),
    kernels=MappingProxyType({**KERNELS, **MX_INT_KERNELS}),
    env=ENV,
    fallback_kernels=MappingProxyType(FALLBACK_KERNELS),
    substitutes=MappingProxyType({**SUBSTITUTES, **MX_INT_SUBSTITUTES}),
)
