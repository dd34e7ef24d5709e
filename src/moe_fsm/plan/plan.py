"""Plan a deployment from a checkpoint's config.json: every MoE layer's spec and decision, before any weight loads.

The core's per-layer decider (``decider.py``) decides: nothing is built, no
torch; identical layers share one decision and one trace file, and ``plan.manifest``
in the trace directory maps every layer to its file.
A layer whose quantization moe-fsm cannot map, or whose selection fails, is a
row of the plan with its reason, never a missing one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Union

from moe_fsm.decision import Decision
from moe_fsm.errors import InputError, SelectionError
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.model_facts import MAX_NAME, ModelFacts
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import PlatformFacts
from moe_fsm.inputs.request import BackendRequest
from moe_fsm.plan.decider import DEFAULT_TRACE_DIR, LayerDecider, LayerSpec
from moe_fsm.plan.model_config import ModelConfig, read_model_config
from moe_fsm.plan.quant_config import QuantReader
from moe_fsm.plan.quant_fields import LATEST, LayerContext, LayerQuant, Mapped, Refused
from moe_fsm.profiles import ProfileChoice
from moe_fsm.trace.dir_lock import trace_dir_lock
from moe_fsm.trace.manifest import write_plan_manifest


@dataclass(frozen=True)
class PlannedLayer:
    index: int  # the decoder layer
    name: str  # the experts module
    quant: LayerQuant
    layer: Optional[MoELayer] = None
    decision: Optional[Decision] = None
    error: Optional[str] = None  # "NoBackendError: ..." when the selection failed
    trace_path: Optional[Path] = None

    @property
    def scheme(self) -> str:
        return self.layer.quant.describe() if self.layer is not None else "-"

    @property
    def outcome(self) -> str:
        """What the layer gets, in one phrase: the group a plan table sorts it into."""
        if self.decision is not None:
            d = self.decision
            return f"{d.backend} ({d.kernel or 'platform MoE'}, via {d.via}, {d.prepare_finalize.name})"
        if self.error is not None:
            return f"FAILED {self.error}"
        if isinstance(self.quant, Refused):
            return f"REFUSED by {self.quant.by} ({self.quant.error}): {self.quant.reason}"
        return f"NOT MAPPED: {self.quant.reason}"

    @property
    def status(self) -> str:
        if self.decision is not None:
            return self.decision.status
        if self.error is not None:
            return "failed"
        return "refused" if isinstance(self.quant, Refused) else "not_mapped"

    @property
    def group(self) -> tuple[str, str]:
        return (self.scheme, self.outcome)


@dataclass
class Plan:
    model: ModelConfig
    layers: list[PlannedLayer]
    decider: LayerDecider  # the parallel config, request, env, platform and profile it decided under
    quant_method: Optional[str] = None  # vLLM's name for the checkpoint's quantization (its config class), if any

    def groups(self) -> list[tuple[tuple[str, str], list[PlannedLayer]]]:
        """Layers by distinct (scheme, outcome), in order of first appearance."""
        grouped: dict[tuple[str, str], list[PlannedLayer]] = {}
        for row in self.layers:
            grouped.setdefault(row.group, []).append(row)
        return list(grouped.items())

    @property
    def ok(self) -> bool:
        return all(row.decision is not None for row in self.layers)


def plan_model(
    config_path,
    *,
    platform: PlatformFacts,
    parallel: Optional[ParallelConfig] = None,
    backend: Union[str, Mapping[str, str], BackendRequest, None] = None,
    env: Union[EnvSnapshot, Mapping[str, str], None] = None,
    trace_dir: Union[str, Path] = DEFAULT_TRACE_DIR,
    policy: Union[str, ProfileChoice, None] = None,
    speed_table=None,
) -> Plan:
    """Read the config, derive each MoE layer's MoELayer, decide it; one row per layer, one trace per distinct
    decision, and ``plan.manifest`` (layer -> trace) in ``trace_dir`` when any trace was written.
    ``speed_table``: a measured table or its path, for a profile that reads one (None: this device's, if any)."""
    decider = LayerDecider(parallel=parallel, request=backend, env=env, platform=platform, trace_dir=trace_dir,
                           policy=policy, speed_table=speed_table)
    model, reader, quants = checkpoint_layers(config_path, decider)
    # One plan or run at a time writes into a directory (trace.dir_lock): held only where a layer is decided,
    # so a plan that maps no layer leaves no directory behind.
    decides = any(isinstance(quant, Mapped) for quant in quants)
    with trace_dir_lock(decider.trace_dir) if decides else contextlib.nullcontext():
        rows = [_plan_layer(decider, model, quant, index, index)  # files: layerNNN = decoder layer
                for index, quant in zip(model.moe_layers, quants)]
        if any(row.trace_path is not None for row in rows):
            write_plan_manifest(
                decider.trace_dir, config=str(model.path), profile=decider.profile.to_json(),
                platform=decider.platform.to_json(), parallel=decider.parallel.to_json(), request=decider.request.to_json(),
                layers=[{"index": r.index, "name": r.name, "status": r.status,
                         "backend": r.decision.backend if r.decision else None,
                         "trace": r.trace_path.name if r.trace_path else None} for r in rows],
            )
    return Plan(model, rows, decider, reader.method)


def checkpoint_layers(config_path, decider: LayerDecider) -> tuple[ModelConfig, QuantReader, list[LayerQuant]]:
    """The config's model, its quantization reader and each MoE layer's quantization (in ``model.moe_layers``
    order), read under the decider's platform, parallel layout, env and profile. A malformed quantization_config,
    or a pattern that runs away on a name, is refused before any layer is decided."""
    model = read_model_config(config_path)
    try:
        reader = QuantReader(model.quantization, layer_context(model, decider))
        quants = [reader.layer(model.experts_module(index)) for index in model.moe_layers]
    except InputError as err:
        raise InputError(f"model config {model.quantization_file or model.path}: {err}") from None
    return model, reader, quants


def layer_of(model: ModelConfig, quant: Mapped) -> MoELayer:
    """The MoELayer of a mapped layer: the config's shapes, the layer's scheme, the checkpoint's facts."""
    g = model.geometry
    return MoELayer(
        quant=quant.scheme, num_experts=g.num_experts, top_k=g.top_k, hidden_size=g.hidden_size,
        intermediate_size=g.intermediate_size, activation=g.activation, swiglu_limit=g.swiglu_limit,
        dtype=g.dtype, allow_vllm_cutlass=quant.allow_vllm_cutlass, bias=g.bias,
        router_weight_on_input=g.router_weight_on_input, model=checkpoint_facts(model, quant),
    )


def layer_context(model: ModelConfig, decider: LayerDecider) -> LayerContext:
    """What the engine's quantization configs read besides a layer's name, under the decider's platform, parallel
    layout, env and policy profile: the profile names the engine's config rules (``Profile.config_rules``), and a
    vLLM profile's release picks vLLM's per-release rules (``seeds`` reads as the latest)."""
    from moe_fsm import profiles
    from moe_fsm.inputs.layer import Activation
    from moe_fsm.plan.config_rules import config_rules

    profile = profiles.get(decider.profile.name)
    release = tuple(profile.vllm_version[:2]) if profile.vllm_version else LATEST
    variable = profile.env.get("VLLM_BATCH_INVARIANT")
    raw = decider.env.raw_value("VLLM_BATCH_INVARIANT")
    g = model.geometry
    return LayerContext(model_type=model.model_type, projections=model.projections, hidden_size=g.hidden_size,
                        intermediate_size=g.intermediate_size, platform=decider.platform, parallel=decider.parallel,
                        batch_invariant=bool(variable.parse(raw)) if variable is not None and raw is not None else False,
                        release=release, config_rules=config_rules(profile.config_rules),
                        router_weight_on_input=g.router_weight_on_input, gated_silu=g.activation is Activation.SILU)


def _plan_layer(decider: LayerDecider, model: ModelConfig, quant: LayerQuant, index: int, trace_number: int) -> PlannedLayer:
    name = model.experts_module(index)
    if not isinstance(quant, Mapped):
        return PlannedLayer(index, name, quant)
    try:
        layer = layer_of(model, quant)
    except InputError as err:
        return PlannedLayer(index, name, quant, error=f"InputError: {err}")
    try:
        decided = decider.decide_layer(trace_number, LayerSpec(name, layer))
    except SelectionError as err:
        cause = err.__cause__ if isinstance(err.__cause__, SelectionError) else err
        return PlannedLayer(index, name, quant, layer, error=f"{type(cause).__name__}: {cause.message}",
                            trace_path=Path(err.trace_path) if err.trace_path else None)
    after = quant.refusal_after(decided.decision.backend)  # vLLM's method refuses the backend its oracle chose
    if after is not None:
        return PlannedLayer(index, name, quant, layer, error=f"{after.error}: {after.reason} (its oracle chose "
                            f"{decided.decision.backend})", trace_path=decided.trace_path)
    return PlannedLayer(index, name, quant, layer, decided.decision, trace_path=decided.trace_path)


def checkpoint_facts(model: ModelConfig, quant: Optional[Mapped] = None) -> ModelFacts:
    """What an engine reads of the checkpoint beyond a layer (SGLang's model overrides): the architecture, the
    quant_method its quantization config declares (ModelOpt's hf_quant_config.json form declares modelopt), and the
    method the engine builds the layer with where the profile's config rules name it (``Mapped.engine_method``)."""
    quantization = model.quantization or {}
    declared = quantization.get("quant_method")
    if declared is None and "producer" in quantization:
        declared = "modelopt"
    return ModelFacts(architecture=None if model.architecture == "unknown" else _fact(model.architecture),
                      quant_method=_fact(declared),
                      layer_method=(quant.engine_method or None) if quant is not None else None)


def _fact(value):
    """A name ModelFacts cannot hold (not a string, empty, too long) is not a fact any engine could match on."""
    return value if isinstance(value, str) and 0 < len(value) <= MAX_NAME else None


def layer_ranges(indices: list[int]) -> str:
    """[3, 4, 5, 7, 9, 10] -> '3-5, 7, 9-10'."""
    parts, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ", ".join(parts)
