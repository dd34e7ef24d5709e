"""What differs between the quantization families, as data.

vLLM's three oracles are one procedure with different lists, names, env vars
and messages. Each ``FamilyPolicy`` below is one oracle's share of that
procedure: the machine in ``machine.py`` reads it and never branches on the
family itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.quant import QuantFamily

# The FSM's states, in the order a decision may visit them.
START = "start"
LORA_SHORTCUT = "lora_shortcut"
EXPLICIT_USER_CHOICE = "explicit_user_choice"
FLASHINFER_PREFERENCE = "flashinfer_preference"
ENV_OVERRIDE = "env_override"
FORCED_MARLIN = "forced_marlin"
AUTO_SCAN = "auto_scan"
SELECTED = "selected"
FALLBACK_NONE = "fallback_none"
FAILED = "failed"

STEP_STATES = (LORA_SHORTCUT, EXPLICIT_USER_CHOICE, FLASHINFER_PREFERENCE, ENV_OVERRIDE, FORCED_MARLIN, AUTO_SCAN)
TERMINAL_STATES = (SELECTED, FALLBACK_NONE, FAILED)


@dataclass(frozen=True)
class FlashInferPreference:
    """How a family reacts to its VLLM_USE_FLASHINFER_MOE_* variable.

    ``gate_on_presence``: vLLM's FP8/NVFP4 oracles act when the variable is *set*
    (0 prunes FlashInfer, 1 forces it); the unquantized oracle acts only when it
    reads true and otherwise carries on. ``pinned`` maps the FlashInfer family
    named by VLLM_FLASHINFER_MOE_BACKEND to a backend (a missing key is an error
    with ``unpinnable``); ``requires_latency`` lists backends tried only when that
    variable reads ``latency``.
    """

    env_var: str
    gate_on_presence: bool
    candidates: tuple[str, ...]
    pinned: Mapping[str, str] | None
    unpinnable: str = ""
    requires_latency: tuple[str, ...] = ()
    raise_when_exhausted: bool = True


@dataclass(frozen=True)
class EnvRule:
    """An env override: if any of ``names`` is set, all reading true forces the backend,
    any reading false prunes ``prunes`` from the auto scan."""

    names: tuple[str, ...]
    standard: str
    batched: str
    prunes: tuple[str, ...]


@dataclass(frozen=True)
class Step:
    state: str
    env_rule: EnvRule | None = None


@dataclass(frozen=True)
class FamilyPolicy:
    family: QuantFamily
    label: str  # as vLLM's messages spell the family
    steps: tuple[Step, ...]
    user_names: Mapping[str, str]
    batched_variants: Mapping[str, str]
    priority: Mapping[Vendor | None, tuple[str, ...]]  # None: every vendor not listed
    unsupported_message: str  # format(backend=..., reason=...)
    exhausted_message: str
    lora_backend: str | None = None
    clamp_backends: frozenset[str] | None = None
    gated_by_allow_vllm_cutlass: tuple[str, ...] = ()
    flashinfer: FlashInferPreference | None = None
    marlin_backend: str | None = None
    explicit_unavailable: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    none_on_vendors: frozenset[Vendor] = frozenset()

    def priority_for(self, vendor: Vendor) -> tuple[str, ...]:
        return self.priority.get(vendor, self.priority.get(None, ()))

    def user_name_of(self, backend: str) -> str:
        for user, name in self.user_names.items():
            if name == backend:
                return user
        return backend.lower()


def _frozen(mapping: dict) -> Mapping:
    return MappingProxyType(dict(mapping))


FI_CUTLASS, FI_TRTLLM, FI_CUTEDSL = "CUTLASS", "TENSORRT_LLM", "CUTEDSL"

UNQUANTIZED_POLICY = FamilyPolicy(
    family=QuantFamily.UNQUANTIZED,
    label="Unquantized",
    steps=(Step(EXPLICIT_USER_CHOICE), Step(FLASHINFER_PREFERENCE), Step(AUTO_SCAN)),
    user_names=_frozen({
        "triton": "TRITON",
        "flashinfer_trtllm": "FLASHINFER_TRTLLM",
        "flashinfer_cutlass": "FLASHINFER_CUTLASS",
        "aiter": "AITER",
    }),
    batched_variants=_frozen({"TRITON": "BATCHED_TRITON"}),
    priority=_frozen({
        Vendor.CUDA: ("TRITON", "BATCHED_TRITON"),
        Vendor.ROCM: ("AITER", "TRITON", "BATCHED_TRITON"),
        Vendor.XPU: ("XPU",),
        Vendor.CPU: ("CPU",),
        Vendor.TPU: ("TPU",),
        Vendor.OUT_OF_TREE: ("OOT",),
    }),
    unsupported_message="Unquantized MoE backend {backend} does not support the deployment configuration since {reason}.",
    exhausted_message="No Unquantized MoE backend supports the deployment configuration.",
    flashinfer=FlashInferPreference(
        env_var="VLLM_USE_FLASHINFER_MOE_FP16",
        gate_on_presence=False,
        candidates=("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS"),
        pinned=None,
        requires_latency=("FLASHINFER_TRTLLM",),
        raise_when_exhausted=False,
    ),
    explicit_unavailable=_frozen({
        "FLASHINFER_TRTLLM": "FlashInfer TRTLLM MoE backend is not available for this configuration",
        "FLASHINFER_CUTLASS": "FlashInfer CUTLASS MoE backend is not available for this configuration",
        "AITER": "ROCm AITer MoE backend is not available for this configuration",
    }),
)

FP8_POLICY = FamilyPolicy(
    family=QuantFamily.FP8,
    label="FP8",
    steps=(
        Step(LORA_SHORTCUT),
        Step(EXPLICIT_USER_CHOICE),
        Step(FLASHINFER_PREFERENCE),
        Step(ENV_OVERRIDE, EnvRule(("VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM"), "DEEPGEMM", "BATCHED_DEEPGEMM",
                                   ("DEEPGEMM", "BATCHED_DEEPGEMM"))),
        Step(FORCED_MARLIN),
        Step(ENV_OVERRIDE, EnvRule(("VLLM_ROCM_USE_AITER", "VLLM_ROCM_USE_AITER_MOE"), "AITER", "AITER", ("AITER",))),
        Step(AUTO_SCAN),
    ),
    user_names=_frozen({
        "triton": "TRITON",
        "deep_gemm": "DEEPGEMM",
        "cutlass": "VLLM_CUTLASS",
        "flashinfer_trtllm": "FLASHINFER_TRTLLM",
        "flashinfer_cutlass": "FLASHINFER_CUTLASS",
        "marlin": "MARLIN",
        "aiter": "AITER",
    }),
    batched_variants=_frozen({"DEEPGEMM": "BATCHED_DEEPGEMM", "TRITON": "BATCHED_TRITON", "VLLM_CUTLASS": "BATCHED_VLLM_CUTLASS"}),
    priority=_frozen({None: (
        "AITER", "FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "DEEPGEMM", "BATCHED_DEEPGEMM", "VLLM_CUTLASS",
        "BATCHED_VLLM_CUTLASS", "TRITON", "BATCHED_TRITON", "MARLIN", "XPU",
    )}),
    unsupported_message="FP8 MoE backend {backend} does not support the deployment configuration since {reason}.",
    exhausted_message="No FP8 MoE backend supports the deployment configuration.",
    lora_backend="TRITON",
    gated_by_allow_vllm_cutlass=("VLLM_CUTLASS", "BATCHED_VLLM_CUTLASS"),
    flashinfer=FlashInferPreference(
        env_var="VLLM_USE_FLASHINFER_MOE_FP8",
        gate_on_presence=True,
        candidates=("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS"),
        pinned=_frozen({FI_CUTLASS: "FLASHINFER_CUTLASS", FI_TRTLLM: "FLASHINFER_TRTLLM"}),
        unpinnable="FlashInfer MaskedGEMM not supported for FP8",
    ),
    marlin_backend="MARLIN",
    none_on_vendors=frozenset({Vendor.XPU, Vendor.CPU, Vendor.TPU, Vendor.OUT_OF_TREE}),
)

NVFP4_POLICY = FamilyPolicy(
    family=QuantFamily.NVFP4,
    label="NvFp4",
    steps=(Step(EXPLICIT_USER_CHOICE), Step(FLASHINFER_PREFERENCE), Step(FORCED_MARLIN), Step(AUTO_SCAN)),
    user_names=_frozen({
        "cutlass": "VLLM_CUTLASS",
        "flashinfer_trtllm": "FLASHINFER_TRTLLM",
        "flashinfer_cutlass": "FLASHINFER_CUTLASS",
        "flashinfer_cutedsl": "FLASHINFER_CUTEDSL",
        "flashinfer_b12x": "FLASHINFER_B12X",
        "marlin": "MARLIN",
        "emulation": "EMULATION",
    }),
    batched_variants=_frozen({"FLASHINFER_CUTEDSL": "FLASHINFER_CUTEDSL_BATCHED"}),
    priority=_frozen({None: (
        "FLASHINFER_TRTLLM", "FLASHINFER_CUTEDSL", "FLASHINFER_CUTEDSL_BATCHED", "FLASHINFER_CUTLASS",
        "VLLM_CUTLASS", "MARLIN", "EMULATION",
    )}),
    unsupported_message="NvFp4 MoE backend '{backend}' does not support the deployment configuration since {reason}.",
    exhausted_message="No NvFp4 MoE backend supports the deployment configuration.",
    clamp_backends=frozenset({"FLASHINFER_TRTLLM"}),
    flashinfer=FlashInferPreference(
        env_var="VLLM_USE_FLASHINFER_MOE_FP4",
        gate_on_presence=True,
        candidates=("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "FLASHINFER_CUTEDSL", "FLASHINFER_CUTEDSL_BATCHED",
                    "FLASHINFER_B12X"),
        pinned=_frozen({FI_CUTLASS: "FLASHINFER_CUTLASS", FI_TRTLLM: "FLASHINFER_TRTLLM", FI_CUTEDSL: "FLASHINFER_CUTEDSL"}),
    ),
    marlin_backend="MARLIN",
)

POLICIES: Mapping[QuantFamily, FamilyPolicy] = MappingProxyType({
    p.family: p for p in (UNQUANTIZED_POLICY, FP8_POLICY, NVFP4_POLICY)
})
PROFILE = "seeds"  # the oracle snapshot of the seed documents, which these policies encode


def missing_policy_message(family: QuantFamily) -> str | None:
    """Why a family cannot be decided (no policy in this profile), or None when it can."""
    if family in POLICIES:
        return None
    return (
        f"no selection policy for family {family.value} in profile {PROFILE}; "
        f"it has policies for {sorted(f.value for f in POLICIES)}"
    )
