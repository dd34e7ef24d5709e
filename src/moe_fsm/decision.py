"""The public entry point: decide a layer's backend and get a trace.

``select`` is what an engine calls once per MoE layer at model load. It runs
the state machine on frozen inputs and returns a ``Decision`` (outcome + trace
+ what moe-fsm can build of it) or raises one of the documented selection
errors, carrying the trace, after writing it where asked. Building the kernel
is the runtime's: ``moe_fsm.runtime.build(decision)``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Union

from moe_fsm.inputs.hashing import computed_once, hashed_once
from moe_fsm import profiles
from moe_fsm.backends.build_plan import BuildPlan, plan_build
from moe_fsm.backends.pf_choice import forget_choices
from moe_fsm.backends.registry import Registry, default_registry
from moe_fsm.backends.verdict import SupportContext
from moe_fsm.errors import InputError, NoPolicyError, SelectionError, TraceWriteError
from moe_fsm.fsm.decide import DecisionRun
from moe_fsm.fsm.policy import FAILED, START
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import PlatformFacts, probed_platform
from moe_fsm.inputs.request import BackendRequest
from moe_fsm.inputs.speed import SpeedTable, speed_table_from_spec, table_for_device
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.spec import SECTIONS, env_from_spec, layer_from_spec, parallel_from_spec, platform_from_spec
from moe_fsm.profiles import ProfileChoice
from moe_fsm.trace import document as trace_doc
from moe_fsm.trace.recorder import Recorder


@hashed_once
@dataclass(frozen=True)
class DecisionInputs:
    """Everything a decision depends on; hashable, so engines can cache decisions by it."""

    layer: MoELayer
    parallel: ParallelConfig
    request: BackendRequest
    env: EnvSnapshot
    platform: PlatformFacts
    profile: ProfileChoice = field(default_factory=profiles.resolve_default)
    speed_table: SpeedTable | None = None  # measured figures, for a profile that reads them (fastest-*)

    def __post_init__(self) -> None:
        for name, cls, hint in _INPUT_TYPES:
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise InputError(f"{name} must be a {cls.__name__} ({hint}), got {type(value).__name__} {value!r:.80}")
        if self.speed_table is not None and not isinstance(self.speed_table, SpeedTable):
            raise InputError(f"speed_table must be a SpeedTable (read_speed_table(path)) or None, "
                             f"got {type(self.speed_table).__name__}")

    @computed_once
    def to_json(self) -> dict:
        """Built once per inputs object and shared by the traces of its decisions; read-only."""
        return {
            "profile": self.profile.to_json(),
            "layer": self.layer.to_json(),
            "parallel": self.parallel.to_json(),
            "request": self.request.to_json(),
            "env": self.env.to_json(),
            "platform": self.platform.to_json(),
            # recorded only where a profile reads one, so every other trace keeps its form
            **({"speed_table": self.speed_table.to_json()} if self.speed_table is not None else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> "DecisionInputs":
        """The inputs a trace recorded; InputError naming the problem when they are malformed."""
        if not isinstance(data, dict):
            raise InputError(f"recorded inputs must be an object, got {type(data).__name__}")
        try:
            return cls(
                layer=MoELayer.from_json(data["layer"]),
                parallel=ParallelConfig.from_json(data["parallel"]),
                request=BackendRequest.from_json(data["request"]),
                env=EnvSnapshot.from_json(data["env"]),
                platform=PlatformFacts.from_json(data["platform"]),
                profile=ProfileChoice.from_json(data["profile"]) if "profile" in data else PRE_PROFILE_TRACES,
                speed_table=SpeedTable.from_json(data["speed_table"]) if "speed_table" in data else None,
            )
        except InputError:
            raise
        except KeyError as err:
            raise InputError(f"recorded inputs lack {err}") from None
        except (TypeError, ValueError, AttributeError) as err:
            raise InputError(f"recorded inputs are malformed: {err}") from None


_INPUT_TYPES = (
    ("layer", MoELayer, "e.g. MoELayer(quant=QuantScheme.fp8(), num_experts=256, top_k=8)"),
    ("parallel", ParallelConfig, "e.g. ParallelConfig(dp_size=2, ep_size=2)"),
    ("request", BackendRequest, "BackendRequest.parse('auto')"),
    ("env", EnvSnapshot, "EnvSnapshot.from_mapping({...})"),
    ("platform", PlatformFacts, "preset('sm90') or probe()"),
    ("profile", ProfileChoice, "profiles.choose(name)"),
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
    plan: BuildPlan  # what moe-fsm can run here: apart from the decision

    @property
    def outcome(self) -> dict:
        return self.trace["outcome"]

    @property
    def runner(self) -> str | None:
        """The kernel spec moe-fsm will instantiate: the decided kernel, a named substitute, or None."""
        return self.plan.experts


def _profiles_with(family) -> str:
    """Where the family can be decided: the profiles that have its policy (choose one with policy= / --policy)."""
    names = sorted(name for name, p in profiles.profiles().items() if family in p.policies)
    return f"; profiles with a {family.value} policy: {', '.join(names)} (--policy / policy=)" if names else ""


@dataclass
class _PolicyLess:
    """The record of a decision that could not start: the profile has no policy for the family."""

    error: SelectionError
    selection: None = None
    resolved: dict = field(default_factory=dict)

    @property
    def path(self) -> list[str]:
        return [START, FAILED]


def make_inputs(
    layer: MoELayer,
    parallel: ParallelConfig | None = None,
    backend: Union[str, Mapping[str, str], BackendRequest, None] = None,
    env: Union[EnvSnapshot, Mapping[str, str], None] = None,
    platform: PlatformFacts | None = None,
    policy: str | ProfileChoice | None = None,
    speed_table: Union[str, os.PathLike, SpeedTable, None] = None,
) -> DecisionInputs:
    """Fill the defaults an engine would: the process env, the probed platform, the default profile.

    ``env``: None (or ``os.environ`` itself) reads the process environment and
    keeps the variables moe-fsm knows; any other mapping is what the caller
    means to set, so a name no profile reads is refused, as ``--env`` refuses
    it (a misspelt variable would otherwise silently change nothing). To pass a
    whole environment, use ``EnvSnapshot.from_mapping(mapping)``. ``speed_table``:
    a measured table (or its file) for a profile that reads one; None looks for
    this device's in the user's config directory (``inputs/speed.py``).
    """
    if not isinstance(layer, MoELayer):
        raise InputError(f"layer must be a MoELayer, got {type(layer).__name__} {layer!r:.80}")
    if parallel is not None and not isinstance(parallel, ParallelConfig):
        raise InputError(f"parallel must be a ParallelConfig or None, got {type(parallel).__name__} {parallel!r:.80}")
    if platform is not None and not isinstance(platform, PlatformFacts):
        raise InputError(
            f"platform must be a PlatformFacts (preset('sm90'), probe()) or None for this machine, "
            f"got {type(platform).__name__} {platform!r:.80}"
        )
    platform = platform or probed_platform()
    choice = profiles.choose(policy)
    return DecisionInputs(
        layer=layer,
        parallel=parallel or ParallelConfig(),
        request=BackendRequest.parse(backend),
        env=_env_snapshot(env),
        platform=platform,
        profile=choice,
        speed_table=speed_table_for(choice, platform, speed_table),
    )


def speed_table_for(choice: ProfileChoice, platform: PlatformFacts, given=None) -> SpeedTable | None:
    """The speed table a decision under ``choice`` reads: the one given (a path or a table), else (None) the one
    measured for this device in the user's config directory; False: none, without looking (golden scenarios,
    tests). None for a profile that reads none, whatever was given."""
    if not profiles.get(choice.name).reads_speed_table or given is False:
        return None
    table = speed_table_from_spec(given)
    return table if table is not None else table_for_device(platform.device_name)


def inputs_from_spec(spec: Mapping[str, Any]) -> DecisionInputs:
    """A spec mapping (the spec language of ``moe_fsm.inputs.spec``) to DecisionInputs.

    ``env`` None means the process environment; a missing ``env`` means none set.
    """
    unknown = sorted(set(spec) - set(SECTIONS))
    if unknown:
        raise InputError(f"unknown input section(s) {unknown}; accepted: {list(SECTIONS)}")
    if "backend" in spec and "request" in spec:
        raise InputError("give the backend request as 'backend' or 'request', not both")
    if "policy" in spec and "profile" in spec:
        raise InputError("give the policy profile as 'policy' (a name) or 'profile' (a trace's table), not both")
    layer = spec.get("layer")
    if not isinstance(layer, MoELayer):
        layer = layer_from_spec(layer or {})
    parallel = spec.get("parallel")
    if not isinstance(parallel, ParallelConfig):
        parallel = parallel_from_spec(parallel or {})
    request = BackendRequest.parse(spec.get("backend", spec.get("request")))
    env = env_from_spec(spec.get("env", {}))
    platform = platform_from_spec(spec.get("platform", "probe"))
    if "profile" in spec:
        choice = profiles.ProfileChoice.from_json(spec["profile"])
    else:
        policy = spec.get("policy")
        if policy is not None and not isinstance(policy, str):
            raise InputError(f"policy must be a profile name ({profiles.names()}) or 'default', got {policy!r}")
        choice = profiles.choose(policy)
    return DecisionInputs(layer=layer, parallel=parallel, request=request, env=env, platform=platform, profile=choice,
                          speed_table=speed_table_for(choice, platform, spec.get("speed_table")))


def forget_input_caches() -> None:
    """Empty the caches moe-fsm keeps per distinct input (env readers, prepare/finalize choices), so that a
    decision of new input objects is its first: what ``bench/bench_decision_cost.py`` calls "first". Registries
    keep their own verdict memos (use a new ``Registry``), input objects their derived forms (make new ones)."""
    forget_choices()
    for profile in profiles.profiles().values():
        profile.env.forget_readers()


def _env_snapshot(env) -> EnvSnapshot:
    if env is None or env is os.environ:
        return EnvSnapshot.from_process()
    if isinstance(env, EnvSnapshot):
        return env
    if not isinstance(env, Mapping):
        raise InputError(
            f"env must be a mapping of variable name to value (or an EnvSnapshot, or None for os.environ), "
            f"got {type(env).__name__} {env!r:.80}"
        )
    bad = [(k, v) for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise InputError(f"env names and values must be strings, got {bad[0][0]!r}: {bad[0][1]!r}")
    return EnvSnapshot.from_mapping(env, strict_names=True)


def decide(inputs: DecisionInputs, *, registry: Registry | None = None, trace: bool = True,
           layer_name: str | None = None, trace_path: Union[str, Path, None] = None) -> Decision:
    """Run the machine; on failure write the trace (if ``trace_path``) and raise with it attached."""
    if not isinstance(inputs, DecisionInputs):
        raise InputError(f"decide() takes DecisionInputs (see make_inputs), got {type(inputs).__name__}")
    if layer_name is not None and not isinstance(layer_name, str):
        raise InputError(f"layer_name must be a string or None, got {type(layer_name).__name__} {layer_name!r:.80}")
    if trace_path is not None and (not isinstance(trace_path, (str, os.PathLike)) or not str(trace_path).strip()
                                   or "\0" in str(trace_path)):
        raise InputError(f"trace_path must be a non-empty path (no NUL character) or None, got {trace_path!r:.80}")
    if registry is not None and not isinstance(registry, Registry):
        raise InputError(f"registry must be a Registry or None, got {type(registry).__name__}")
    profile = profiles.get(inputs.profile.name)
    if registry is None:
        registry = default_registry(profile.name)
    elif registry.profile is not profile:
        raise InputError(f"the registry serves profile {registry.profile.name!r}, the inputs ask for {profile.name!r}")
    started_at, t0 = time.time(), time.perf_counter()
    family = inputs.layer.family
    policy = profile.policies.get(family)
    request = inputs.request.for_family(family)
    batched = inputs.parallel.batched_activation_format or (policy is not None and request in policy.batched_requests)
    fmt = ActivationFormat.BATCHED if batched else ActivationFormat.STANDARD
    ctx = registry.canonical(SupportContext(inputs.layer, inputs.parallel, inputs.platform, profile.env.reader(inputs.env), fmt))
    recorder = Recorder(enabled=trace)
    if policy is None:
        run = _PolicyLess(NoPolicyError(
            f"no selection policy for family {family.value} in profile {profile.name}; "
            f"it has policies for {sorted(f.value for f in profile.policies)}"
            + _profiles_with(family)
        ))
    else:
        run = DecisionRun(ctx, policy, request, inputs.request.source_for(family), registry, recorder,
                          inputs.speed_table)
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
        plan = None
    else:
        sel = run.selection
        ctx, fmt = run.ctx, run.ctx.activation_format  # a step may have checked its candidates in another format
        outcome = {
            "status": sel.status,
            "backend": sel.backend,
            "kernel": sel.kernel,
            "via": sel.via,
            "activation_format": fmt.value,
            "prepare_finalize": run.prepare_finalize.to_json(),
        }
        plan = plan_build(registry, sel.backend, sel.kernel, ctx, run.prepare_finalize)
    if run.resolved:  # the server arguments an engine's pipeline resolved on the way (SGLang's profiles)
        outcome["resolved"] = dict(run.resolved)
    document = trace_doc.build_document(
        inputs=inputs.to_json(), family=family.value, path=run.path, events=recorder.events, outcome=outcome,
        build=plan.to_json() if plan is not None else None,
        layer_name=layer_name, started_at=started_at, duration_us=(time.perf_counter() - t0) * 1e6,
    )
    if run.error is not None:
        run.error.trace = document
        if trace_path is not None:
            run.error.trace_path = str(_write_trace(trace_path, document, layer_name, run.error))
        raise run.error
    if trace_path is not None:
        _write_trace(trace_path, document, layer_name)
    return Decision(inputs, sel.status, sel.backend, sel.kernel, sel.via, fmt, run.prepare_finalize, document, plan)


def _write_trace(path, document: dict, layer_name: str | None, failure: SelectionError | None = None) -> Path:
    """Write the trace; a failed write names the layer (and the selection error it would have explained)."""
    try:
        return trace_doc.write_atomic(Path(path), trace_doc.dumps(document))
    except TraceWriteError as err:
        layer = f"layer {layer_name!r}" if layer_name else "the layer"
        also = f"; the selection itself failed: {failure.message}" if failure is not None else ""
        raise TraceWriteError(f"the decision trace of {layer} was not written: {err}{also}") from None


def select(layer: MoELayer, parallel: ParallelConfig | None = None, backend=None, env=None,
           platform: PlatformFacts | None = None, policy: str | ProfileChoice | None = None, speed_table=None,
           **kwargs) -> Decision:
    """The one-call form: ``select(layer, parallel, backend="auto", env=os.environ, platform=probe(), policy=None)``.

    ``policy``: a profile name (``"seeds"``, ``"vllm-0.33"``); None follows the installed vLLM.
    ``speed_table``: a measured table or its file, for a profile that reads one (``"fastest-vllm-0.33"``).
    """
    return decide(make_inputs(layer, parallel, backend, env, platform, policy, speed_table), **kwargs)


def replay(document: dict, *, registry: Registry | None = None) -> dict:
    """Decide again from a trace's recorded inputs; returns the new canonical document."""
    if not isinstance(document, Mapping) or "inputs" not in document:
        got = "a dict without 'inputs'" if isinstance(document, Mapping) else type(document).__name__
        raise InputError(f"replay takes a trace document (a dict with the recorded 'inputs', as json.load returns a "
                         f"trace file), got {got}")
    inputs = DecisionInputs.from_json(document["inputs"])
    try:
        new = decide(inputs, registry=registry, layer_name=document.get("layer_name")).trace
    except SelectionError as err:
        new = err.trace
    return trace_doc.canonical(new)
