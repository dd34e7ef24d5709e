"""What moe-fsm's runtime can build for a decision, judged apart from the decision.

A decision is vLLM's (for the profile): the backend, its experts class and the
prepare/finalize. Whether moe-fsm can run that here is a separate verdict,
made from data alone (no torch): the experts class itself where moe-fsm
implements it (``KernelSpec.impl``), a named substitute computing the same
numerics (the profile's ``substitutes``, or its ``fallback_kernels`` where
the oracle leaves the layer to the platform), or nothing, with the reason; and
whether the chosen prepare/finalize can be built here. The trace records it
under ``build``; ``Decision.build()`` follows it.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_fsm.backends.pf_choice import PrepareFinalizeChoice
from moe_fsm.inputs.hashing import computed_once

NATIVE, SUBSTITUTE, UNAVAILABLE = "native", "substitute", "unavailable"


@dataclass(frozen=True)
class BuildPlan:
    experts: str | None  # the kernel spec moe-fsm instantiates (None: none)
    how: str  # native | substitute | unavailable
    because: str
    prepare_finalize_buildable: bool
    prepare_finalize_because: str | None

    @property
    def runnable(self) -> bool:
        return self.experts is not None and self.prepare_finalize_buildable

    @computed_once
    def to_json(self) -> dict:
        """The trace's ``build`` part (plans are memoized with the verdicts)."""
        return {
            "experts": self.experts,
            "how": self.how,
            "because": self.because,
            "prepare_finalize_buildable": self.prepare_finalize_buildable,
            "prepare_finalize_because": self.prepare_finalize_because,
            "runnable": self.runnable,
        }


def plan_build(registry, backend: str, kernel: str | None, ctx, choice: PrepareFinalizeChoice) -> BuildPlan:
    """The runtime's verdict on a decided (backend, kernel, prepare/finalize); pure, so memoized with the verdicts."""
    memo = registry.memo_for(ctx)
    key = ("build", backend, kernel, choice)
    plan = memo.get(key)
    if plan is None:
        experts, how, because = _experts(registry, backend, kernel, ctx)
        plan = memo[key] = BuildPlan(experts, how, because, choice.buildable, choice.not_buildable_because)
    return plan


def _experts(registry, backend: str, kernel: str | None, ctx) -> tuple[str | None, str, str]:
    if kernel is None:
        vendor = ctx.platform.vendor.value
        fallback = registry.fallback_verdicts(ctx)
        if fallback.kernel is not None:
            return fallback.kernel, SUBSTITUTE, (
                f"backend {backend} leaves the layer to the {vendor} platform's own MoE path; moe-fsm runs it "
                f"with {fallback.kernel}")
        return None, UNAVAILABLE, (
            f"backend {backend} leaves this layer to the {vendor} platform's own MoE path; moe-fsm has no kernel "
            "to build for it")
    spec = registry.kernels[kernel]
    if spec.impl is not None:
        return kernel, NATIVE, f"moe-fsm implements {kernel}"
    substitute = registry.profile.substitutes.get(kernel)
    if substitute is not None:
        verdict = registry.kernel_verdict(substitute, ctx)
        if verdict.supported:
            return substitute, SUBSTITUTE, f"moe-fsm runs {kernel}'s numerics with {substitute}"
        return None, UNAVAILABLE, (
            f"backend {backend} selects {kernel}; its substitute {substitute} cannot run this layer: {verdict.reason}")
    return None, UNAVAILABLE, (
        f"backend {backend} selects {kernel}, which moe-fsm models for selection but cannot run"
        + (f" (it is {spec.library_note})" if spec.library_note else " (it is vLLM's own compiled kernel)"))
