"""Step kinds for an engine that resolves one server-wide runner name through a pipeline of server arguments.

SGLang does not scan a priority list per layer as vLLM's oracles do. Its server
resolves ``--moe-runner-backend`` (and ``--moe-a2a-backend``, ``ep_size``,
``--deepep-mode``, ``--quantization``) once, in an ordered pipeline: the flag as
given, an alias, per-architecture model overrides, quantization constraints, the
all-to-all constraints, the speculative default. Then each MoE layer's
quantization method turns what is left (``auto`` above all) into the runner the
layer builds (``create_moe_runner``). Each stage is one state of the machine; what
a stage does is an ordered list of ``Rule`` objects (conditions, then the server
arguments they set, or the error they raise), so the guards and their order are
data of the profile, and every rule tried is recorded with each condition's
verdict.

The values being resolved live on the decision (``DecisionRun.resolved``); a
``Resolved`` condition reads them, a ``Requirement`` reads the frozen inputs,
and a rule may use both. ``Value`` names where a value comes from (an input, or
another resolved argument).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

from moe_fsm.errors import BackendUnsupportedError, SelectionError
from moe_fsm.fsm.steps import Step

LAYER_RUNNER = "layer_runner"  # the resolved argument a layer's quantization method sets
LAYER_METHOD = "layer_method"  # the layer's quantization method, resolved before its rules run
DIRECT_KERNEL = "direct_kernel"  # what runs when it is not the reported runner (a kernel the method calls itself)


@dataclass(frozen=True)
class Value:
    """Where a value a rule sets comes from: ``get(run)``, described by ``text``."""

    text: str
    get: Callable[..., object]

    def __str__(self) -> str:
        return self.text


def resolved_value(name: str) -> Value:
    """Another server argument as resolved so far (``ep_size`` takes ``tp_size``)."""
    return Value(name, lambda run: run.resolved[name])


@dataclass(frozen=True)
class Resolved:
    """A condition on server arguments as resolved so far: ``test`` of their values (in ``names`` order)."""

    text: str
    names: tuple[str, ...]
    test: Callable[..., bool]

    @property
    def description(self) -> str:
        return self.text

    def failure(self, run) -> str | None:
        values = [run.resolved.get(n) for n in self.names]
        if self.test(*values):
            return None
        shown = ", ".join(f"{n}={v!r}" for n, v in zip(self.names, values))
        return f"not so: {shown}"


def is_(name: str, *values) -> Resolved:
    """The argument is one of ``values``."""
    shown = values[0] if len(values) == 1 else list(values)
    return Resolved(f"{name} {'==' if len(values) == 1 else 'in'} {shown!r}", (name,), lambda v: v in values)


def is_not(name: str, *values) -> Resolved:
    shown = values[0] if len(values) == 1 else list(values)
    return Resolved(f"{name} {'!=' if len(values) == 1 else 'not in'} {shown!r}", (name,), lambda v: v not in values)


def failures(run, conditions) -> list[tuple[object, str | None]]:
    """Each condition (a ``Requirement`` of the inputs or a ``Resolved``) with its failure (None: it holds),
    evaluated in order up to the first that fails (as the engine's ``and`` does: a later condition may read
    what an earlier one rules out)."""
    out = []
    for condition in conditions:
        if isinstance(condition, Resolved):
            failure = condition.failure(run)
        else:
            failure = run.outcomes((condition,))[0]
        out.append((condition, failure))
        if failure is not None:
            break
    return out


@dataclass(frozen=True)
class Rule:
    """One ``if`` of the engine's resolution, as data.

    When every condition of ``when`` holds: raise ``error(fail)`` (formatted with the
    resolved arguments) if ``fail`` is given, else set each argument of ``sets``
    (a literal or a ``Value``); a rule that sets nothing records that the engine
    leaves the arguments as they are. ``because`` says what the rule is in the
    engine's words.
    """

    because: str
    when: tuple = ()
    sets: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    fail: str | None = None
    error: type[SelectionError] = BackendUnsupportedError

    def apply(self, step: Step, run) -> bool:
        """Try the rule; True when it fired (its settings are made, or its error raised)."""
        checks = failures(run, self.when)
        fired = len(checks) == len(self.when) and all(failure is None for _, failure in checks)
        if run.rec.enabled:
            run.rec.emit("rule", step=step.name, rule=self.because, fired=fired, when=[
                {"condition": c.description, "holds": failure is None, "reason": failure} for c, failure in checks])
        if not fired:
            return False
        if self.fail is not None:
            raise self.error(self.fail.format(**run.resolved))
        for name, value in self.sets.items():
            run.resolve(name, value.get(run) if isinstance(value, Value) else value, self.because)
        return True


@dataclass(frozen=True)
class First:
    """An ``if/elif`` chain: its rules are tried in order until one fires."""

    rules: tuple[Rule, ...]

    def apply(self, step: Step, run) -> bool:
        return any(rule.apply(step, run) for rule in self.rules)


def apply_rules(step: Step, run, rules) -> None:
    """Each ``Rule`` or ``First`` chain in order, as the engine's consecutive ``if`` statements."""
    for rule in rules:
        rule.apply(step, run)


def _record_when(step: Step, run, conditions) -> bool:
    checks = failures(run, conditions)
    result = len(checks) == len(conditions) and all(failure is None for _, failure in checks)
    if run.rec.enabled:
        run.record_guard(step, "when", {"when": [
            {"condition": c.description, "holds": failure is None, "reason": failure} for c, failure in checks
        ]}, result)
    return result


@dataclass(frozen=True, eq=False)
class ServerArgs(Step):
    """The server arguments as the caller gave them: each of ``seed`` (name -> ``Value`` of the inputs) is
    resolved first, before any stage reads it. Its guard always holds."""

    seed: Mapping[str, Value] = field(default_factory=lambda: MappingProxyType({}))

    def guard(self, run) -> bool:
        if run.rec.enabled:
            run.record_guard(self, "server_args", {}, True)
        return True

    def act(self, run) -> None:
        for name, value in self.seed.items():
            run.resolve(name, value.get(run), f"as given ({value})")

    def guard_text(self) -> str:
        return "always"


@dataclass(frozen=True, eq=False)
class Stage(Step):
    """One stage of the server-argument pipeline: entered when every condition of ``when`` holds
    (an empty ``when`` always), then its ``rules`` are tried in order."""

    when: tuple = ()
    rules: tuple = ()  # Rule and First, in order

    def guard(self, run) -> bool:
        return _record_when(self, run, self.when)

    def act(self, run) -> None:
        apply_rules(self, run, self.rules)

    def guard_text(self) -> str:
        return " and ".join(c.description for c in self.when) or "always"


@dataclass(frozen=True, eq=False)
class LayerRunner(Step):
    """The layer's quantization method turns the resolved runner into the one it builds (``create_moe_runner``).

    ``method``: the layer's method name (a ``Value`` of the inputs and resolved arguments); ``before``: rules
    every layer meets when its method is made (the engine's layer constructor); ``methods``: per method name,
    the rules (``Rule`` and ``First``) that set ``layer_runner`` (or raise); ``after``: rules the chosen
    runner then meets (the engine's runner constructor). The runner name maps to a backend of the family by
    the policy's ``user_names``, whose verdict decides; ``direct_kernel``, when a rule sets it, names what runs
    instead of the reported runner (a kernel the method calls itself). A method this profile does not list is
    refused by name.
    """

    method: Value | None = None
    before: tuple = ()
    methods: Mapping[str, tuple] = field(default_factory=lambda: MappingProxyType({}))
    after: tuple = ()

    def guard(self, run) -> bool:
        if run.rec.enabled:
            run.record_guard(self, "layer_runner", {"method": self.method.get(run)}, True)
        return True

    def act(self, run) -> None:
        policy, name = run.policy, self.method.get(run)
        rules = self.methods.get(name)
        if rules is None:
            raise BackendUnsupportedError(
                f"{policy.label} MoE layers with quantization method {name!r} are not modelled by this profile; "
                f"it models {sorted(self.methods)}")
        run.resolve(LAYER_METHOD, name, str(self.method))
        apply_rules(self, run, self.before)
        apply_rules(self, run, rules)
        if LAYER_RUNNER not in run.resolved:
            raise BackendUnsupportedError(
                f"{name} builds no MoE runner for moe_runner_backend={run.resolved.get('moe_runner_backend')!r}")
        apply_rules(self, run, self.after)
        runner = run.resolved.get(DIRECT_KERNEL) or run.resolved[LAYER_RUNNER]
        backend = policy.user_names.get(runner)
        if backend is None:
            raise BackendUnsupportedError(f"{policy.label} MoE has no backend for runner {runner!r}")
        run.rec.emit("mapped", requested=runner, backend=backend)
        run.require(backend)

    def guard_text(self) -> str:
        return "always: the layer's quantization method builds its runner"
