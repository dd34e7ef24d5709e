"""Decide a model's MoE layers one after another: identical layers share one decision, every layer its own trace.

This is the deciding half of an engine, with nothing to build: ``moe-fsm plan``
uses it alone, and the runtime's ``Engine`` builds each distinct decision's
kernel on top of it. Decisions are cached by ``DecisionInputs``; a layer whose
inputs were decided before gets the cached decision with its own name, and its
own trace file, written atomically. A layer whose selection fails writes its
trace first and the error names the layer and the file.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Optional, Union

from moe_fsm.backends.registry import Registry, default_registry
from moe_fsm.decision import Decision, DecisionInputs, decide, make_inputs
from moe_fsm.errors import SelectionError, TraceWriteError
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import PlatformFacts
from moe_fsm.inputs.request import BackendRequest
from moe_fsm.profiles import ProfileChoice
from moe_fsm.trace import document as trace_doc

DEFAULT_TRACE_DIR = Path(trace_doc.DEFAULT_TRACE_DIR)
SLUG_MAX = 120  # file names stay well under the 255 bytes file systems allow


@dataclass(frozen=True)
class LayerSpec:
    name: str
    layer: MoELayer


@dataclass(frozen=True)
class DecidedLayer:
    inputs: DecisionInputs
    decision: Decision
    trace_path: Path
    cached: bool  # the decision of an earlier layer with the same inputs


def trace_file_name(index: int, spec: LayerSpec, rank: Optional[int] = None) -> str:
    """``layer003-model.layers.3.mlp.experts.json``; a long name is cut and keeps a hash of the whole."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec.name)
    if len(slug) > SLUG_MAX:
        slug = f"{slug[:SLUG_MAX - 13]}-{hashlib.sha256(spec.name.encode()).hexdigest()[:12]}"
    suffix = f".rank{rank}" if rank is not None else ""
    return f"layer{index:03d}-{slug}{suffix}.json"


class LayerDecider:
    """Decides layer after layer under one parallel config, request, env, platform and policy profile.

    Unset arguments get an engine's defaults: no parallelism, ``auto``, the
    process env, the probed platform, the default policy profile (``policy=``
    names one: "seeds", "vllm-0.33", ...).
    """

    def __init__(
        self,
        *,
        parallel: Optional[ParallelConfig] = None,
        request: Union[str, Mapping[str, str], BackendRequest, None] = None,
        env: Union[EnvSnapshot, Mapping[str, str], None] = None,
        platform: Optional[PlatformFacts] = None,
        trace_dir: Union[str, Path] = DEFAULT_TRACE_DIR,
        rank: Optional[int] = None,
        registry: Optional[Registry] = None,
        policy: Union[str, ProfileChoice, None] = None,
    ) -> None:
        defaults = make_inputs(MoELayer(), parallel, request, env, platform, policy)  # select()'s defaults, one layer aside
        self.parallel = defaults.parallel
        self.request = defaults.request
        self.env = defaults.env
        self.platform = defaults.platform
        self.profile = defaults.profile
        self.trace_dir = Path(trace_dir)
        self.rank = rank
        self.registry = registry or default_registry(self.profile.name)
        self._decisions: dict[DecisionInputs, Decision] = {}

    def inputs_for(self, layer: MoELayer) -> DecisionInputs:
        """The cache key of a layer under this decider's parallel config, request, env and platform."""
        return DecisionInputs(layer, self.parallel, self.request, self.env, self.platform, self.profile)

    def decide_layer(self, index: int, spec: LayerSpec) -> DecidedLayer:
        """Decide (or reuse the decision of an identical layer) and write the layer's trace (file number ``index``)."""
        inputs = self.inputs_for(spec.layer)
        path = self.trace_dir / trace_file_name(index, spec, self.rank)
        cached = inputs in self._decisions
        if not cached:
            try:
                self._decisions[inputs] = decide(inputs, registry=self.registry, layer_name=spec.name, trace_path=path)
            except TraceWriteError as err:
                raise TraceWriteError(f"layer {index} ({spec.name}): {err}") from None
            except SelectionError as err:
                named = type(err)(f"layer {index} ({spec.name}): {err.message} [trace: {err.trace_path}]", trace=err.trace)
                named.trace_path = err.trace_path
                raise named from err
        decision = self._decisions[inputs]
        if cached:
            document = {**decision.trace, "layer_name": spec.name}
            try:
                trace_doc.write_atomic(path, trace_doc.dumps(document))
            except TraceWriteError as err:
                raise TraceWriteError(f"layer {index} ({spec.name}): the decision trace was not written: {err}") from None
            decision = replace(decision, trace=document)
        return DecidedLayer(inputs, decision, path, cached)

    @property
    def distinct_decisions(self) -> int:
        return len(self._decisions)
