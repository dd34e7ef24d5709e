"""Step kinds for oracles whose names stand for several backends, and for platform gates.

vLLM 0.33's newer oracles differ from the seed ones in three ways the step
kinds of ``steps.py`` do not express, each kept as data here:

- a ``--moe-backend`` name stands for an ordered list of backends (the MXFP4
  oracle: ``flashinfer_trtllm`` is the BF16-activation variant, then the MXFP8
  one), narrowed by the activation the checkpoint asks for, tried in order,
  and the last refusal is what the user sees; or the list narrows the scan
  and a refusal is the oracle's "nothing fits" error (W4A8);
- a backend runs its support check with its own activation key, not the
  layer's (``BackendSpec.activation_key``), and the scan order puts the
  variants matching the checkpoint's activation first (``ActivationOrder``,
  in ``activation_order.py``, which the auto scan of ``steps.py`` shares);
- an oracle refuses a platform outright before looking at any request
  (W4A8-INT8: CPU only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from moe_fsm.errors import BackendUnsupportedError
from moe_fsm.fsm.activation_order import ActivationOrder, activation_key_text
from moe_fsm.fsm.steps import Step, reasons
from moe_fsm.inputs.request import AUTO

if TYPE_CHECKING:
    from moe_fsm.backends.requirements import Requirement


@dataclass(frozen=True)
class ExplicitAlternatives(Step):
    """A requested name stands for backends tried in order (vLLM 0.33 MXFP4 and W4A8).

    ``alternatives``: name -> backends. ``activation_order``: narrow and order
    them by the checkpoint's activation (``unordered_without_activation`` names
    skip that when the checkpoint asks for none, as ``b12x`` does);
    ``forced``: name -> (env var, backends) used instead when the variable reads
    true. ``lora_kernels``: for a named backend with LoRA, kernel classes tried
    first (vLLM 0.33's TRTLLM LoRA experts, an explicit-only choice). ``refusals``:
    name (listed in ``alternatives`` with no backends) -> (backend, reason) for a
    backend that cannot run any layer moe-fsm describes (it needs an input
    moe-fsm does not model). ``on_failure``:
    "last" raises the last candidate's refusal (a ValueError); "exhausted"
    raises the policy's exhausted error with every refusal.
    """

    alternatives: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    activation_order: ActivationOrder | None = None
    unordered_without_activation: tuple[str, ...] = ()
    forced: Mapping[str, tuple[str, tuple[str, ...]]] = field(default_factory=lambda: MappingProxyType({}))
    lora_kernels: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    refusals: Mapping[str, tuple[str, str]] = field(default_factory=lambda: MappingProxyType({}))
    on_failure: str = "last"  # "last" | "exhausted"

    def guard(self, run) -> bool:
        result = run.request != AUTO
        if run.rec.enabled:
            run.record_guard(self, "explicit_request", {"requested": run.request, "source": run.request_source}, result)
        return result

    def act(self, run) -> None:
        policy, name = run.policy, run.request
        if name in self.refusals:
            backend, reason = self.refusals[name]
            raise BackendUnsupportedError(policy.unsupported_message.format(backend=backend, reason=reason))
        candidates = self.alternatives.get(name)
        if candidates is None:
            where = "" if run.request_source == "backend" else f" (from {run.request_source})"
            raise BackendUnsupportedError(
                f"moe_backend='{name}' is not supported for {policy.label} MoE{where}. "
                f"Expected one of {list(self.alternatives)}."
            )
        candidates = list(candidates)
        forced = self.forced.get(name)
        if forced is not None and run.ctx.env.value(forced[0]):
            candidates = list(forced[1])
            run.rec.emit("note", text=f"{forced[0]} is on: {name} means {', '.join(candidates)}")
        elif self.activation_order is not None and not (
            name in self.unordered_without_activation and run.ctx.layer.quant.activation is None
        ):
            candidates = self.activation_order.apply(run, candidates)
        candidates = [run.batched_rewrite(b) for b in candidates]
        run.rec.emit("scan", candidates=candidates)
        if not candidates:
            raise BackendUnsupportedError(
                f"moe_backend={name!r} does not support activation={activation_key_text(run.ctx.layer.quant.activation)}"
            )
        rejected = []
        for backend in candidates:
            verdict = self._verdict(run, backend)
            if verdict.supported:
                run.select(verdict)
                return
            rejected.append(verdict)
        if self.on_failure == "exhausted":
            raise policy.exhausted_error(policy.exhausted_message + reasons(rejected))
        last = rejected[-1]
        raise BackendUnsupportedError(policy.unsupported_message.format(backend=last.backend, reason=last.reason))

    def _verdict(self, run, backend: str):
        first = self.lora_kernels.get(backend, ()) if run.ctx.layer.lora else ()
        if not first:
            return run.verdict(backend)
        return run.verdict(backend, kernels=(*first, *run.registry.spec(run.policy.family, backend).kernels))

    def guard_text(self) -> str:
        return "backend requested for the family is not auto"


@dataclass(frozen=True)
class PlatformGate(Step):
    """The oracle refuses the platform before anything else (vLLM 0.33 W4A8-INT8: CPU only).

    The guard holds when a requirement of ``needs`` fails; the step then raises
    the policy's exhausted error with ``message``.
    """

    needs: tuple["Requirement", ...] = ()
    message: str = ""

    def guard(self, run) -> bool:
        checks = list(zip(self.needs, run.outcomes(self.needs)))
        result = any(failure is not None for _, failure in checks)
        if run.rec.enabled:
            run.record_guard(self, "when", {"when": [
                {"condition": f"not: {r.description}", "holds": failure is not None,
                 "reason": failure or f"the platform meets it ({r.description})"}
                for r, failure in checks
            ]}, result)
        return result

    def act(self, run) -> None:
        raise run.policy.exhausted_error(self.message)

    def guard_text(self) -> str:
        return "not " + " and ".join(r.description for r in self.needs)

