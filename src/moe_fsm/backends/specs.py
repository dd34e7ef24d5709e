"""The two kinds of catalog entry a policy profile is made of: kernel classes and backends."""

from __future__ import annotations

from dataclasses import dataclass

from moe_fsm.backends.requirements import Requirement
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.quant import QuantFamily


@dataclass(frozen=True)
class KernelSpec:
    """One experts class: its requirements in vLLM's check order, and our implementation if any."""

    name: str
    activation_format: ActivationFormat
    requirements: tuple[Requirement, ...]
    impl: str | None = None
    library_note: str = ""


@dataclass(frozen=True)
class BackendSpec:
    """A user-visible backend of one family: kernel classes in preference order, plus
    backend-level conditions some oracles add on top of the kernels' own."""

    name: str
    family: QuantFamily
    kernels: tuple[str, ...]
    extra: tuple[Requirement, ...] = ()
    auto_select: bool = True


def backends(family: QuantFamily, *specs: tuple) -> dict[str, BackendSpec]:
    """A family's backends from ``(name, [kernel, ...])`` or ``(name, [kernel, ...], [requirement, ...])`` rows."""
    out = {}
    for name, kernels, *extra in specs:
        out[name] = BackendSpec(name, family, tuple(kernels), tuple(extra[0]) if extra else ())
    return out
