"""Policy profiles: which vLLM's rules a decision follows.

Every subpackage here that defines ``PROFILE`` is a profile, found by name
(``seeds``, ``vllm-0.33``, ...); adding a vLLM version is adding a subpackage
(see docs/profiles.md). :func:`resolve_default` picks the profile of the vLLM
installed beside moe-fsm (read from its distribution metadata, never imported),
the nearest older one when there is no exact profile, else ``seeds``, and says
why; the choice and its reason are recorded in every trace. A name the user
gives (``policy=``, ``--policy``) must name a profile: an unknown one is refused
with the list, never replaced by a neighbour; ``nearest:vllm-X.Y`` asks for the
nearest-profile resolution explicitly.
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


NEAREST = "nearest:"


def get(name: str) -> Profile:
    if not isinstance(name, str):
        raise InputError(f"a policy profile is named by a string, got {name!r}; known: {names()}")
    try:
        return profiles()[name]
    except KeyError:
        hint = ""
        if re.fullmatch(r"(vllm-)?\d+(\.\d+)*\w*", name):
            hint = f" (or 'nearest:{name}' for the nearest older profile, which may decide differently from that vLLM)"
        raise InputError(f"unknown policy profile {name!r}; known: {names()}{hint}") from None


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


def choose_for_vllm(version: str | None, why: str | None = None) -> ProfileChoice:
    """The profile for a vLLM version: exact, else the nearest older release profile, else seeds.

    ``why`` says where the version comes from (default: the vLLM installed beside moe-fsm).
    """
    if version is None:
        return ProfileChoice(SEEDS, "no vLLM distribution is installed beside moe-fsm: the seed snapshot moe-fsm is specified from")
    why = why or f"vLLM {version} is installed beside moe-fsm"
    wanted = version_tuple(version)
    releases = sorted((p for p in profiles().values() if p.vllm_version is not None), key=_age)
    for profile in releases:
        if wanted[:len(profile.vllm_version)] == profile.vllm_version:
            return ProfileChoice(profile.name, why)
    older = [p for p in releases if p.vllm_version < wanted]
    if older:
        nearest = older[-1]
        return ProfileChoice(
            nearest.name,
            f"{why} and moe-fsm has no profile for it; "
            f"note: {nearest.name} is the nearest older profile, decisions may differ from vLLM {version}",
        )
    return ProfileChoice(
        SEEDS,
        f"{why}, older than every release profile "
        f"({', '.join(p.name for p in releases) or 'none'}); note: the seed snapshot is used",
    )


def choose_nearest(text: str) -> ProfileChoice:
    """``nearest:vllm-0.34`` (or ``nearest:0.34``): the profile of that vLLM version, else the nearest older one."""
    wanted = text[len(NEAREST):].strip()
    version = wanted[len("vllm-"):] if wanted.startswith("vllm-") else wanted
    if not version_tuple(version):
        raise InputError(f"{text!r}: 'nearest:' takes a vLLM version, e.g. 'nearest:vllm-0.34' or 'nearest:0.34'; "
                         f"profiles: {names()}")
    return choose_for_vllm(version, f"the profile nearest to vLLM {version} was asked for ({text})")


@lru_cache(maxsize=1)
def resolve_default() -> ProfileChoice:
    """The profile a decision follows when none is asked for, with the reason."""
    return choose_for_vllm(installed_vllm())


def choose(policy: str | ProfileChoice | None) -> ProfileChoice:
    """An explicit ``policy=`` / ``--policy``, or the default.

    A profile name must be one (an unknown name is an InputError listing them, never the nearest profile);
    ``"default"`` is the installed vLLM's profile (nearest older with a note, else seeds); ``"nearest:vllm-X.Y"``
    asks for that same resolution for a version the caller names.
    """
    if policy is None:
        return resolve_default()
    if isinstance(policy, ProfileChoice):
        get(policy.name)
        return policy
    if policy == "default":
        return resolve_default()
    if isinstance(policy, str) and policy.startswith(NEAREST):
        return choose_nearest(policy)
    get(policy)
    return ProfileChoice(policy, "asked for explicitly (policy=)")
