"""What one vLLM oracle is, as data: a ``FamilyPolicy``.

A policy is one oracle's share of the common procedure: its ordered steps
(generic step kinds from ``steps.py``, parameterised by data), its backends and
their kernel classes, the user-facing names, the priority lists, the messages
and the error types. Policies live in the profiles (``moe_fsm.profiles.<name>.
<family>``); the machine (``machine.py``) is built from a policy's steps and
never branches on the family or the profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping

from moe_fsm.errors import NoBackendError, SelectionError
from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.quant import QuantFamily

if TYPE_CHECKING:
    from moe_fsm.backends.pf_choice import PrepareFinalizeChoice
    from moe_fsm.backends.requirements import Requirement
    from moe_fsm.backends.specs import BackendSpec
    from moe_fsm.fsm.steps import Step

# The states every machine has, around the policy's own steps.
START = "start"
SELECTED = "selected"
FALLBACK_NONE = "fallback_none"
FAILED = "failed"
TERMINAL_STATES = (SELECTED, FALLBACK_NONE, FAILED)


@dataclass(frozen=True)
class Reorder:
    """A priority-list adjustment under a condition (vLLM's ``_move_to_back`` / ``_move_to_front``,
    ``prioritize_humming``, the MXFP4 oracle's SM12x rule).

    When every requirement in ``when`` holds, ``backends`` move (in the order given)
    to the ``to`` end of the scan order, or next to another backend (``before:`` /
    ``after:`` it).
    """

    when: tuple["Requirement", ...]
    backends: tuple[str, ...]
    to: str  # "front" | "back" | "before:BACKEND" | "after:BACKEND"
    because: str

    def apply(self, candidates: list[str]) -> list[str]:
        """The scan order after this rule (its condition already holds): ``before:B`` just ahead of B
        (vLLM's prioritize_humming), ``after:B`` just behind B (the MXFP4 oracle's SM12x rule)."""
        moving = [b for b in self.backends if b in candidates]
        rest = [b for b in candidates if b not in moving]
        if self.to == "front":
            return moving + rest
        where, _, anchor = self.to.partition(":")
        if where in ("before", "after"):
            if anchor not in rest:
                return candidates  # nothing to go next to: vLLM leaves the list as it is
            at = rest.index(anchor) + (where == "after")
            return rest[:at] + moving + rest[at:]
        return rest + moving


@dataclass(frozen=True, eq=False)
class FamilyPolicy:
    """One family's oracle in one profile (compared by identity: its machine is cached by it).

    ``pairing``: how a selection is paired with a prepare/finalize, given the decision in progress, where the
    engine's token movement is not vLLM's (SGLang's dispatchers); None pairs it from the parallel config.
    """

    family: QuantFamily
    label: str  # as vLLM's messages spell the family
    steps: tuple["Step", ...]
    backends: Mapping[str, "BackendSpec"]
    user_names: Mapping[str, str]
    batched_variants: Mapping[str, str]
    priority: Mapping[Vendor | None, tuple[str, ...]]  # None: every vendor not listed
    unsupported_message: str  # format(backend=..., reason=...)
    exhausted_message: str
    exhausted_error: type[SelectionError] = NoBackendError
    reorders: tuple[Reorder, ...] = ()
    clamp_backends: frozenset[str] | None = None
    clamp_refusal: str | None = None  # format(limit=, request=, use=); None: the seeds' wording
    batched_requests: frozenset[str] = frozenset()  # user names that put the experts in the batched format
    gated_by_allow_vllm_cutlass: tuple[str, ...] = ()
    explicit_unavailable: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    none_on_vendors: frozenset[Vendor] = frozenset()
    pairing: Callable[..., "PrepareFinalizeChoice"] | None = None  # None: from the parallel config (pf_choice)

    def priority_for(self, vendor: Vendor) -> tuple[str, ...]:
        return self.priority.get(vendor, self.priority.get(None, ()))

    def user_name_of(self, backend: str) -> str:
        for user, name in self.user_names.items():
            if name == backend:
                return user
        return backend.lower()

    def step(self, name: str) -> "Step":
        return next(s for s in self.steps if s.name == name)


def frozen(mapping: dict) -> Mapping:
    return MappingProxyType(dict(mapping))
