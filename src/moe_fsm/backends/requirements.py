"""The small predicates kernel support is made of.

Each requirement is a frozen value that says in words what it asks
(``describe``) and, evaluated on a SupportContext, returns None or the reason it
fails. Kernel specs in ``catalog.py`` are lists of these, so support conditions
read as data and every rejection explains itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

from moe_fsm.backends.verdict import SupportContext
from moe_fsm.inputs.layer import Activation
from moe_fsm.inputs.platform import Library, Vendor
from moe_fsm.inputs.quant import QuantKey, keys_text
from moe_fsm.inputs.formats import ActivationFormat


_MEMO_KEYS: dict["Requirement", int] = {}


class Requirement:
    def describe(self) -> str:
        raise NotImplementedError

    @cached_property
    def description(self) -> str:
        """``describe()`` computed once: requirements are immutable."""
        return self.describe()

    @cached_property
    def memo_key(self) -> int:
        """One number per distinct requirement value, shared by equal instances.

        Catalogs repeat the same condition in many kernels (a vendor, a library,
        no LoRA); keyed by value rather than identity, a decision evaluates each
        distinct condition once per context. Requirements are pure functions of
        their fields and the context, so equal ones give equal answers.
        """
        return _MEMO_KEYS.setdefault(self, len(_MEMO_KEYS))

    def failure(self, ctx: SupportContext) -> str | None:
        raise NotImplementedError


@dataclass(frozen=True)
class OnVendor(Requirement):
    vendors: tuple[Vendor, ...]

    def describe(self) -> str:
        return "runs on " + " or ".join(v.value for v in self.vendors)

    def failure(self, ctx: SupportContext) -> str | None:
        if ctx.platform.vendor in self.vendors:
            return None
        return f"needs a {self._names} device, this is {ctx.platform.describe()}"

    @cached_property
    def _names(self) -> str:
        return " or ".join(v.value for v in self.vendors)


@dataclass(frozen=True)
class CudaCapability(Requirement):
    """A CUDA capability rule: ``exact`` (9,0) pairs, ``families`` majors, or ``minimum``.

    Non-CUDA vendors listed in ``also`` pass without a capability (ROCm for Triton).
    """

    exact: tuple[tuple[int, int], ...] = ()
    families: tuple[int, ...] = ()
    minimum: tuple[int, int] | None = None
    also: tuple[Vendor, ...] = ()

    @cached_property
    def _wanted(self) -> str:
        parts = [f"{a}.{b}" for a, b in self.exact] + [f"{m}.x" for m in self.families]
        if self.minimum:
            parts.append(f"{self.minimum[0]}.{self.minimum[1]} or newer")
        return " or ".join(parts)

    def describe(self) -> str:
        extra = "".join(f" (or {v.value})" for v in self.also)
        return f"CUDA compute capability {self._wanted}{extra}"

    @cached_property
    def _devices(self) -> str:
        return " or ".join(["cuda"] + [v.value for v in self.also])

    def failure(self, ctx: SupportContext) -> str | None:
        p = ctx.platform
        if p.vendor in self.also:
            return None
        if p.vendor is not Vendor.CUDA:
            return f"needs a {self._devices} device, this is {p.describe()}"
        capability = p.capability
        if (capability in self.exact or capability[0] in self.families
                or (self.minimum is not None and capability >= self.minimum)):
            return None
        return f"needs compute capability {self._wanted}, this is {p.capability_text()}"


@dataclass(frozen=True)
class Importable(Requirement):
    library: Library

    def describe(self) -> str:
        return f"{self.library.value} importable"

    def failure(self, ctx: SupportContext) -> str | None:
        if self.library in ctx.platform.libraries:
            return None
        return self._missing

    @cached_property
    def _missing(self) -> str:
        return f"{self.library.value} is not installed (not importable on this platform)"


Scheme = tuple[QuantKey | None, QuantKey | None]


@dataclass(frozen=True)
class QuantSchemes(Requirement):
    """Accepted (weight, activation) key pairs; ``fp8_needs_device`` gates FP8 pairs on FP8 hardware.

    ``weight_only`` accepts any activation key (Marlin dequantizes weights and runs 16-bit).
    ``gated`` adds pairs that hold only on some platforms: (condition text, predicate, pairs).
    """

    pairs: tuple[Scheme, ...]
    weight_only: bool = False
    gated: tuple[tuple[str, Callable[[SupportContext], bool], tuple[Scheme, ...]], ...] = ()

    def describe(self) -> str:
        text = ", ".join(_scheme_text(p) for p in self.pairs)
        for cond, _, pairs in self.gated:
            text += f"; {cond}: " + ", ".join(_scheme_text(p) for p in pairs)
        return ("weight-only " if self.weight_only else "") + "quantization schemes " + text

    def failure(self, ctx: SupportContext) -> str | None:
        quant = ctx.layer.quant
        key = quant.weight if self.weight_only else quant.keys  # weight-only: any activation key
        accepted = self._accepted
        if key in accepted[0]:
            return None
        for (_, condition, _), gated in zip(self.gated, accepted[1:]):
            if key in gated and condition(ctx):
                return None
        return f"kernel does not support quantization scheme {quant.keys_text}"

    @cached_property
    def _accepted(self) -> tuple[frozenset, ...]:
        """The always-accepted keys, then each gated group's, as sets (weights only when weight_only)."""
        def keys(pairs):
            return frozenset(w for w, _ in pairs) if self.weight_only else frozenset(pairs)
        return (keys(self.pairs), *(keys(pairs) for _, _, pairs in self.gated))


def _scheme_text(pair: Scheme) -> str:
    return keys_text(*pair)


@dataclass(frozen=True)
class Activations(Requirement):
    allowed: tuple[Activation, ...]

    def describe(self) -> str:
        return "activations " + ", ".join(a.value for a in self.allowed)

    def failure(self, ctx: SupportContext) -> str | None:
        if ctx.layer.activation in self.allowed:
            return None
        return f"kernel does not support {ctx.layer.activation.value} activation"


@dataclass(frozen=True)
class InputDtypes(Requirement):
    dtypes: tuple[str, ...]

    def describe(self) -> str:
        return "input dtype " + " or ".join(self.dtypes)

    def failure(self, ctx: SupportContext) -> str | None:
        if ctx.layer.dtype in self.dtypes:
            return None
        return f"kernel does not support {ctx.layer.dtype} input/output dtype"


@dataclass(frozen=True)
class Format(Requirement):
    activation_format: ActivationFormat

    def describe(self) -> str:
        return f"{self.activation_format.value} activation format"

    def failure(self, ctx: SupportContext) -> str | None:
        if ctx.activation_format is self.activation_format:
            return None
        return f"kernel does not support {ctx.activation_format.value} activation format"


@dataclass(frozen=True)
class NoLoRA(Requirement):
    def describe(self) -> str:
        return "no LoRA"

    def failure(self, ctx: SupportContext) -> str | None:
        return "kernel does not support LoRA" if ctx.layer.lora else None


@dataclass(frozen=True)
class ParallelRule(Requirement):
    """A parallel-config condition, given as text plus a predicate on ParallelConfig."""

    text: str
    holds: Callable[..., bool]

    def describe(self) -> str:
        return self.text

    def failure(self, ctx: SupportContext) -> str | None:
        if self.holds(ctx.parallel):
            return None
        p = ctx.parallel
        return (
            f"kernel does not support parallel config tp={p.tp_size} dp={p.dp_size} ep={p.ep_size} "
            f"all2all={p.all2all.value} (needs {self.text})"
        )


@dataclass(frozen=True)
class MaxExperts(Requirement):
    limit: int
    why: str

    def describe(self) -> str:
        return f"fewer than {self.limit} experts ({self.why})"

    def failure(self, ctx: SupportContext) -> str | None:
        padded = -(-ctx.layer.num_experts // 32) * 32
        if padded < self.limit:
            return None
        return f"{self.why} requires fewer than {self.limit} padded experts, this layer pads to {padded}"


@dataclass(frozen=True)
class ShapeMultiple(Requirement):
    """Hidden and intermediate sizes a multiple of ``multiple`` when the layer's weights are ``weight`` keys.

    A kernel whose tiles or scale blocks cover ``multiple`` columns cannot take a
    partial one; ``why`` names where vLLM (or the library) checks it.
    """

    multiple: int
    weight: tuple[QuantKey, ...]
    why: str

    def describe(self) -> str:
        keys = ", ".join(str(k) for k in self.weight)
        return f"hidden and intermediate sizes multiples of {self.multiple} with {keys} weights ({self.why})"

    def failure(self, ctx: SupportContext) -> str | None:
        layer = ctx.layer
        if layer.quant.weight not in self.weight:
            return None
        off = [f"{name} {size}" for name, size in (("hidden_size", layer.hidden_size),
                                                     ("intermediate_size", layer.intermediate_size))
               if size % self.multiple]
        if not off:
            return None
        return f"needs sizes that are multiples of {self.multiple} ({self.why}), this layer has {' and '.join(off)}"


@dataclass(frozen=True)
class EnvEnabled(Requirement):
    """Enabled by env switches that must all read true (vLLM's AITER rule)."""

    names: tuple[str, ...]

    def describe(self) -> str:
        return " and ".join(f"{n}=1" for n in self.names)

    def failure(self, ctx: SupportContext) -> str | None:
        value = ctx.env.value
        if all(value(n) for n in self.names):
            return None
        return self._disabled

    @cached_property
    def _disabled(self) -> str:
        return f"it is not enabled — set {' and '.join(f'{n}=1' for n in self.names)} to enable it"


@dataclass(frozen=True)
class LoRAEnabled(Requirement):
    """The layer carries LoRA adapters (a step guard: the LoRA shortcut)."""

    def describe(self) -> str:
        return "LoRA enabled"

    def failure(self, ctx: SupportContext) -> str | None:
        return None if ctx.layer.lora else "LoRA is off"


@dataclass(frozen=True)
class EnvOff(Requirement):
    """Not usable while an env switch reads true (vLLM 0.33: VLLM_BATCH_INVARIANT and kernels without batch invariance)."""

    name: str
    why: str

    def describe(self) -> str:
        return f"{self.name} off ({self.why})"

    def failure(self, ctx: SupportContext) -> str | None:
        if not ctx.env.value(self.name):
            return None
        return f"kernel does not support {self.why} ({self.name} is on)"


@dataclass(frozen=True)
class Condition(Requirement):
    """Any other support condition, as text plus a predicate on the SupportContext.

    For the checks vLLM writes inline in an ``is_supported_config`` override
    (expert-count limits, dimension alignment, a SwiGLU-clamp rule), where no
    dedicated requirement kind exists; ``failure`` is the reason in vLLM's words.
    """

    text: str
    holds: Callable[..., bool]
    failure_text: str | Callable[..., str] = ""  # a callable of the context for a reason that names a value

    def describe(self) -> str:
        return self.text

    def failure(self, ctx: SupportContext) -> str | None:
        if self.holds(ctx):
            return None
        if callable(self.failure_text):
            return self.failure_text(ctx)
        return self.failure_text or f"kernel does not support this layer (needs {self.text})"
