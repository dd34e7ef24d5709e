"""One decision: the model a policy's machine drives.

``DecisionRun`` holds the inputs, the candidates being narrowed, the outcome so
far and the recorder, and offers the steps the operations they are made of
(verdict, scan, require, prune, select). It does not choose the next step: the
machine does, by evaluating the steps' guards as the conditions of its ordered
``advance`` transitions (``machine.py``). The same inputs always give the same
path and the same trace.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_fsm.backends.pf_choice import choose_prepare_finalize
from moe_fsm.backends.registry import Registry
from moe_fsm.backends.verdict import BackendVerdict, SupportContext
from moe_fsm.errors import BackendUnsupportedError, InputError, SelectionError
from moe_fsm.fsm.machine import machine_for
from moe_fsm.fsm.policy import FALLBACK_NONE, SELECTED, START, TERMINAL_STATES, FamilyPolicy
from moe_fsm.fsm.steps import Step
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.speed import SpeedTable
from moe_fsm.trace.recorder import Recorder


@dataclass(frozen=True)
class Selection:
    """Where a decision ended: the backend, the experts kernel class, and the step that chose it."""

    status: str  # selected | fallback_none
    backend: str
    kernel: str | None
    via: str


class DecisionRun:
    """The model the machine drives; one per decision."""

    def __init__(self, ctx: SupportContext, policy: FamilyPolicy, request: str, request_source: str,
                 registry: Registry, recorder: Recorder, speed_table: SpeedTable | None = None) -> None:
        self.ctx = ctx
        self.speed_table = speed_table  # measured figures, read by a profile's MeasuredScan (fsm/measured_steps.py)
        self.family = ctx.layer.family
        self.policy = policy
        self.request = request
        self.request_source = request_source
        self.registry = registry
        self._memo = registry.memo_for(ctx)
        self._known = registry.known_outcomes(ctx, self._memo)
        self.rec = recorder
        self.state = START
        self.pruned: dict[str, str] = {}
        self.selection: Selection | None = None
        self.prepare_finalize = None
        self.error: SelectionError | None = None
        self.path: list[str] = [START]
        self.resolved: dict[str, object] = {}  # server arguments an engine's pipeline resolves (fsm/runner_steps.py)

    def run(self) -> None:
        """Pump the machine's one trigger until it rests in a terminal state."""
        advance = machine_for(self.policy).events["advance"]
        while self.state not in TERMINAL_STATES:
            if not advance.trigger(self):
                raise AssertionError(f"the {self.policy.label} machine has no way on from {self.state}")

    # -- called by the machine --------------------------------------------------------

    def entered(self, event) -> None:
        self.path.append(self.state)
        if self.rec.enabled:
            self.rec.emit("transition", trigger=event.event.name, source=event.transition.source, dest=self.state)

    def act(self, step: Step) -> None:
        try:
            step.act(self)
        except SelectionError as err:
            self.error = err
            self.selection = None

    def record_guard(self, step: Step, guard: str, inputs: dict, result: bool, env_vars: tuple[str, ...] = ()) -> None:
        self.rec.append(_guard_event(step, guard, inputs, result, env_vars, self.ctx.env))

    def env_guard(self, step: Step, evaluate) -> bool:
        """A guard that reads only env variables: evaluated (and its event built) once per env snapshot.

        ``evaluate(env)`` returns (result, guard kind, inputs, variables read).
        """
        memo = self.ctx.env.guards
        known = memo.get(step)
        if known is None:
            result, guard, inputs, env_vars = evaluate(self.ctx.env)
            known = memo[step] = (result, _guard_event(step, guard, inputs, result, env_vars, self.ctx.env))
        if self.rec.enabled:
            self.rec.append(known[1])
        return known[0]

    # -- what steps are made of -------------------------------------------------------

    def in_format(self, fmt: ActivationFormat, because: str | None) -> None:
        """Ask the following verdicts (and pair a selection) in another activation format than the decision's."""
        self.ctx = self.registry.canonical(replace(self.ctx, activation_format=fmt))
        self._memo = self.registry.memo_for(self.ctx)
        self._known = self.registry.known_outcomes(self.ctx, self._memo)
        if because and self.rec.enabled:
            self.rec.emit("note", text=because)

    def outcomes(self, requirements) -> tuple[str | None, ...]:
        """Each requirement's failure in this decision's context (None: it holds), memoized with the verdicts."""
        return self.registry.outcomes(requirements, self.ctx, self._known)

    def holds(self, requirements) -> bool:
        """Every requirement holds in this decision's context (evaluated up to the first that fails)."""
        return self.registry.holds(requirements, self.ctx, self._known)

    def verdict(self, backend: str, kernels: tuple[str, ...] | None = None, extra: tuple = ()) -> BackendVerdict:
        """A backend's verdict (``kernels`` / ``extra``: a step's own kernel classes and conditions for it)."""
        if kernels is None and not extra:
            verdict = self.registry.verdict(self.family, backend, self.ctx, self._memo)
        else:
            verdict = self.registry.step_verdict(self.family, backend, self.ctx, kernels, extra)
        if self.rec.enabled:
            self.rec.append(verdict.candidate_event())
        return verdict

    def select(self, verdict: BackendVerdict) -> None:
        self.selection = Selection(SELECTED, verdict.backend, verdict.kernel, self.state)
        self._choose_prepare_finalize()

    def select_unchecked(self, backend: str, because: str) -> None:
        """Select as vLLM does where it returns a backend without asking its kernels."""
        kernels = self.registry.spec(self.family, backend).kernels
        kernel = kernels[0] if kernels else None
        self.rec.emit("unchecked", backend=backend, kernel=kernel, because=because)
        self.selection = Selection(SELECTED, backend, kernel, self.state)
        self._choose_prepare_finalize()

    def fall_back_to_platform(self) -> None:
        """The oracle returns NONE: the platform runs the layer its own way (what moe-fsm runs is build's business)."""
        self.rec.emit(
            "fallback",
            backend="NONE",
            kernel=None,
            because=f"no {self.policy.label} backend applies on a {self.ctx.platform.vendor.value} platform; "
                    "the platform runs the layer its own way",
        )
        self.selection = Selection(FALLBACK_NONE, "NONE", None, self.state)
        self._choose_prepare_finalize()

    def _choose_prepare_finalize(self) -> None:
        """The terminal pairing: how tokens reach the chosen experts, from the parallel config."""
        if self.policy.pairing is not None:
            self.prepare_finalize = self.policy.pairing(self)
            self.rec.emit("prepare_finalize", name=self.prepare_finalize.name, reason=self.prepare_finalize.reason)
            return
        try:
            self.prepare_finalize = choose_prepare_finalize(self.ctx.parallel, self.ctx.activation_format)
        except InputError as err:
            raise BackendUnsupportedError(
                f"{self.policy.label} MoE backend {self.selection.backend} ({self.selection.kernel}) cannot run with "
                f"this parallel config: {err}"
            ) from None
        self.rec.emit("prepare_finalize", name=self.prepare_finalize.name, reason=self.prepare_finalize.reason)

    def require(self, backend: str, message: str | None = None) -> None:
        """vLLM's _return_or_raise: the backend runs, or a ValueError says why (no fallback)."""
        verdict = self.verdict(backend)
        if verdict.supported:
            self.select(verdict)
            return
        if message is None:
            message = self.policy.unsupported_message.format(backend=backend, reason=verdict.reason)
        else:
            message = f"{message}: {verdict.reason}."
        raise BackendUnsupportedError(message)

    def scan(self, candidates, kernels=None, extra=None) -> list[BackendVerdict]:
        """Try candidates in order; select the first supported. Returns the rejections."""
        rejected = []
        kernels, extra = kernels or {}, extra or {}
        for backend in candidates:
            verdict = self.verdict(backend, kernels.get(backend), extra.get(backend, ()))
            if verdict.kernel is not None:
                self.select(verdict)
                return rejected
            rejected.append(verdict)
        return rejected

    def resolve(self, name: str, value: object, because: str) -> None:
        """Set a server argument the decision resolves (the runner, the all-to-all backend, ...), recording the change."""
        was = self.resolved.get(name)
        self.resolved[name] = value
        if self.rec.enabled:
            self.rec.emit("resolved", name=name, value=value, was=was, because=because)

    def prune(self, backends, because: str, **extra) -> None:
        for b in backends:
            self.pruned.setdefault(b, because)
        self.rec.emit("pruned", backends=list(backends), because=because, **extra)

    @property
    def clamp_applies(self) -> bool:
        """The layer clamps SwiGLU and the policy knows which backends apply the clamp."""
        return self.policy.clamp_backends is not None and self.ctx.layer.swiglu_limit is not None

    def clamp_blocks(self, backend: str) -> bool:
        return self.clamp_applies and backend not in self.policy.clamp_backends

    def batched_rewrite(self, backend: str) -> str:
        if self.ctx.activation_format is ActivationFormat.BATCHED and backend in self.policy.batched_variants:
            batched = self.policy.batched_variants[backend]
            self.rec.emit("rewritten", backend=backend, to=batched, because="experts use the batched activation format")
            return batched
        return backend


def _guard_event(step: Step, guard: str, inputs: dict, result: bool, env_vars, env) -> dict:
    if env_vars:
        inputs = {**inputs, "env": [env.reading(n) for n in env_vars]}
    return {"event": "guard", "step": step.name, "guard": guard, "inputs": inputs, "result": result}
