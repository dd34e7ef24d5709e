"""The public backend registry: ask any backend's verdict for any input, under one profile.

Built-in kernels and backends are a policy profile's data
(``moe_fsm.profiles.<name>``); a registry serves one profile. Third-party backends
register through the ``moe_fsm.backends`` entry-point group: each entry point
names a callable that receives the registry and calls ``register_kernel`` /
``register_backend`` (the out-of-tree registration vLLM's FP8 oracle leaves
as a TODO). Registered backends are accepted by explicit choice and, when
``auto_select`` is set, tried after the built-ins in the auto scan.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from moe_fsm.backends.specs import LAYER_ACTIVATION, BackendSpec, KernelSpec
from moe_fsm.backends.verdict import BackendVerdict, SupportContext, Verdict
from moe_fsm.errors import InputError
from moe_fsm.inputs.quant import QuantFamily

if TYPE_CHECKING:
    from moe_fsm.profiles.profile import Profile

ENTRY_POINT_GROUP = "moe_fsm.backends"
_OUTCOMES = "requirement outcomes"  # a context memo's entry: requirement memo_key -> failure text or None
_CONTEXT = "context"  # a context memo's entry: the context it was made for
_UNKNOWN = object()


@dataclass
class Registry:
    profile: "Profile"
    kernels: dict[str, KernelSpec] = field(default_factory=dict)
    backends: dict[QuantFamily, dict[str, BackendSpec]] = field(default_factory=dict)
    extension_names: dict[QuantFamily, dict[str, str]] = field(default_factory=dict)
    builtin: frozenset[tuple[QuantFamily, str]] = frozenset()
    _verdicts: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def builtin_only(cls, profile: "Profile | str | None" = None) -> "Registry":
        """The profile's own kernels and backends (default: the seeds profile), no plugins."""
        from moe_fsm import profiles

        if not isinstance(profile, profiles.Profile):
            profile = profiles.get(profile or profiles.SEEDS)
        backends = {fam: dict(policy.backends) for fam, policy in profile.policies.items()}
        return cls(
            profile=profile,
            kernels=dict(profile.kernels),
            backends=backends,
            extension_names={fam: {} for fam in profile.policies},
            builtin=frozenset((fam, name) for fam, specs in backends.items() for name in specs),
        )

    def register_kernel(self, spec: KernelSpec) -> None:
        existing = self.kernels.get(spec.name)
        if existing is not None and existing != spec:
            raise InputError(f"kernel {spec.name!r} is already registered with a different configuration")
        self.kernels[spec.name] = spec

    def register_backend(self, spec: BackendSpec, user_name: str) -> None:
        """Add a backend to a family; ``user_name`` is what --backend accepts for it."""
        if spec.family not in self.backends:  # a plugin's backend for a family this profile has no policy for
            return
        family_specs = self.backends[spec.family]
        if (spec.family, spec.name) in self.builtin:
            raise InputError(f"cannot register {spec.family.value} backend {spec.name!r}: the name is reserved by a built-in backend")
        if spec.name in family_specs and family_specs[spec.name] != spec:
            raise InputError(f"{spec.family.value} backend {spec.name!r} is already registered with a different configuration")
        missing = [k for k in spec.kernels if k not in self.kernels]
        if missing:
            raise InputError(f"backend {spec.name!r} names unregistered kernel(s) {missing}; register them first")
        family_specs[spec.name] = spec
        self._verdicts.clear()
        self.extension_names[spec.family][user_name] = spec.name

    def load_entry_points(self) -> list[str]:
        """Run every installed plugin's registration; returns the entry-point names loaded."""
        loaded = []
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            ep.load()(self)
            loaded.append(ep.name)
        return loaded

    def spec(self, family: QuantFamily, backend: str) -> BackendSpec:
        try:
            return self.backends[family][backend]
        except KeyError:
            raise InputError(f"{family.value} has no backend {backend!r}; known: {sorted(self.backends[family])}") from None

    def extensions(self, family: QuantFamily) -> list[BackendSpec]:
        """Plugin backends of a family, in registration order."""
        return [self.backends[family][name] for name in self.extension_names[family].values()]

    def kernel_verdict(self, kernel: str, ctx: SupportContext, extra=(), known: dict | None = None) -> Verdict:
        """A kernel class's verdict (``extra``: conditions checked before the class's own; ``known``: the
        context's outcome memo, when the caller has it at hand)."""
        spec = self.kernels[kernel]
        requirements = (*extra, *spec.requirements) if extra else spec.requirements
        return Verdict(kernel, requirements, self.outcomes(requirements, ctx, known))

    def outcomes(self, requirements, ctx: SupportContext, known: dict | None = None) -> tuple[str | None, ...]:
        """Each requirement's failure (None: it holds) in ``ctx``.

        Each distinct requirement is evaluated once per context: kernels and step
        guards share many (no LoRA, a format, a library), and an engine asks the
        same ones for every layer.
        """
        if known is None:
            known = self.known_outcomes(ctx)
        outcomes = []
        for requirement in requirements:
            key = requirement.memo_key
            outcome = known.get(key, _UNKNOWN)
            if outcome is _UNKNOWN:
                outcome = known[key] = requirement.failure(ctx)
            outcomes.append(outcome)
        return tuple(outcomes)

    def holds(self, requirements, ctx: SupportContext, known: dict | None = None) -> bool:
        """Every requirement holds in ``ctx``; stops at the first that fails (as vLLM's ``and`` does)."""
        if known is None:
            known = self.known_outcomes(ctx)
        for requirement in requirements:
            key = requirement.memo_key
            outcome = known.get(key, _UNKNOWN)
            if outcome is _UNKNOWN:
                outcome = known[key] = requirement.failure(ctx)
            if outcome is not None:
                return False
        return True

    def known_outcomes(self, ctx: SupportContext, memo: dict | None = None) -> dict:
        """The context's memo of requirement outcomes, by ``Requirement.memo_key`` (``memo``: ``ctx``'s, if at hand)."""
        if memo is None:
            memo = self.memo_for(ctx)
        known = memo.get(_OUTCOMES)
        if known is None:
            known = memo[_OUTCOMES] = {}
        return known

    def memo_for(self, ctx: SupportContext) -> dict:
        """The verdict memo of one context: verdicts are pure, and an engine asks the same ones for every layer."""
        per_ctx = self._verdicts.get(ctx)
        if per_ctx is None:
            if len(self._verdicts) >= 1024:
                self._verdicts.clear()
            per_ctx = self._verdicts[ctx] = {_CONTEXT: ctx}
        return per_ctx

    def canonical(self, ctx: SupportContext) -> SupportContext:
        """The registry's own context equal to ``ctx``: a decision that works with it finds its memo
        by identity, not by comparing every field of the layer, platform and env again on each lookup."""
        return self.memo_for(ctx)[_CONTEXT]

    def verdict(self, family: QuantFamily, backend: str, ctx: SupportContext, memo: dict | None = None) -> BackendVerdict:
        per_ctx = self.memo_for(ctx) if memo is None else memo
        key = (family, backend)
        verdict = per_ctx.get(key)
        if verdict is None:
            spec = self.spec(family, backend)
            asked = backend_context(spec, ctx, per_ctx)
            known = self.known_outcomes(asked, per_ctx if asked is ctx else None)
            verdict = per_ctx[key] = BackendVerdict(
                backend, tuple([self.kernel_verdict(k, asked, spec.extra, known) for k in spec.kernels]))
        return verdict

    def step_verdict(self, family: QuantFamily, backend: str, ctx: SupportContext,
                     kernels: tuple[str, ...] | None, extra: tuple = ()) -> BackendVerdict:
        """A backend's verdict with a step's own kernel classes and extra conditions (not memoized)."""
        spec = self.spec(family, backend)
        asked = backend_context(spec, ctx, self.memo_for(ctx))
        return BackendVerdict(backend, tuple([self.kernel_verdict(k, asked, (*spec.extra, *extra))
                                              for k in (kernels if kernels is not None else spec.kernels)]))

    def fallback_verdicts(self, ctx: SupportContext) -> BackendVerdict:
        """What moe-fsm runs for a layer the oracle leaves to the platform (FP8 NONE); memoized like verdicts."""
        per_ctx = self.memo_for(ctx)
        if "NONE" not in per_ctx:
            kernels = self.profile.fallback_kernels.get(ctx.platform.vendor, ())
            known = self.known_outcomes(ctx, per_ctx)
            per_ctx["NONE"] = BackendVerdict("NONE", tuple([self.kernel_verdict(k, ctx, (), known) for k in kernels]))
        return per_ctx["NONE"]

    def implementation(self, kernel: str):
        """Import the experts class behind a kernel; None when moe-fsm only models it."""
        impl = self.kernels[kernel].impl
        if impl is None:
            return None
        module, _, attr = impl.partition(":")
        return getattr(importlib.import_module(module), attr)


def backend_context(spec: BackendSpec, ctx: SupportContext, memo: dict) -> SupportContext:
    """The context a backend's kernels are asked about: the layer's, with the backend's own activation key if it has one.

    ``memo`` is ``ctx``'s verdict memo: backends that share an activation key share the derived context,
    and with it the derived context's own memo.
    """
    key = spec.activation_key
    if key is LAYER_ACTIVATION or key == ctx.layer.quant.activation:
        return ctx
    derived = memo.get(("activation key", key))
    if derived is None:
        quant = replace(ctx.layer.quant, activation=key)
        derived = memo[("activation key", key)] = replace(ctx, layer=replace(ctx.layer, quant=quant))
    return derived


_DEFAULTS: dict[str, Registry] = {}


def default_registry(profile: str | None = None) -> Registry:
    """A profile's built-ins plus installed plugins, loaded once per process (default: the default profile)."""
    from moe_fsm import profiles

    name = profile or profiles.resolve_default().name
    registry = _DEFAULTS.get(name)
    if registry is None or registry.profile is not profiles.get(name):
        registry = Registry.builtin_only(name)
        registry.load_entry_points()
        _DEFAULTS[name] = registry
    return registry
