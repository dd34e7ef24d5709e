"""The environment variables the oracles read, parsed by one typed registry.

vLLM distinguishes a variable that is unset from one set to its default
(``envs.is_set``): every "explicit env" branch is gated on presence. An
``EnvSnapshot`` therefore keeps the raw strings of the variables that were
present and parses on demand, so both questions can be asked. Parsing is
strict: a value vLLM would silently coerce (``VLLM_USE_FLASHINFER_MOE_FP8=maybe``)
is an error naming the variable and what it accepts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

from moe_fsm.errors import EnvVarError, InputError


@dataclass(frozen=True)
class EnvVar:
    """One variable: its default (as vLLM's parser would read it), parser and meaning."""

    name: str
    default: object
    parse: Callable[[str], object]
    accepted: str
    doc: str


def _int_flag(name: str) -> Callable[[str], bool]:
    def parse(raw: str) -> bool:
        value = raw.strip()
        if value in ("0", "1"):
            return value == "1"
        raise EnvVarError(name, raw, "0 or 1")

    return parse


def _bool_word(name: str) -> Callable[[str], bool]:
    def parse(raw: str) -> bool:
        value = raw.strip().lower()
        if value in ("1", "true"):
            return True
        if value in ("0", "false"):
            return False
        raise EnvVarError(name, raw, "1, true, 0 or false (case-insensitive)")

    return parse


def _choice(name: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value in choices:
            return value
        raise EnvVarError(name, raw, ", ".join(choices))

    return parse


FLASHINFER_MOE_BACKEND_CHOICES = ("throughput", "latency", "masked_gemm")


def _registry(*variables: EnvVar) -> Mapping[str, EnvVar]:
    return MappingProxyType({v.name: v for v in variables})


ENV_VARS: Mapping[str, EnvVar] = _registry(
    EnvVar("VLLM_USE_FLASHINFER_MOE_FP16", False, _int_flag("VLLM_USE_FLASHINFER_MOE_FP16"), "0 or 1",
           "Prefer FlashInfer kernels for unquantized MoE."),
    EnvVar("VLLM_USE_FLASHINFER_MOE_FP8", False, _int_flag("VLLM_USE_FLASHINFER_MOE_FP8"), "0 or 1",
           "Set: force (1) or exclude (0) FlashInfer kernels for FP8 MoE."),
    EnvVar("VLLM_USE_FLASHINFER_MOE_FP4", False, _int_flag("VLLM_USE_FLASHINFER_MOE_FP4"), "0 or 1",
           "Set: force (1) or exclude (0) FlashInfer kernels for NVFP4 MoE."),
    EnvVar("VLLM_FLASHINFER_MOE_BACKEND", "latency",
           _choice("VLLM_FLASHINFER_MOE_BACKEND", FLASHINFER_MOE_BACKEND_CHOICES),
           ", ".join(FLASHINFER_MOE_BACKEND_CHOICES),
           "Which FlashInfer MoE family: throughput=CUTLASS, latency=TRTLLM (SM100 only), masked_gemm=CuteDSL."),
    EnvVar("VLLM_USE_DEEP_GEMM", True, _int_flag("VLLM_USE_DEEP_GEMM"), "0 or 1",
           "DeepGEMM globally; set to 1 (with VLLM_MOE_USE_DEEP_GEMM not 0) it forces DeepGEMM for FP8 MoE."),
    EnvVar("VLLM_MOE_USE_DEEP_GEMM", True, _int_flag("VLLM_MOE_USE_DEEP_GEMM"), "0 or 1",
           "DeepGEMM for MoE only; 0 excludes it."),
    EnvVar("VLLM_TEST_FORCE_FP8_MARLIN", False, _bool_word("VLLM_TEST_FORCE_FP8_MARLIN"),
           "1, true, 0 or false (case-insensitive)", "Force the Marlin weight-only MoE kernel."),
    EnvVar("VLLM_ROCM_USE_AITER", False, _bool_word("VLLM_ROCM_USE_AITER"),
           "1, true, 0 or false (case-insensitive)", "AITER master switch on ROCm."),
    EnvVar("VLLM_ROCM_USE_AITER_MOE", True, _bool_word("VLLM_ROCM_USE_AITER_MOE"),
           "1, true, 0 or false (case-insensitive)", "AITER MoE switch on ROCm (needs VLLM_ROCM_USE_AITER too)."),
)


@dataclass(frozen=True)
class EnvSnapshot:
    """The registered variables that were present, as raw strings; validated on creation."""

    raw: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name, value in self.raw:
            ENV_VARS[name].parse(value)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, str], *, strict_names: bool = False) -> "EnvSnapshot":
        """Keep the registered variables of ``mapping``; other names are ignored.

        With ``strict_names`` (explicit ``--env`` flags), an unknown VLLM_ name is an
        error, because a typo there would otherwise silently change nothing.
        """
        if strict_names:
            unknown = sorted(k for k in mapping if k not in ENV_VARS)
            if unknown:
                raise InputError(f"unknown environment variable(s) {unknown}; moe-fsm reads: {sorted(ENV_VARS)}")
        return cls(tuple(sorted((k, str(v)) for k, v in mapping.items() if k in ENV_VARS)))

    @classmethod
    def from_process(cls) -> "EnvSnapshot":
        return cls.from_mapping(os.environ)

    def is_set(self, name: str) -> bool:
        _check_known(name)
        return any(k == name for k, _ in self.raw)

    def value(self, name: str) -> object:
        var = _check_known(name)
        for key, raw in self.raw:
            if key == name:
                return var.parse(raw)
        return var.default

    def to_json(self) -> dict:
        return dict(self.raw)

    @classmethod
    def from_json(cls, data: Mapping[str, str]) -> "EnvSnapshot":
        return cls.from_mapping(data, strict_names=True)


def _check_known(name: str) -> EnvVar:
    try:
        return ENV_VARS[name]
    except KeyError:
        raise InputError(f"environment variable {name!r} is not in moe-fsm's registry: {sorted(ENV_VARS)}") from None
