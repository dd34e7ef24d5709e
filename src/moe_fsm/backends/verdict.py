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

    It keeps each requirement's outcome (None: passed, else why it failed) beside
    the requirements, and pairs them into ``checks`` only when asked: a cold
    decision builds dozens of verdicts, and the trace needs only the failures.
    """

    __slots__ = ("subject", "requirements", "outcomes", "failures")

    def __init__(self, subject: str, requirements: tuple, outcomes: tuple[str | None, ...]) -> None:
        self.subject = subject
        self.requirements = requirements
        self.outcomes = outcomes
        self.failures = tuple(filter(None, outcomes))

    @property
    def checks(self) -> tuple[Check, ...]:
        return tuple(map(Check, self.requirements, self.outcomes))

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

    __slots__ = ("backend", "kernel_verdicts", "kernel", "reason", "_event")

    def __init__(self, backend: str, kernel_verdicts: tuple[Verdict, ...]) -> None:
        self.backend = backend
        self.kernel_verdicts = kernel_verdicts
        self.kernel = self.reason = self._event = None
        for verdict in kernel_verdicts:
            if not verdict.failures:
                self.kernel = verdict.subject
                return
        self.reason = kernel_verdicts[-1].reason if kernel_verdicts else "no kernel class is registered for it"

    @property
    def supported(self) -> bool:
        return self.kernel is not None

    def candidate_event(self) -> dict:
        """The trace's ``candidate`` event: each kernel's failing checks (passing ones are implied).

        Built once per verdict (verdicts are immutable and memoized); treat it as read-only.
        """
        if self._event is None:
            self._event = {
                "event": "candidate",
                "backend": self.backend,
                "supported": self.kernel is not None,
                "kernel": self.kernel,
                "reason": self.reason,
                "kernels": [{"kernel": v.subject, "supported": not v.failures, "failed": list(v.failures)}
                            for v in self.kernel_verdicts],
            }
        return self._event

    def to_json(self) -> dict:
        return {
            "backend": self.backend,
            "supported": self.supported,
            "kernel": self.kernel,
            "reason": self.reason,
            "kernels": [v.to_json() for v in self.kernel_verdicts],
        }
