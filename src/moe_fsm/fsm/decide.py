"""One decision: a model driven through the shared machine.

``DecisionRun`` holds the inputs, the candidate list being narrowed, and the
recorder. Each step state's handler either resolves the decision (a selection
or an error) or leaves it open, and the driver then fires ``conclude`` or
``advance``; the machine checks the guards and records the transition. The
handlers read only the frozen inputs and the registry's verdicts, so the same
inputs always give the same path and the same trace.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_fsm.backends.registry import Registry
from moe_fsm.backends.verdict import BackendVerdict, SupportContext
from moe_fsm.errors import BackendUnsupportedError, NoBackendError, SelectionError
from moe_fsm.fsm.machine import selection_machine
from moe_fsm.fsm.policy import (
    AUTO_SCAN, ENV_OVERRIDE, EXPLICIT_USER_CHOICE, FAILED, FALLBACK_NONE, FI_CUTEDSL, FI_CUTLASS, FI_TRTLLM,
    FLASHINFER_PREFERENCE, FORCED_MARLIN, LORA_SHORTCUT, POLICIES, SELECTED, START, TERMINAL_STATES,
    FamilyPolicy, Step,
)
from moe_fsm.inputs.request import AUTO
from moe_fsm.modular.interfaces import ActivationFormat
from moe_fsm.trace.recorder import Recorder

FLASHINFER_FAMILY_VAR = "VLLM_FLASHINFER_MOE_BACKEND"
FORCE_MARLIN_VAR = "VLLM_TEST_FORCE_FP8_MARLIN"


@dataclass(frozen=True)
class Selection:
    """Where a decision ended: the backend, the experts kernel class, and the step that chose it."""

    status: str  # selected | fallback_none
    backend: str
    kernel: str | None
    via: str


class DecisionRun:
    """The model the machine drives; one per decision."""

    def __init__(self, ctx: SupportContext, request: str, request_source: str, registry: Registry, recorder: Recorder) -> None:
        self.ctx = ctx
        self.policy: FamilyPolicy = POLICIES[ctx.layer.family]
        self.request = request
        self.request_source = request_source
        self.registry = registry
        self._memo = registry.memo_for(ctx)
        self.rec = recorder
        self.state = START
        self.step_index = -1
        self.pruned: dict[str, str] = {}
        self.selection: Selection | None = None
        self.prepare_finalize = None
        self.error: SelectionError | None = None
        self.path: list[str] = [START]
        self._pending: Step | None = None

    # -- guards, called by the machine ------------------------------------------------

    def next_step_is(self, event) -> bool:
        return self._pending.state == event.transition.dest

    def has_selection(self, event) -> bool:
        return self.selection is not None and self.selection.status == SELECTED

    def falls_back_to_platform(self, event) -> bool:
        return self.selection is not None and self.selection.status == FALLBACK_NONE

    def has_error(self, event) -> bool:
        return self.error is not None

    def on_entered(self, event) -> None:
        self.path.append(self.state)
        self.rec.emit("transition", trigger=event.event.name, source=event.transition.source, dest=self.state)

    # -- driving ----------------------------------------------------------------------

    def run(self) -> None:
        machine = selection_machine()
        handlers = {
            LORA_SHORTCUT: self._lora_shortcut,
            EXPLICIT_USER_CHOICE: self._explicit_user_choice,
            FLASHINFER_PREFERENCE: self._flashinfer_preference,
            ENV_OVERRIDE: self._env_override,
            FORCED_MARLIN: self._forced_marlin,
            AUTO_SCAN: self._auto_scan,
        }
        while self.state not in TERMINAL_STATES:
            if self.selection is not None or self.error is not None:
                machine.events["conclude"].trigger(self)
                continue
            index, self._pending = self._next_step()
            machine.events["advance"].trigger(self)
            self.step_index, step = index, self._pending
            try:
                handlers[step.state](step)
            except SelectionError as err:
                self.error = err
                self.selection = None

    def _next_step(self) -> tuple[int, Step]:
        """The next step of the policy whose guard holds; auto_scan's always does."""
        steps = self.policy.steps
        for index in range(self.step_index + 1, len(steps)):
            if self._guard(steps[index]):
                return index, steps[index]
        raise AssertionError("every policy ends with auto_scan, whose guard always holds")

    def _guard(self, step: Step) -> bool:
        """Evaluate (and record, with every env var it read) whether a step applies."""
        env, layer = self.ctx.env, self.ctx.layer
        if step.state == LORA_SHORTCUT:
            result = layer.lora and self.policy.lora_backend is not None
            return self._record_guard("lora_enabled", {"lora": layer.lora, "lora_backend": self.policy.lora_backend}, result)
        if step.state == EXPLICIT_USER_CHOICE:
            return self._record_guard("explicit_request", {"requested": self.request, "source": self.request_source}, self.request != AUTO)
        if step.state == FLASHINFER_PREFERENCE:
            fi = self.policy.flashinfer
            if fi is None:
                return self._record_guard("flashinfer_env", {}, False)
            result = env.is_set(fi.env_var) if fi.gate_on_presence else bool(env.value(fi.env_var))
            test = "is set" if fi.gate_on_presence else "reads 1"
            return self._record_guard("flashinfer_env", {"test": test}, result, (fi.env_var,))
        if step.state == ENV_OVERRIDE:
            names = step.env_rule.names
            return self._record_guard("env_override_set", {"test": "any is set"}, any(env.is_set(n) for n in names), names)
        if step.state == FORCED_MARLIN:
            result = self.policy.marlin_backend is not None and bool(env.value(FORCE_MARLIN_VAR))
            return self._record_guard("force_marlin", {"test": "reads true"}, result, (FORCE_MARLIN_VAR,))
        return self._record_guard("auto_scan", {}, True)

    def _record_guard(self, name: str, inputs: dict, result: bool, env_vars: tuple[str, ...] = ()) -> bool:
        if self.rec.enabled:
            if env_vars:
                inputs = {**inputs, "env": [self._env_reading(n) for n in env_vars]}
            self.rec.emit("guard", guard=name, inputs=inputs, result=result)
        return result

    def _env_reading(self, name: str) -> dict:
        """What the decision saw of one variable: present or not, raw text, parsed value."""
        env = self.ctx.env
        raw = next((v for k, v in env.raw if k == name), None)
        return {"name": name, "set": raw is not None, "raw": raw, "value": env.value(name)}

    # -- verdicts ---------------------------------------------------------------------

    def _verdict(self, backend: str) -> BackendVerdict:
        verdict = self.registry.verdict(self.ctx.layer.family, backend, self.ctx, self._memo)
        if self.rec.enabled:
            self.rec.emit("candidate", **verdict.summary())
        return verdict

    def _select(self, verdict: BackendVerdict) -> None:
        self.selection = Selection(SELECTED, verdict.backend, verdict.kernel, self.state)
        self._choose_prepare_finalize()

    def _choose_prepare_finalize(self) -> None:
        """The terminal pairing: how tokens reach the chosen experts, from the parallel config."""
        from moe_fsm.errors import InputError
        from moe_fsm.prepare_finalize.choice import choose_prepare_finalize

        try:
            self.prepare_finalize = choose_prepare_finalize(self.ctx.parallel, self.ctx.activation_format)
        except InputError as err:
            raise BackendUnsupportedError(
                f"{self.policy.label} MoE backend {self.selection.backend} ({self.selection.kernel}) cannot run with "
                f"this parallel config: {err}"
            ) from None
        self.rec.emit("prepare_finalize", name=self.prepare_finalize.name, reason=self.prepare_finalize.reason)

    def _require(self, backend: str, message: str | None = None) -> None:
        """vLLM's _return_or_raise: the backend runs, or a ValueError says why (no fallback)."""
        verdict = self._verdict(backend)
        if verdict.supported:
            self._select(verdict)
            return
        if message is None:
            message = self.policy.unsupported_message.format(backend=backend, reason=verdict.reason)
        else:
            message = f"{message}: {verdict.reason}."
        raise BackendUnsupportedError(message)

    def _scan(self, candidates: list[str]) -> list[BackendVerdict]:
        """Try candidates in order; select the first supported. Returns the rejections."""
        rejected = []
        for backend in candidates:
            verdict = self._verdict(backend)
            if verdict.supported:
                self._select(verdict)
                return rejected
            rejected.append(verdict)
        return rejected

    def _prune(self, backends, because: str) -> None:
        newly = [b for b in backends if b not in self.pruned]
        for b in newly:
            self.pruned[b] = because
        self.rec.emit("pruned", backends=list(backends), because=because)

    def _clamp_blocks(self, backend: str) -> bool:
        clamp = self.policy.clamp_backends
        return clamp is not None and self.ctx.layer.swiglu_limit is not None and backend not in clamp

    def _batched_rewrite(self, backend: str) -> str:
        if self.ctx.activation_format is ActivationFormat.BATCHED and backend in self.policy.batched_variants:
            batched = self.policy.batched_variants[backend]
            self.rec.emit("rewritten", backend=backend, to=batched, because="experts use the batched activation format")
            return batched
        return backend

    # -- step handlers ----------------------------------------------------------------

    def _lora_shortcut(self, step: Step) -> None:
        self._require(self.policy.lora_backend)

    def _explicit_user_choice(self, step: Step) -> None:
        policy = self.policy
        backend = policy.user_names.get(self.request) or self.registry.extension_names[policy.family].get(self.request)
        if backend is None:
            accepted = list(policy.user_names) + list(self.registry.extension_names[policy.family])
            where = "" if self.request_source == "backend" else f" (from {self.request_source})"
            raise BackendUnsupportedError(
                f"moe_backend='{self.request}' is not supported for {policy.label} MoE{where}. Expected one of {accepted}."
            )
        self.rec.emit("mapped", requested=self.request, backend=backend)
        backend = self._batched_rewrite(backend)
        if backend in policy.gated_by_allow_vllm_cutlass and not self.ctx.layer.allow_vllm_cutlass:
            raise BackendUnsupportedError(f"vLLM CUTLASS {policy.label} MoE backend is disabled for this configuration.")
        if self._clamp_blocks(backend):
            use = " or ".join(repr(policy.user_name_of(b)) for b in sorted(policy.clamp_backends))
            raise BackendUnsupportedError(
                f"Model sets swiglu_limit={self.ctx.layer.swiglu_limit}, but the explicitly requested "
                f"moe_backend={self.request!r} does not apply the SwiGLU clamp. Use {use} instead."
            )
        self._require(backend, policy.explicit_unavailable.get(backend))

    def _flashinfer_family(self) -> str:
        """vLLM's get_flashinfer_moe_backend: latency means TRTLLM only on SM100."""
        value = self.ctx.env.value(FLASHINFER_FAMILY_VAR)
        if value == "throughput":
            family = FI_CUTLASS
        elif value == "masked_gemm":
            family = FI_CUTEDSL
        elif self.ctx.platform.is_capability_family(10):
            family = FI_TRTLLM
        else:
            family = FI_CUTLASS
            self.rec.emit("note", text="Flashinfer TRTLLM MOE backend is only supported on SM100 and later, using CUTLASS backend instead")
        self.rec.emit("flashinfer_family", env=self._env_reading(FLASHINFER_FAMILY_VAR), family=family)
        return family

    def _flashinfer_preference(self, step: Step) -> None:
        fi, policy, env = self.policy.flashinfer, self.policy, self.ctx.env
        if fi.gate_on_presence and not env.value(fi.env_var):
            self._prune(fi.candidates, f"{fi.env_var}=0 rejects FlashInfer")
            return
        if fi.pinned is not None and env.is_set(FLASHINFER_FAMILY_VAR):
            family = self._flashinfer_family()
            backend = fi.pinned.get(family)
            if backend is None:
                raise BackendUnsupportedError(fi.unpinnable or f"FlashInfer MOE backend {family} does not support {policy.label} MoE.")
            if self._clamp_blocks(backend):
                raise BackendUnsupportedError(
                    f"Model sets swiglu_limit={self.ctx.layer.swiglu_limit}, but the FlashInfer backend selected via "
                    f"{FLASHINFER_FAMILY_VAR} ({backend}) does not apply the SwiGLU clamp."
                )
            self._require(backend)
            return
        candidates = [b for b in fi.candidates if not self._clamp_blocks(b)]
        if fi.requires_latency and env.value(FLASHINFER_FAMILY_VAR) != "latency":
            self.rec.emit("pruned", backends=list(fi.requires_latency), because=f"{FLASHINFER_FAMILY_VAR} does not read latency",
                          env=self._env_reading(FLASHINFER_FAMILY_VAR))
            candidates = [b for b in candidates if b not in fi.requires_latency]
        rejected = self._scan(candidates)
        if self.selection is None and fi.raise_when_exhausted:
            fi_label = "NVFP4" if policy.label == "NvFp4" else policy.label
            raise NoBackendError(
                f"Found {fi.env_var}=1, but no FlashInfer {fi_label} MoE backend supports the configuration."
                + _reasons(rejected)
            )

    def _env_override(self, step: Step) -> None:
        rule, env = step.env_rule, self.ctx.env
        if not all(env.value(n) for n in rule.names):
            off = [n for n in rule.names if not env.value(n)]
            self._prune(rule.prunes, f"{', '.join(off)} disables it")
            return
        batched = self.ctx.activation_format is ActivationFormat.BATCHED
        self._require(rule.batched if batched else rule.standard)

    def _forced_marlin(self, step: Step) -> None:
        self._require(self.policy.marlin_backend)

    def _auto_scan(self, step: Step) -> None:
        policy, ctx = self.policy, self.ctx
        candidates = list(policy.priority_for(ctx.platform.vendor))
        if policy.gated_by_allow_vllm_cutlass and not ctx.layer.allow_vllm_cutlass:
            self._prune(policy.gated_by_allow_vllm_cutlass, "allow_vllm_cutlass is off for this checkpoint")
        clamp_blocked = [b for b in candidates if self._clamp_blocks(b)]
        if clamp_blocked:
            self._prune(clamp_blocked, f"swiglu_limit={ctx.layer.swiglu_limit} needs a backend that applies the SwiGLU clamp")
        candidates += [spec.name for spec in self.registry.extensions(policy.family) if spec.auto_select]
        candidates = [b for b in candidates if b not in self.pruned]
        self.rec.emit("scan", candidates=candidates)
        rejected = self._scan(candidates)
        if self.selection is not None:
            return
        if ctx.platform.vendor in policy.none_on_vendors:
            fallback = self.registry.fallback_verdicts(ctx)
            self.rec.emit(
                "fallback",
                backend="NONE",
                kernel=fallback.kernel,
                because=f"no {policy.label} backend applies on a {ctx.platform.vendor.value} platform; "
                + ("the platform runs the layer its own way" if fallback.kernel is None else f"moe-fsm runs it with {fallback.kernel}"),
            )
            self.selection = Selection(FALLBACK_NONE, "NONE", fallback.kernel, AUTO_SCAN)
            self._choose_prepare_finalize()
            return
        raise NoBackendError(policy.exhausted_message + _reasons(rejected))


def _reasons(rejected: list[BackendVerdict]) -> str:
    if not rejected:
        return ""
    return " Rejected: " + "; ".join(f"{v.backend} ({v.reason})" for v in rejected) + "."
