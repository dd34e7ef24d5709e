"""The kinds of step an oracle is made of, each parameterised by data.

A policy's steps are instances of these kinds; each instance is one state of
that policy's machine. A step has a guard (does it apply to this decision? the
machine evaluates it as the condition of the transition into the step, and the
evaluation is recorded) and an action (run when the state is entered: it
selects, raises, or narrows the candidates and leaves the decision open).
Every kind reads only the decision's frozen inputs and the registry's verdicts,
so a new family whose oracle is shaped like the existing ones is new data, not
new code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from moe_fsm.errors import BackendUnsupportedError, NoBackendError
from moe_fsm.fsm.activation_order import ActivationOrder
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.request import AUTO

if TYPE_CHECKING:
    from moe_fsm.backends.requirements import Requirement

FI_CUTLASS, FI_TRTLLM, FI_CUTEDSL = "CUTLASS", "TENSORRT_LLM", "CUTEDSL"


@dataclass(frozen=True, eq=False)
class Step:
    """Base of the step kinds; ``name`` is the state's name (unique within a policy).

    Steps compare and hash by identity: a step is one state of one policy's machine.
    ``run``, in every method, is the decision in progress (``fsm/decide.py``'s
    ``DecisionRun``); it drives the steps, so it sits above them and is named
    here only in words.
    """

    name: str

    def guard(self, run) -> bool:
        raise NotImplementedError

    def act(self, run) -> None:
        raise NotImplementedError

    def guard_text(self) -> str:
        """The guard in words, for the state diagram."""
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class Shortcut(Step):
    """When every condition holds, the first supported candidate is the decision.

    vLLM's LoRA steps (seeds FP8: LoRA forces TRITON; 0.33 unquantized: the
    FlashInfer TRT-LLM LoRA experts, else TRITON) and platform shortcuts (0.33:
    TPU and OOT return their backend at once). When no candidate is supported,
    ``otherwise`` is selected without a support check (as vLLM returns it), or,
    without ``otherwise``, the last rejection is raised as a ValueError.
    ``kernels`` / ``extra``: for a candidate, the kernel classes tried in this step
    instead of the backend's own, and conditions added to theirs (0.33's LoRA step
    tries TrtLlmBf16LoRAExperts under FLASHINFER_TRTLLM, and only when the
    per-partition intermediate size is a multiple of 128).
    ``activation_format``: the format the candidates are checked in, whatever the
    decision's (0.33's LoRA gate asks TrtLlmBf16LoRAExperts about the standard
    format even when ``--backend batched_triton`` would make the scan batched);
    a candidate selected here keeps that format for its prepare/finalize.
    """

    when: tuple["Requirement", ...] = ()
    candidates: tuple[str, ...] = ()
    otherwise: str | None = None
    kernels: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    extra: Mapping[str, tuple["Requirement", ...]] = field(default_factory=dict)
    activation_format: ActivationFormat | None = None

    def guard(self, run) -> bool:
        checks = list(zip(self.when, run.outcomes(self.when)))
        result = all(failure is None for _, failure in checks)
        if run.rec.enabled:
            run.record_guard(self, "when", {"when": [
                {"condition": r.description, "holds": failure is None, "reason": failure} for r, failure in checks
            ]}, result)
        return result

    def act(self, run) -> None:
        decision_format = run.ctx.activation_format
        if self.activation_format is not None and self.activation_format is not decision_format:
            run.in_format(self.activation_format, f"{self.name} checks its candidates in the "
                                                  f"{self.activation_format.value} activation format")
        rejected = run.scan(self.candidates, self.kernels, self.extra)
        if run.selection is not None:
            return
        if run.ctx.activation_format is not decision_format:
            run.in_format(decision_format, None)
        if self.otherwise is not None:
            run.select_unchecked(self.otherwise, f"{self.name}: vLLM returns {self.otherwise} without a support check")
            return
        last = rejected[-1]
        raise BackendUnsupportedError(run.policy.unsupported_message.format(backend=last.backend, reason=last.reason))

    def guard_text(self) -> str:
        return " and ".join(r.description for r in self.when) or "always"


@dataclass(frozen=True, eq=False)
class ExplicitChoice(Step):
    """The backend the user named for the family (``moe_backend`` / ``--backend``).

    ``passthrough``: names the oracle treats as auto for this family (vLLM 0.33's
    unquantized oracle lets 'humming' and 'marlin' fall through).
    """

    passthrough: tuple[str, ...] = ()

    def guard(self, run) -> bool:
        result = run.request != AUTO and run.request not in self.passthrough
        if run.rec.enabled:
            inputs = {"requested": run.request, "source": run.request_source}
            if self.passthrough:
                inputs["passthrough"] = list(self.passthrough)
            run.record_guard(self, "explicit_request", inputs, result)
        return result

    def act(self, run) -> None:
        policy, ctx = run.policy, run.ctx
        backend = policy.user_names.get(run.request) or run.registry.extension_names[policy.family].get(run.request)
        if backend is None:
            accepted = list(policy.user_names) + list(run.registry.extension_names[policy.family])
            where = "" if run.request_source == "backend" else f" (from {run.request_source})"
            raise BackendUnsupportedError(
                f"moe_backend='{run.request}' is not supported for {policy.label} MoE{where}. Expected one of {accepted}."
            )
        run.rec.emit("mapped", requested=run.request, backend=backend)
        backend = run.batched_rewrite(backend)
        if backend in policy.gated_by_allow_vllm_cutlass and not ctx.layer.allow_vllm_cutlass:
            raise BackendUnsupportedError(f"vLLM CUTLASS {policy.label} MoE backend is disabled for this configuration.")
        if run.clamp_blocks(backend):
            use = " or ".join(repr(policy.user_name_of(b)) for b in sorted(policy.clamp_backends))
            raise BackendUnsupportedError((policy.clamp_refusal or (
                "Model sets swiglu_limit={limit}, but the explicitly requested moe_backend={request!r} does not "
                "apply the SwiGLU clamp. Use {use} instead."
            )).format(limit=ctx.layer.swiglu_limit, request=run.request, use=use))
        run.require(backend, policy.explicit_unavailable.get(backend))

    def guard_text(self) -> str:
        extra = f" (nor one of {', '.join(self.passthrough)})" if self.passthrough else ""
        return f"backend requested for the family is not auto{extra}"


@dataclass(frozen=True, eq=False)
class FlashInferPreference(Step):
    """How a family reacts to its VLLM_USE_FLASHINFER_MOE_* variable (the seed oracles).

    ``gate_on_presence``: the FP8/NVFP4 oracles act when the variable is *set*
    (0 prunes FlashInfer, 1 forces it); the unquantized oracle acts only when it
    reads true and otherwise carries on. ``pinned`` maps the FlashInfer family
    named by ``family_var`` to a backend (a missing key is an error with
    ``unpinnable``); ``requires_latency`` lists backends tried only when that
    variable reads ``latency``. ``exhausted``: the NoBackendError message when no
    candidate runs (None: carry on to the next step).
    """

    env_var: str = ""
    gate_on_presence: bool = True
    candidates: tuple[str, ...] = ()
    pinned: Mapping[str, str] | None = None
    unpinnable: str = ""
    requires_latency: tuple[str, ...] = ()
    exhausted: str | None = None
    family_var: str = "VLLM_FLASHINFER_MOE_BACKEND"

    def guard(self, run) -> bool:
        return run.env_guard(self, self._evaluate)

    def _evaluate(self, env):
        result = env.is_set(self.env_var) if self.gate_on_presence else bool(env.value(self.env_var))
        return result, "flashinfer_env", {"test": "is set" if self.gate_on_presence else "reads 1"}, (self.env_var,)

    def act(self, run) -> None:
        env, layer = run.ctx.env, run.ctx.layer
        if self.gate_on_presence and not env.value(self.env_var):
            run.prune(self.candidates, f"{self.env_var}=0 rejects FlashInfer")
            return
        if self.pinned is not None and env.is_set(self.family_var):
            family = self._flashinfer_family(run)
            backend = self.pinned.get(family)
            if backend is None:
                raise BackendUnsupportedError(
                    self.unpinnable or f"FlashInfer MOE backend {family} does not support {run.policy.label} MoE."
                )
            if run.clamp_blocks(backend):
                raise BackendUnsupportedError(
                    f"Model sets swiglu_limit={layer.swiglu_limit}, but the FlashInfer backend selected via "
                    f"{self.family_var} ({backend}) does not apply the SwiGLU clamp."
                )
            run.require(backend)
            return
        candidates = [b for b in self.candidates if not run.clamp_blocks(b)]
        if self.requires_latency and env.value(self.family_var) != "latency":
            run.prune(self.requires_latency, f"{self.family_var} does not read latency", env=env.reading(self.family_var))
            candidates = [b for b in candidates if b not in self.requires_latency]
        rejected = run.scan(candidates)
        if run.selection is None and self.exhausted is not None:
            raise NoBackendError(self.exhausted + reasons(rejected))

    def _flashinfer_family(self, run) -> str:
        """vLLM's get_flashinfer_moe_backend: latency means TRTLLM only on SM100."""
        value = run.ctx.env.value(self.family_var)
        if value == "throughput":
            family = FI_CUTLASS
        elif value == "masked_gemm":
            family = FI_CUTEDSL
        elif run.ctx.platform.is_capability_family(10):
            family = FI_TRTLLM
        else:
            family = FI_CUTLASS
            run.rec.emit("note", text="Flashinfer TRTLLM MOE backend is only supported on SM100 and later, "
                                      "using CUTLASS backend instead")
        run.rec.emit("flashinfer_family", env=run.ctx.env.reading(self.family_var), family=family)
        return family

    def guard_text(self) -> str:
        return f"{self.env_var} {'is set' if self.gate_on_presence else 'reads 1'}"


@dataclass(frozen=True, eq=False)
class EnvOverride(Step):
    """Env switches that, when any is set, force a backend (all read true) or prune it (any reads false).

    ``unsupported``: what happens when the forced backend cannot run: "raise" (a
    ValueError, vLLM's _return_or_raise) or "prune" (vLLM 0.33's unquantized AITER:
    warn and scan the rest).
    """

    names: tuple[str, ...] = ()
    standard: str = ""
    batched: str = ""
    prunes: tuple[str, ...] = ()
    unsupported: str = "raise"

    def guard(self, run) -> bool:
        return run.env_guard(self, self._evaluate)

    def _evaluate(self, env):
        return any(env.is_set(n) for n in self.names), "env_override_set", {"test": "any is set"}, self.names

    def act(self, run) -> None:
        env = run.ctx.env
        if not all(env.value(n) for n in self.names):
            off = [n for n in self.names if not env.value(n)]
            run.prune(self.prunes, f"{', '.join(off)} disables it")
            return
        backend = self.batched if run.ctx.activation_format is ActivationFormat.BATCHED else self.standard
        if self.unsupported == "raise":
            run.require(backend)
            return
        run.scan([backend])
        if run.selection is None:
            run.prune(self.prunes, f"{' and '.join(self.names)} ask for {backend}, which cannot run this layer; "
                                   "the remaining backends are scanned")

    def guard_text(self) -> str:
        return "any of " + ", ".join(self.names) + " is set"


@dataclass(frozen=True, eq=False)
class ForcedBackend(Step):
    """A switch that forces one backend when it reads true (seeds: VLLM_TEST_FORCE_FP8_MARLIN)."""

    env_var: str = ""
    backend: str = ""

    def guard(self, run) -> bool:
        return run.env_guard(self, self._evaluate)

    def _evaluate(self, env):
        result = bool(env.value(self.env_var))
        return result, "force_backend", {"test": "reads true", "backend": self.backend}, (self.env_var,)

    def act(self, run) -> None:
        run.require(self.backend)

    def guard_text(self) -> str:
        return f"{self.env_var} reads true"


@dataclass(frozen=True, eq=False)
class AutoScan(Step):
    """The priority scan: the policy's list for the vendor, reordered and pruned, first supported wins.

    Its guard always holds, so every policy's last step is an AutoScan. When
    nothing runs: NONE on the policy's ``none_on_vendors``, else the policy's
    exhausted error. ``activation_order`` (vLLM 0.33 MXFP4) narrows and orders
    the list by the checkpoint's activation key; ``last_resort`` names, per
    vendor, a backend required once more after an exhausted scan (vLLM 0.33
    MXFP4 on XPU), whose refusal is then the error.
    """

    activation_order: ActivationOrder | None = None
    last_resort: Mapping[Vendor, str] = field(default_factory=lambda: MappingProxyType({}))

    def guard(self, run) -> bool:
        if run.rec.enabled:
            run.record_guard(self, "auto_scan", {}, True)
        return True

    def act(self, run) -> None:
        rejected = run.scan(self.scan_order(run))
        if run.selection is None:
            self.conclude_unselected(run, rejected)

    def scan_order(self, run) -> list[str]:
        """The candidates in the order the scan tries them (reordered, pruned, recorded as the ``scan`` event)."""
        policy, ctx = run.policy, run.ctx
        candidates = list(policy.priority_for(ctx.platform.vendor))
        for rule in policy.reorders:
            if run.holds(rule.when):
                moving = [b for b in rule.backends if b in candidates]
                candidates = rule.apply(candidates)
                run.rec.emit("reordered", backends=moving, to=rule.to, because=rule.because)
        if policy.gated_by_allow_vllm_cutlass and not ctx.layer.allow_vllm_cutlass:
            run.prune(policy.gated_by_allow_vllm_cutlass, "allow_vllm_cutlass is off for this checkpoint")
        clamp_blocked = [b for b in candidates if run.clamp_blocks(b)] if run.clamp_applies else ()
        if clamp_blocked:
            run.prune(clamp_blocked, f"swiglu_limit={ctx.layer.swiglu_limit} needs a backend that applies the SwiGLU clamp")
        candidates += [spec.name for spec in run.registry.extensions(policy.family) if spec.auto_select]
        candidates = [b for b in candidates if b not in run.pruned]
        if self.activation_order is not None:
            candidates = self.activation_order.apply(run, candidates)
        run.rec.emit("scan", candidates=candidates)
        return candidates

    def conclude_unselected(self, run, rejected) -> None:
        """No candidate runs: the platform's own path (NONE), a last resort, or the policy's exhausted error."""
        policy, ctx = run.policy, run.ctx
        if ctx.platform.vendor in policy.none_on_vendors:
            run.fall_back_to_platform()
            return
        last = self.last_resort.get(ctx.platform.vendor)
        if last is not None:
            run.rec.emit("note", text=f"no backend ran: on {ctx.platform.vendor.value} the oracle asks {last} once more")
            run.require(last)
            return
        raise policy.exhausted_error(policy.exhausted_message + reasons(rejected))

    def guard_text(self) -> str:
        return "no earlier step decided"


def reasons(rejected) -> str:
    if not rejected:
        return ""
    return " Rejected: " + "; ".join(f"{v.backend} ({v.reason})" for v in rejected) + "."
