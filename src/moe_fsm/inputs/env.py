"""Environment variables as the oracles read them: typed definitions, snapshots, readers.

vLLM distinguishes a variable that is unset from one set to its default
(``envs.is_set``): every "explicit env" branch is gated on presence. An
``EnvSnapshot`` therefore keeps the raw strings of the variables that were
present and parses on demand, so both questions can be asked. Parsing is
strict: a value vLLM would silently coerce (``VLLM_USE_FLASHINFER_MOE_FP8=maybe``)
is an error naming the variable and what it accepts.

Which variables exist, and how each is parsed, is data of a policy profile
(``moe_fsm.profiles.<name>.env``: an ``EnvRegistry``); vLLM releases read
different sets. This module only gives the building blocks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

from moe_fsm.inputs.hashing import hashed_once
from moe_fsm.errors import EnvVarError, InputError


@dataclass(frozen=True)
class EnvVar:
    """One variable: its default (as vLLM's parser would read it), parser and meaning."""

    name: str
    default: object
    parse: Callable[[str], object]
    accepted: str
    doc: str


def int_flag(name: str) -> Callable[[str], bool]:
    def parse(raw: str) -> bool:
        value = raw.strip()
        if value in ("0", "1"):
            return value == "1"
        raise EnvVarError(name, raw, "0 or 1")

    return parse


def bool_word(name: str) -> Callable[[str], bool]:
    def parse(raw: str) -> bool:
        value = raw.strip().lower()
        if value in ("1", "true"):
            return True
        if value in ("0", "false"):
            return False
        raise EnvVarError(name, raw, "1, true, 0 or false (case-insensitive)")

    return parse


def choice(name: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value in choices:
            return value
        raise EnvVarError(name, raw, ", ".join(choices))

    return parse


@dataclass(frozen=True, eq=False)
class EnvRegistry:
    """The variables one policy profile reads, by name (a profile's data; compared by identity)."""

    variables: Mapping[str, EnvVar]

    @classmethod
    def of(cls, *variables: EnvVar) -> "EnvRegistry":
        return cls(MappingProxyType({v.name: v for v in variables}))

    def __contains__(self, name: str) -> bool:
        return name in self.variables

    def __iter__(self):
        return iter(self.variables)

    def __getitem__(self, name: str) -> EnvVar:
        return self.variables[name]

    def get(self, name: str) -> EnvVar | None:
        return self.variables.get(name)

    _readers: dict = field(default_factory=dict, repr=False)

    def forget_readers(self) -> None:
        """Drop the readers made so far (and the values and guard results they remember)."""
        self._readers.clear()

    def reader(self, snapshot: "EnvSnapshot") -> "EnvReader":
        """The snapshot as this registry reads it; a value its parser refuses is an EnvVarError now.

        One reader per distinct snapshot (an engine decides every layer with the same one).
        """
        reader = self._readers.get(snapshot)
        if reader is None:
            for name, raw in snapshot.raw:
                var = self.variables.get(name)
                if var is not None:
                    var.parse(raw)
            if len(self._readers) >= 256:
                self._readers.clear()
            reader = self._readers[snapshot] = EnvReader(snapshot, self)
        return reader


def _no_profiles() -> Mapping[str, EnvVar]:
    raise RuntimeError("no policy profiles are loaded: import moe_fsm (its profiles say which variables exist)")


_known_source: Callable[[], Mapping[str, EnvVar]] = _no_profiles


def read_known_from(source: Callable[[], Mapping[str, EnvVar]]) -> None:
    """Where :func:`known_env_vars` comes from: ``moe_fsm.profiles`` hands in its union when it loads.

    The profiles sit above the inputs (they are made of env registries), so the
    inputs are given the union instead of importing it.
    """
    global _known_source
    _known_source = source


def known_env_vars() -> Mapping[str, EnvVar]:
    """Every variable some registered policy profile reads (a later profile's definition wins)."""
    return _known_source()


def __getattr__(name: str):
    if name == "ENV_VARS":  # the union, computed from the profiles (which import this module)
        return known_env_vars()
    raise AttributeError(name)


@hashed_once
@dataclass(frozen=True)
class EnvSnapshot:
    """The present variables that some profile reads, as raw strings.

    A snapshot is profile-independent: which of its variables a decision reads,
    and how it parses them, is the profile's ``EnvRegistry`` (see ``reader``).
    """

    raw: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, str], *, strict_names: bool = False) -> "EnvSnapshot":
        """Keep the variables of ``mapping`` that some profile reads; other names are ignored.

        With ``strict_names`` (explicit ``--env`` flags), an unknown name is an
        error, because a typo there would otherwise silently change nothing.
        """
        known = known_env_vars()
        if strict_names:
            unknown = sorted(k for k in mapping if k not in known)
            if unknown:
                raise InputError(f"unknown environment variable(s) {unknown}; moe-fsm reads: {sorted(known)}")
        return cls(tuple(sorted((k, str(v)) for k, v in mapping.items() if k in known)))

    @classmethod
    def from_process(cls) -> "EnvSnapshot":
        return cls.from_mapping(os.environ)

    def raw_value(self, name: str) -> str | None:
        for key, raw in self.raw:
            if key == name:
                return raw
        return None

    def to_json(self) -> dict:
        return dict(self.raw)

    @classmethod
    def from_json(cls, data: Mapping[str, str]) -> "EnvSnapshot":
        return cls.from_mapping(data, strict_names=True)


_UNREAD = object()


@hashed_once
@dataclass(frozen=True)
class EnvReader:
    """A snapshot read through one profile's registry: presence (vLLM's ``envs.is_set``) and parsed value."""

    snapshot: EnvSnapshot
    registry: EnvRegistry

    def is_set(self, name: str) -> bool:
        self._known(name)
        return self.snapshot.raw_value(name) is not None

    def value(self, name: str) -> object:
        """The parsed value (the default when unset); parsed once per reader, since guards and requirements re-read it."""
        value = self._values.get(name, _UNREAD)
        if value is _UNREAD:
            var = self._known(name)
            raw = self.snapshot.raw_value(name)
            value = self._values[name] = var.default if raw is None else var.parse(raw)
        return value

    _values: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    _readings: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    guards: dict = field(default_factory=dict, compare=False, hash=False, repr=False)  # env-only guards' results

    def reading(self, name: str) -> dict:
        """What a decision saw of one variable: present or not, raw text, parsed value (built once; read-only)."""
        reading = self._readings.get(name)
        if reading is None:
            raw = self.snapshot.raw_value(name)
            reading = self._readings[name] = {"name": name, "set": raw is not None, "raw": raw, "value": self.value(name)}
        return reading

    def _known(self, name: str) -> EnvVar:
        var = self.registry.get(name)
        if var is None:
            raise InputError(f"environment variable {name!r} is not read by this profile: {sorted(self.registry)}")
        return var


