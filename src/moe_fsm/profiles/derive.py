"""A profile written as its differences from another (vLLM 0.32 from 0.33, 0.31 from 0.32).

Releases share most of their oracles: a derived profile lists only what its
release does differently, as data, and everything else is the base profile's
own objects. ``derived_policy`` rewrites one family's policy (kernel classes of
some backends, backends dropped, steps replaced or inserted, any other field);
``derived_profile`` assembles a profile from a base, the rewritten policies and
the kernel catalog's differences. Nothing here decides: the machine runs a
derived profile exactly like a written-out one.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Iterable, Mapping

from moe_fsm.backends.specs import KernelSpec
from moe_fsm.fsm.policy import FamilyPolicy
from moe_fsm.inputs.env import EnvRegistry
from moe_fsm.profiles.profile import Profile


def derived_policy(base: FamilyPolicy, *, kernels_of: Mapping[str, tuple[str, ...]] = MappingProxyType({}),
                   drop_backends: Iterable[str] = (), replace_steps: Mapping[str, object] = MappingProxyType({}),
                   insert_before: Mapping[str, tuple] = MappingProxyType({}), **fields) -> FamilyPolicy:
    """``base`` with: ``kernels_of`` (backend -> its kernel classes in this release), ``drop_backends`` (backends
    this release does not have: removed from the backends, user names, batched variants and priority lists),
    ``replace_steps`` (step name -> the step this release has instead), ``insert_before`` (step name -> steps
    this release runs before it), and any other ``FamilyPolicy`` field given outright."""
    dropped = set(drop_backends)
    unknown = (set(kernels_of) | dropped) - set(base.backends)
    if unknown:
        raise ValueError(f"{base.label}: no backend(s) {sorted(unknown)} to rewrite")
    missing = (set(replace_steps) | set(insert_before)) - {s.name for s in base.steps}
    if missing:
        raise ValueError(f"{base.label}: no step(s) {sorted(missing)} to replace or insert before")
    backends = {name: replace(spec, kernels=tuple(kernels_of[name])) if name in kernels_of else spec
                for name, spec in base.backends.items() if name not in dropped}
    steps = []
    for step in base.steps:
        steps.extend(insert_before.get(step.name, ()))
        steps.append(replace_steps.get(step.name, step))
    out = {
        "steps": tuple(steps),
        "backends": MappingProxyType(backends),
        "user_names": MappingProxyType({u: b for u, b in base.user_names.items() if b not in dropped}),
        "batched_variants": MappingProxyType({k: v for k, v in base.batched_variants.items()
                                              if k not in dropped and v not in dropped}),
        "priority": MappingProxyType({vendor: tuple(b for b in order if b not in dropped)
                                      for vendor, order in base.priority.items()}),
    }
    out.update(fields)
    return replace(base, **out)


def derived_profile(base: Profile, *, name: str, about: str, vllm_version: tuple[int, ...],
                    policies: Iterable[FamilyPolicy] = (), kernels: Iterable[KernelSpec] = (),
                    drop_kernels: Iterable[str] = (), env: EnvRegistry | None = None,
                    substitutes: Mapping[str, str] | None = None) -> Profile:
    """``base`` with this release's policies (by family), kernel specs (added or replacing the base's by class
    name), kernel classes it does not have, and its env registry when that differs."""
    catalog = {k: v for k, v in base.kernels.items() if k not in set(drop_kernels)}
    catalog.update({spec.name: spec for spec in kernels})
    families = {**base.policies, **{p.family: p for p in policies}}
    for policy in families.values():
        for spec in policy.backends.values():
            absent = [k for k in spec.kernels if k not in catalog]
            if absent:
                raise ValueError(f"profile {name}: backend {spec.name} names kernel(s) {absent} the catalog lacks")
    subs = dict(base.substitutes if substitutes is None else substitutes)
    subs = {k: v for k, v in subs.items() if k in catalog}
    return Profile(
        name=name, about=about, vllm_version=vllm_version, policies=MappingProxyType(families),
        kernels=MappingProxyType(catalog), env=base.env if env is None else env,
        fallback_kernels=base.fallback_kernels, substitutes=MappingProxyType(subs),
    )
