"""A support verdict: yes or no, with the human reason and every check behind it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from moe_fsm.inputs.hashing import hashed_once
from moe_fsm.inputs.env import EnvReader
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import PlatformFacts
from moe_fsm.inputs.formats import ActivationFormat


@hashed_once
@dataclass(frozen=True)
class SupportContext:
    """Everything a support predicate may read; nothing else is consulted."""

    layer: MoELayer
    parallel: ParallelConfig
    platform: PlatformFacts
    env: EnvReader  # the env snapshot as the decision's profile reads it
    activation_format: ActivationFormat


class Check(NamedTuple):
    """One requirement as evaluated: the requirement, and why it failed (None when it passed)."""

    requirement: object  # a backends.requirements.Requirement
    failure: str | None

    @property
    def passed(self) -> bool:
        return self.failure is None

    def to_json(self) -> dict:
        return {"requirement": self.requirement.description, "passed": self.passed, "reason": self.failure}


class Verdict:
    """A kernel's answer for one context; ``reason`` is the first failing check's text. Immutable.

    A plain slotted class rather than a frozen dataclass: a cold decision builds dozens of these.
    """

    __slots__ = ("subject", "checks", "failures")

    def __init__(self, subject: str, checks: tuple[Check, ...]) -> None:
        self.subject = subject
        self.checks = checks
        self.failures = tuple([c.failure for c in checks if c.failure is not None])

    @property
    def supported(self) -> bool:
        return not self.failures

    @property
    def reason(self) -> str | None:
        return self.failures[0] if self.failures else None

    def to_json(self) -> dict:
        return {
            "kernel": self.subject,
            "supported": self.supported,
            "reason": self.reason,
            "checks": [c.to_json() for c in self.checks],
        }


class BackendVerdict:
    """A backend's answer: the first kernel class that accepts, else the last reason (as vLLM). Immutable."""

    __slots__ = ("backend", "kernel_verdicts", "kernel", "reason", "_summary", "_event")

    def __init__(self, backend: str, kernel_verdicts: tuple[Verdict, ...]) -> None:
        self.backend = backend
        self.kernel_verdicts = kernel_verdicts
        self.kernel = next((v.subject for v in kernel_verdicts if not v.failures), None)
        if self.kernel is not None:
            self.reason = None
        elif kernel_verdicts:
            self.reason = kernel_verdicts[-1].reason
        else:
            self.reason = "no kernel class is registered for it"
        self._summary = self._event = None

    @property
    def supported(self) -> bool:
        return self.kernel is not None

    def summary(self) -> dict:
        """The trace's view: each kernel's failing checks (passing ones are implied).

        Computed once per verdict (verdicts are immutable and memoized); treat it as read-only.
        """
        if self._summary is None:
            self._summary = self._summarize()
        return self._summary

    def candidate_event(self) -> dict:
        """The trace's ``candidate`` event for this verdict, built once; read-only."""
        if self._event is None:
            self._event = {**self.summary(), "event": "candidate"}
        return self._event

    def _summarize(self) -> dict:
        return {
            "backend": self.backend,
            "supported": self.supported,
            "kernel": self.kernel,
            "reason": self.reason,
            "kernels": [{"kernel": v.subject, "supported": v.supported, "failed": list(v.failures)} for v in self.kernel_verdicts],
        }

    def to_json(self) -> dict:
        return {
            "backend": self.backend,
            "supported": self.supported,
            "kernel": self.kernel,
            "reason": self.reason,
            "kernels": [v.to_json() for v in self.kernel_verdicts],
        }
