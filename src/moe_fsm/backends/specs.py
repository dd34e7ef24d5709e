"""The two kinds of catalog entry a policy profile is made of: kernel classes and backends."""

from __future__ import annotations

from dataclasses import dataclass

from moe_fsm.backends.requirements import QuantSchemes, Requirement
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.quant import QuantFamily, QuantKey


@dataclass(frozen=True)
class KernelSpec:
    """One experts class: its requirements in vLLM's check order, and our implementation if any."""

    name: str
    activation_format: ActivationFormat
    requirements: tuple[Requirement, ...]
    impl: str | None = None
    library_note: str = ""

    @property
    def weight_only(self) -> bool:
        """Whether the kernel computes with 16-bit activations whatever activation quantization the checkpoint
        declares (vLLM's Marlin dequantizes the weights and quantizes nothing else): its scheme check takes any
        activation key. A stand-in of the kernel computes so too (``stand_ins``)."""
        return any(isinstance(r, QuantSchemes) and r.weight_only for r in self.requirements)


class _LayerActivation:
    """The sentinel: a backend's support check uses the layer's own activation key."""

    def __repr__(self) -> str:
        return "LAYER_ACTIVATION"


LAYER_ACTIVATION = _LayerActivation()


@dataclass(frozen=True)
class BackendSpec:
    """A user-visible backend of one family: kernel classes in preference order, plus
    backend-level conditions some oracles add on top of the kernels' own.

    ``activation_key``: the activation quantization key the backend's kernels are
    asked about. By default the layer's; vLLM 0.33's MXFP4 oracle names one per
    backend variant (``FLASHINFER_TRTLLM_MXFP4_MXFP8`` is asked about MXFP8
    activations whatever the checkpoint declares; None is 16-bit).
    """

    name: str
    family: QuantFamily
    kernels: tuple[str, ...]
    extra: tuple[Requirement, ...] = ()
    auto_select: bool = True
    activation_key: QuantKey | None | _LayerActivation = LAYER_ACTIVATION


def backends(family: QuantFamily, *specs: tuple) -> dict[str, BackendSpec]:
    """A family's backends from ``(name, [kernel, ...])`` or ``(name, [kernel, ...], [requirement, ...])`` rows."""
    out = {}
    for name, kernels, *extra in specs:
        out[name] = BackendSpec(name, family, tuple(kernels), tuple(extra[0]) if extra else ())
    return out
