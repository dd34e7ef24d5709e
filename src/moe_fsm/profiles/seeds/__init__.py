"""The ``seeds`` profile: vLLM's oracles as the project started from them (shared/seeds/000..002).

This is moe-fsm's specified behaviour and the default where no vLLM is installed.
"""

from __future__ import annotations

from types import MappingProxyType

from moe_fsm.profiles.profile import Profile, family_policies
from moe_fsm.profiles.seeds.env import ENV
from moe_fsm.profiles.seeds.kernels import FALLBACK_KERNELS, KERNELS

PROFILE = Profile(
    name="seeds",
    about="the seed snapshot of vLLM's oracles (shared/seeds/000..002) and the kernel survey (shared/reference)",
    vllm_version=None,
    policies=family_policies(__name__),
    kernels=MappingProxyType(KERNELS),
    env=ENV,
    fallback_kernels=MappingProxyType(FALLBACK_KERNELS),
)
