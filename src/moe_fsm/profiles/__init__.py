"""Policy profiles: which vLLM's rules a decision follows.

Every subpackage here that defines ``PROFILE`` is a profile, found by name
(``seeds``, ``vllm-0.33``, ...); adding a vLLM version is adding a subpackage
(see docs/profiles.md). :func:`resolve_default` picks the profile of the vLLM
installed beside moe-fsm (read from its distribution metadata, never imported),
the nearest older one when there is no exact profile, else ``seeds``, and says
why; the choice and its reason are recorded in every trace.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from typing import Mapping

from moe_fsm.errors import InputError
from moe_fsm.inputs.env import read_known_from
from moe_fsm.profiles.profile import Profile

SEEDS = "seeds"
_registered: dict[str, Profile] = {}


@dataclass(frozen=True)
class ProfileChoice:
    """The profile a decision follows, and why that one (recorded in the trace; replay reuses it)."""

    name: str
    reason: str

    def to_json(self) -> dict:
        return {"name": self.name, "reason": self.reason}

    @classmethod
    def from_json(cls, data) -> "ProfileChoice":
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise InputError(f"inputs.profile must be a table with a name and a reason, got {data!r}")
        get(data["name"])
        return cls(data["name"], str(data.get("reason", "")))


@lru_cache(maxsize=1)
def _shipped() -> dict[str, Profile]:
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            profile = getattr(importlib.import_module(f"{__name__}.{info.name}"), "PROFILE", None)
            if isinstance(profile, Profile):
                found[profile.name] = profile
    return found


def profiles() -> dict[str, Profile]:
    """Every known profile by name: the shipped ones and any registered at run time."""
    return {**_shipped(), **_registered}


def names() -> list[str]:
    return sorted(profiles())


def get(name: str) -> Profile:
    if not isinstance(name, str):
        raise InputError(f"a policy profile is named by a string, got {name!r}; known: {names()}")
    try:
        return profiles()[name]
    except KeyError:
        raise InputError(f"unknown policy profile {name!r}; known: {names()}") from None


def register(profile: Profile) -> Profile:
    """Make a profile built elsewhere (a test's, a plugin's) known by name."""
    existing = profiles().get(profile.name)
    if existing is not None and existing is not profile:
        raise InputError(f"a different policy profile is already named {profile.name!r}")
    _registered[profile.name] = profile
    known_env_vars.cache_clear()
    return profile


def unregister(name: str) -> None:
    _registered.pop(name, None)
    known_env_vars.cache_clear()


@lru_cache(maxsize=1)
def known_env_vars() -> Mapping:
    """Every variable some profile reads (for snapshots: which names to keep, which flags to accept)."""
    union = {}
    for profile in sorted(profiles().values(), key=_age):
        union.update(profile.env.variables)
    return union


read_known_from(known_env_vars)


def _age(profile: Profile) -> tuple:
    return (0,) if profile.vllm_version is None else (1, *profile.vllm_version)


def version_tuple(text: str) -> tuple[int, ...]:
    """'0.33.0rc1' -> (0, 33, 0): the leading numeric release parts."""
    parts = []
    for piece in text.split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() != len(piece):
            break
    return tuple(parts)


def installed_vllm() -> str | None:
    """The version of the vLLM distribution installed beside moe-fsm (metadata only, no import)."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def choose_for_vllm(version: str | None) -> ProfileChoice:
    """The profile for a vLLM version: exact, else the nearest older release profile, else seeds."""
    if version is None:
        return ProfileChoice(SEEDS, "no vLLM distribution is installed beside moe-fsm: the seed snapshot moe-fsm is specified from")
    wanted = version_tuple(version)
    releases = sorted((p for p in profiles().values() if p.vllm_version is not None), key=_age)
    for profile in releases:
        if wanted[:len(profile.vllm_version)] == profile.vllm_version:
            return ProfileChoice(profile.name, f"vLLM {version} is installed beside moe-fsm")
    older = [p for p in releases if p.vllm_version < wanted]
    if older:
        nearest = older[-1]
        return ProfileChoice(
            nearest.name,
            f"vLLM {version} is installed beside moe-fsm and moe-fsm has no profile for it; "
            f"note: {nearest.name} is the nearest older profile, decisions may differ from vLLM {version}",
        )
    return ProfileChoice(
        SEEDS,
        f"vLLM {version} is installed beside moe-fsm, older than every release profile "
        f"({', '.join(p.name for p in releases) or 'none'}); note: the seed snapshot is used",
    )


@lru_cache(maxsize=1)
def resolve_default() -> ProfileChoice:
    """The profile a decision follows when none is asked for, with the reason."""
    return choose_for_vllm(installed_vllm())


def choose(policy: str | ProfileChoice | None) -> ProfileChoice:
    """An explicit ``policy=`` / ``--policy`` (a profile name), or the default."""
    if policy is None:
        return resolve_default()
    if isinstance(policy, ProfileChoice):
        get(policy.name)
        return policy
    if policy == "default":
        return resolve_default()
    get(policy)
    return ProfileChoice(policy, "asked for explicitly (policy=)")
