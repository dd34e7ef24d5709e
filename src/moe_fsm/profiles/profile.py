"""A policy profile: everything that decides, for one vLLM version, as data."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from moe_fsm.backends.specs import KernelSpec
from moe_fsm.fsm.policy import FamilyPolicy
from moe_fsm.inputs.env import EnvRegistry
from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.quant import QuantFamily


@dataclass(frozen=True, eq=False)
class Profile:
    """The family policies, kernel catalog, env registry and messages of one vLLM version.

    ``vllm_version``: the release it is read from ((0, 33) for 0.33.x); None for
    ``seeds``, the snapshot the project is specified from, which counts as older
    than every release profile. The last two fields are about moe-fsm's runtime,
    never about the decision: ``fallback_kernels``, what moe-fsm runs where the
    oracle leaves a layer to the platform (FP8's NONE); ``substitutes``, for a
    kernel class moe-fsm does not implement, the kernel spec that computes the
    same numerics (e.g. vLLM's NVFP4 emulation experts -> moe-fsm's torch emulation).
    ``reads_model_facts``: the profile's rules read the layer's ``ModelFacts`` (architecture, declared quant
    method; SGLang's model overrides do, vLLM's oracles do not). ``plan`` and ``run`` give every layer the facts
    of its checkpoint or preset, and a profile that does not read them decides (and records) the layer without.
    ``config_rules``: the engine rules ``plan`` reads a checkpoint's quantization_config by (``vllm``, or an
    engine release's own, e.g. ``sglang-0.5.23``: its method registry, overrides, refusals and MoE methods).
    ``reads_speed_table``: the profile orders candidates by a measured speed table (``inputs/speed.py``); the
    inputs of any other profile never carry one, so its traces are unchanged.
    """

    name: str
    about: str
    vllm_version: tuple[int, ...] | None
    policies: Mapping[QuantFamily, FamilyPolicy]
    kernels: Mapping[str, KernelSpec]
    env: EnvRegistry
    fallback_kernels: Mapping[Vendor, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    substitutes: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    reads_model_facts: bool = False  # the decisions read MoELayer.model (SGLang's overrides); else it is left out
    # Whose rules ``plan`` reads a checkpoint's quantization_config by (plan/config_rules.py names them).
    config_rules: str = "vllm"
    # What explain says when asking for a backend by name ends in another one: which earlier step decides first.
    redirect_hint: str = "an earlier step decides first, e.g. the FP8 LoRA shortcut"
    reads_speed_table: bool = False  # the decisions read a measured speed table (the fastest-* profiles); else none is kept

    def policy(self, family: QuantFamily) -> FamilyPolicy:
        from moe_fsm.errors import InputError

        try:
            return self.policies[family]
        except KeyError:
            raise InputError(
                f"profile {self.name!r} has no policy for {family.value} layers; it covers "
                f"{sorted(f.value for f in self.policies)}"
            ) from None


def family_policies(package: str) -> Mapping[QuantFamily, FamilyPolicy]:
    """Every ``POLICY`` of a profile package's modules (one module per family), by family.

    Adding a family to a profile is adding a module; nothing else lists them.
    """
    found: dict[QuantFamily, FamilyPolicy] = {}
    for info in sorted(pkgutil.iter_modules(importlib.import_module(package).__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package}.{info.name}")
        policy = getattr(module, "POLICY", None)
        if isinstance(policy, FamilyPolicy):
            if policy.family in found:
                raise ValueError(f"{package}: two modules define the {policy.family.value} policy")
            found[policy.family] = policy
    return MappingProxyType(found)
