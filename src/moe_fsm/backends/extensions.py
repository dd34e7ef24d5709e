"""moe-fsm's own extension backend, registered through the plugin entry point like any third party's.

TORCH_GROUPED_MM runs the experts as two ``torch._grouped_mm`` calls (bf16) or
``torch._scaled_grouped_mm`` calls (row-wise FP8). It is not in vLLM's lists,
so it is opt-in (``--backend torch_grouped_mm``) and never auto-selected; its
verdict says why it is or is not eligible.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_fsm.backends.grouped_mm_eligibility import MIN_TORCH, grouped_mm_eligibility
from moe_fsm.backends.requirements import Format, Requirement
from moe_fsm.backends.specs import BackendSpec, KernelSpec
from moe_fsm.inputs.platform import Library, Vendor
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.inputs.formats import ActivationFormat

USER_NAME = "torch_grouped_mm"


@dataclass(frozen=True)
class GroupedMMEligible(Requirement):
    """The grouped-GEMM experts' own eligibility rule, on the recorded platform facts.

    The op's presence (a platform fact) stands for the torch version: torch._grouped_mm
    arrived in 2.8, so an importable op is judged as torch 2.8 (the 10.x FP8 path, which
    needs 2.9, is refused conservatively rather than read from the live torch, which
    would make the verdict depend on the machine replaying it).
    """

    def describe(self) -> str:
        return "torch grouped-GEMM eligibility: CUDA 9.0+, bf16 or row-wise FP8, torch._grouped_mm present"

    def failure(self, ctx) -> str | None:
        if ctx.platform.vendor is not Vendor.CUDA:
            return f"needs a cuda device, this is {ctx.platform.describe()}"
        if not ctx.platform.has(Library.TORCH_GROUPED_MM):
            return "torch._grouped_mm is not in this torch (it arrived in torch 2.8)"
        ok, reason = grouped_mm_eligibility(ctx.layer, ctx.platform.capability, ".".join(map(str, MIN_TORCH)))
        return None if ok else reason


GROUPED_MM_KERNEL = KernelSpec(
    "GroupedMMExperts", ActivationFormat.STANDARD, (GroupedMMEligible(), Format(ActivationFormat.STANDARD)),
    impl="moe_fsm.experts.grouped_mm_experts:GroupedMMExperts",
)


def register_torch_grouped_mm(registry) -> None:
    """Entry point ``moe_fsm.backends: torch_grouped_mm``."""
    registry.register_kernel(GROUPED_MM_KERNEL)
    for family in (QuantFamily.UNQUANTIZED, QuantFamily.FP8):
        registry.register_backend(
            BackendSpec("TORCH_GROUPED_MM", family, ("GroupedMMExperts",), auto_select=False), USER_NAME
        )
