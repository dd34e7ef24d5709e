"""Build what a decision chose: the runtime's first step after the decision core.

The decision core decides and says what moe-fsm can build here (``Decision.plan``);
:func:`build` follows that plan, instantiating the experts and the
prepare/finalize and joining them as one modular kernel. Importing this module
needs no torch; building does (torch and Triton are imported from here on).
"""

from __future__ import annotations

import importlib
import re

from moe_fsm.backends.build_plan import SUBSTITUTE
from moe_fsm.backends.registry import Registry, default_registry
from moe_fsm.decision import Decision
from moe_fsm.errors import BackendUnavailableError, InputError, KernelInputError


def build(decision: Decision, registry: Registry | None = None, *, strict: bool = False, device: str | None = None,
          max_tokens_per_rank: int | None = None):
    """The decision's experts and prepare/finalize pair as one modular kernel.

    ``registry``: the one the decision was made with (default: its profile's). Where moe-fsm cannot load
    the decided experts kernel, its own implementation refuses the layer, or the kernel needs a device this
    run lacks (``device``: where the run computes, one of ``DEVICES``), a stand-in of
    the same numerics runs instead (``backends.stand_ins``), named by the kernel's ``stand_in``; ``strict``
    refuses stand-ins and the profile's substitutes alike with ``BackendUnavailableError`` (the plan's reason):
    a strict build is the decided kernel itself or nothing. ``max_tokens_per_rank`` (``check_max_tokens_per_rank``):
    the most tokens any rank passes in one call, the same on every rank; the all-to-all prepare/finalize then sends
    fixed blocks and never reads the device on the host, so an expert-parallel layer can be captured in a CUDA
    graph. The decision never changes.
    """
    from moe_fsm.modular.kernel import ModularKernel
    from moe_fsm.prepare_finalize.choice import build_prepare_finalize

    if not isinstance(decision, Decision):
        raise InputError(f"build takes the Decision that select() or decide() returned, got {type(decision).__name__}")
    if not isinstance(strict, bool):
        raise InputError(f"strict must be True or False, got {strict!r}")
    device = device_type(device)
    check_max_tokens_per_rank(max_tokens_per_rank)
    plan = decision.plan
    if not plan.prepare_finalize_buildable:
        raise BackendUnavailableError(plan.prepare_finalize_because or plan.because)
    experts, stand_in, layer = build_experts(decision, registry, strict=strict, device=device)
    prepare_finalize = build_prepare_finalize(
        decision.prepare_finalize, decision.inputs.parallel, num_experts=layer.num_experts, quant=layer.quant,
        max_tokens_per_rank=max_tokens_per_rank,
    )
    kernel = ModularKernel(prepare_finalize, experts, layer)
    kernel.stand_in = stand_in
    return kernel


def build_experts(decision: Decision, registry: Registry | None = None, *, strict: bool = False,
                  device: str | None = None):
    """``(experts, stand_in, layer)``: the experts kernel ``build`` joins to the prepare/finalize, the stand-in
    running in place of the decided kernel (None: the decided kernel or the profile's substitute itself), and the
    layer the experts compute (a weight-only kernel's stand-in takes 16-bit activations). ``build``'s rules without
    the prepare/finalize, which ``moe-fsm tune`` asks which kernel a layer runs on."""
    from moe_fsm.backends import stand_ins

    if not isinstance(decision, Decision):
        raise InputError(f"build takes the Decision that select() or decide() returned, got {type(decision).__name__}")
    if not isinstance(strict, bool):
        raise InputError(f"strict must be True or False, got {strict!r}")
    device = device_type(device)
    registry = registry or default_registry(decision.inputs.profile.name)
    plan, layer = decision.plan, decision.inputs.layer
    if strict and plan.how == SUBSTITUTE:
        decided = decision.kernel or f"{decision.backend} (the platform's own MoE path)"
        raise BackendUnavailableError(
            f"{plan.because}: a strict build runs only the decided {decided}, and refuses the substitute {plan.experts}")
    impl = registry.kernels[plan.experts].impl if plan.experts is not None else None
    decided = registry.kernels.get(decision.kernel) if decision.kernel is not None else None
    weight_only = decided is not None and decided.weight_only  # a stand-in computes as the decided kernel does
    stand_in = None
    if impl is None:
        stand_in = stand_ins.choose(layer, decision.activation_format, device,
                                    decision.kernel or f"{decision.backend} (the platform's own MoE path)", plan.because,
                                    weight_only)
    elif device != "cuda" and stand_ins.cuda_only(impl):
        stand_in = stand_ins.choose(layer, decision.activation_format, device, plan.experts,
                                    f"{plan.experts} runs on CUDA; this run is on {device}", weight_only)
    if stand_in is not None:
        if strict:
            raise BackendUnavailableError(f"{stand_in.because} (a strict build refuses the stand-in {stand_in.label})")
    else:
        try:
            experts = registry.implementation(plan.experts)(layer)
        except (KernelInputError, BackendUnavailableError) as err:
            # moe-fsm's implementation of the decided kernel does not take this layer (e.g. its FlashInfer
            # adapter and NVFP4 weights): a stand-in of the same numerics runs it, unless the build is strict
            if strict:
                raise
            stand_in = stand_ins.choose(layer, decision.activation_format, device, plan.experts, str(err), weight_only)
    if stand_in is not None:
        layer = stand_ins.computed_layer(layer, stand_in.weight_only)  # the decided kernel's numerics
        module, _, attr = stand_in.impl.partition(":")
        experts = getattr(importlib.import_module(module), attr)(layer)
    return experts, stand_in, layer


def check_max_tokens_per_rank(value) -> None:
    """``max_tokens_per_rank`` is None or a positive integer (what ``build`` and ``Engine`` take)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InputError(f"max_tokens_per_rank must be None or a positive integer (the most tokens any rank passes in "
                         f"one call), got {value!r}")


DEVICES = ("None (CUDA when torch sees it, else the CPU), a device name torch reads ('cpu', 'cuda', 'cuda:N', 'mps', "
           "...) or a torch.device")


def device_type(device) -> str:
    """The run's device type ("cpu", "cuda", "mps", ...) from what ``build(device=...)`` accepts (``DEVICES``).

    Any device torch knows is taken: where the decided kernel cannot run on it, ``build`` runs a stand-in, as
    for a CUDA kernel on the CPU; a name torch cannot read is refused."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str) and re.fullmatch(r"[a-z_]+(:\d+)?", device):
        try:
            return torch.device(device).type
        except RuntimeError:
            pass
    raise InputError(f"device must be {DEVICES}; got {device!r}")
