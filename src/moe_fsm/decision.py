"""The public entry point: decide a layer's backend, get a trace, build the kernel.

``select`` is what an engine calls once per MoE layer at model load. It runs
the state machine on frozen inputs and returns a ``Decision`` (outcome + trace)
or raises one of the documented selection errors, carrying the trace, after
writing it where asked. ``Decision.build`` is the terminal state's side effect:
it instantiates the experts and prepare/finalize objects as one modular kernel.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Union

from moe_fsm import profiles
from moe_fsm.backends.registry import Registry, default_registry
from moe_fsm.backends.verdict import SupportContext
from moe_fsm.errors import BackendUnavailableError, InputError, SelectionError
from moe_fsm.fsm.decide import DecisionRun
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import PlatformFacts, probe
from moe_fsm.inputs.request import BackendRequest
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.profiles import ProfileChoice
from moe_fsm.trace import document as trace_doc
from moe_fsm.trace.recorder import Recorder


@dataclass(frozen=True)
class DecisionInputs:
    """Everything a decision depends on; hashable, so engines can cache decisions by it."""

    layer: MoELayer
    parallel: ParallelConfig
    request: BackendRequest
    env: EnvSnapshot
    platform: PlatformFacts
    profile: ProfileChoice = field(default_factory=profiles.resolve_default)

    def to_json(self) -> dict:
        return {
            "profile": self.profile.to_json(),
            "layer": self.layer.to_json(),
            "parallel": self.parallel.to_json(),
            "request": self.request.to_json(),
            "env": self.env.to_json(),
            "platform": self.platform.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict) -> "DecisionInputs":
        return cls(
            layer=MoELayer.from_json(data["layer"]),
            parallel=ParallelConfig.from_json(data["parallel"]),
            request=BackendRequest.from_json(data["request"]),
            env=EnvSnapshot.from_json(data["env"]),
            platform=PlatformFacts.from_json(data["platform"]),
            profile=ProfileChoice.from_json(data["profile"]) if "profile" in data else PRE_PROFILE_TRACES,
        )


PRE_PROFILE_TRACES = ProfileChoice(profiles.SEEDS, "recorded before moe-fsm had policy profiles: the seed snapshot")


@dataclass(frozen=True)
class Decision:
    inputs: DecisionInputs
    status: str  # selected | fallback_none
    backend: str
    kernel: str | None
    via: str
    activation_format: ActivationFormat
    prepare_finalize: object
    trace: dict

    @property
    def outcome(self) -> dict:
        return self.trace["outcome"]

    def build(self, registry: Registry | None = None):
        """Instantiate the experts and prepare/finalize pair as one modular kernel."""
        from moe_fsm.modular.kernel import ModularKernel
        from moe_fsm.prepare_finalize.choice import build_prepare_finalize

        registry = registry or default_registry()
        if self.kernel is None:
            raise BackendUnavailableError(
                f"backend {self.backend} leaves this layer to the {self.inputs.platform.vendor.value} platform's own MoE "
                "path; moe-fsm has no kernel to build for it"
            )
        experts_cls = registry.implementation(self.kernel)
        if experts_cls is None:
            note = registry.kernels[self.kernel].library_note
            raise BackendUnavailableError(
                f"backend {self.backend} selects {self.kernel}, which moe-fsm models for selection but cannot run"
                + (f" (it is {note})" if note else " (it is vLLM's own compiled kernel)")
            )
        experts = experts_cls(self.inputs.layer)
        prepare_finalize = build_prepare_finalize(
            self.prepare_finalize, self.inputs.parallel, num_experts=self.inputs.layer.num_experts,
            quant=self.inputs.layer.quant,
        )
        return ModularKernel(prepare_finalize, experts, self.inputs.layer)


@lru_cache(maxsize=1)
def probed_platform() -> PlatformFacts:
    return probe()


def make_inputs(
    layer: MoELayer,
    parallel: ParallelConfig | None = None,
    backend: Union[str, Mapping[str, str], BackendRequest, None] = None,
    env: Union[EnvSnapshot, Mapping[str, str], None] = None,
    platform: PlatformFacts | None = None,
    policy: str | ProfileChoice | None = None,
) -> DecisionInputs:
    """Fill the defaults an engine would: the process env, the probed platform, the default profile."""
    if env is None:
        env = EnvSnapshot.from_process()
    elif not isinstance(env, EnvSnapshot):
        env = EnvSnapshot.from_mapping(env)
    return DecisionInputs(
        layer=layer,
        parallel=parallel or ParallelConfig(),
        request=BackendRequest.parse(backend),
        env=env,
        platform=platform or probed_platform(),
        profile=profiles.choose(policy),
    )


def decide(inputs: DecisionInputs, *, registry: Registry | None = None, trace: bool = True,
           layer_name: str | None = None, trace_path: Union[str, Path, None] = None) -> Decision:
    """Run the machine; on failure write the trace (if ``trace_path``) and raise with it attached."""
    profile = profiles.get(inputs.profile.name)
    if registry is None:
        registry = default_registry(profile.name)
    elif registry.profile is not profile:
        raise InputError(f"the registry serves profile {registry.profile.name!r}, the inputs ask for {profile.name!r}")
    started_at, t0 = time.time(), time.perf_counter()
    family = inputs.layer.family
    policy = profile.policy(family)
    fmt = ActivationFormat.BATCHED if inputs.parallel.batched_activation_format else ActivationFormat.STANDARD
    ctx = SupportContext(inputs.layer, inputs.parallel, inputs.platform, profile.env.reader(inputs.env), fmt)
    recorder = Recorder(enabled=trace)
    run = DecisionRun(ctx, policy, inputs.request.for_family(family), inputs.request.source_for(family), registry, recorder)
    run.run()
    if run.error is not None:
        outcome = {
            "status": "failed",
            "error": {
                "type": type(run.error).__name__,
                "builtin": next(b.__name__ for b in type(run.error).__mro__ if b in (ValueError, NotImplementedError)),
                "message": run.error.message,
            },
            "activation_format": fmt.value,
        }
    else:
        sel = run.selection
        outcome = {
            "status": sel.status,
            "backend": sel.backend,
            "kernel": sel.kernel,
            "via": sel.via,
            "activation_format": fmt.value,
            "prepare_finalize": run.prepare_finalize.to_json(),
            "runnable": sel.kernel is not None and registry.kernels[sel.kernel].impl is not None,
        }
    document = trace_doc.build_document(
        inputs=inputs.to_json(), family=family.value, path=run.path, events=recorder.events, outcome=outcome,
        layer_name=layer_name, started_at=started_at, duration_us=(time.perf_counter() - t0) * 1e6,
    )
    if run.error is not None:
        run.error.trace = document
        if trace_path is not None:
            run.error.trace_path = str(trace_doc.write_atomic(Path(trace_path), trace_doc.dumps(document)))
        raise run.error
    if trace_path is not None:
        trace_doc.write_atomic(Path(trace_path), trace_doc.dumps(document))
    return Decision(inputs, sel.status, sel.backend, sel.kernel, sel.via, fmt, run.prepare_finalize, document)


def select(layer: MoELayer, parallel: ParallelConfig | None = None, backend=None, env=None,
           platform: PlatformFacts | None = None, policy: str | ProfileChoice | None = None, **kwargs) -> Decision:
    """The one-call form: ``select(layer, parallel, backend="auto", env=os.environ, platform=probe(), policy=None)``.

    ``policy``: a profile name (``"seeds"``, ``"vllm-0.33"``); None follows the installed vLLM.
    """
    return decide(make_inputs(layer, parallel, backend, env, platform, policy), **kwargs)


def replay(document: dict, *, registry: Registry | None = None) -> dict:
    """Decide again from a trace's recorded inputs; returns the new canonical document."""
    inputs = DecisionInputs.from_json(document["inputs"])
    try:
        new = decide(inputs, registry=registry, layer_name=document.get("layer_name")).trace
    except SelectionError as err:
        new = err.trace
    return trace_doc.canonical(new)
