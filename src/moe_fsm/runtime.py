"""Build what a decision chose: the runtime's first step after the decision core.

The decision core decides and says what moe-fsm can build here (``Decision.plan``);
:func:`build` follows that plan, instantiating the experts and the
prepare/finalize and joining them as one modular kernel. Importing this module
needs no torch; building does (torch and Triton are imported from here on).
"""

from __future__ import annotations

from moe_fsm.backends.registry import Registry, default_registry
from moe_fsm.decision import Decision
from moe_fsm.errors import BackendUnavailableError


def build(decision: Decision, registry: Registry | None = None):
    """The decision's experts and prepare/finalize pair as one modular kernel.

    ``registry``: the one the decision was made with (default: its profile's);
    ``BackendUnavailableError`` with the plan's reason when moe-fsm cannot run the decided kernel here.
    """
    from moe_fsm.modular.kernel import ModularKernel
    from moe_fsm.prepare_finalize.choice import build_prepare_finalize

    registry = registry or default_registry(decision.inputs.profile.name)
    if decision.plan.experts is None:
        raise BackendUnavailableError(decision.plan.because)
    experts = registry.implementation(decision.plan.experts)(decision.inputs.layer)
    prepare_finalize = build_prepare_finalize(
        decision.prepare_finalize, decision.inputs.parallel, num_experts=decision.inputs.layer.num_experts,
        quant=decision.inputs.layer.quant,
    )
    return ModularKernel(prepare_finalize, experts, decision.inputs.layer)
