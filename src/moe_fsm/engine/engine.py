"""The per-layer engine: decide every layer at load, build each kernel once, run forward.

This is how an inference engine uses moe-fsm. Layers that share their inputs
(scheme, shapes, parallel config, request, env, platform) share one decision
and one kernel: a 61-layer model with one quant scheme runs the machine once.
Every layer still gets its own trace file, named after the layer, written
atomically; a layer whose selection fails writes its trace first and the error
names the layer and the file.

Importing this module needs no torch (``moe-fsm plan`` decides with
``build=False``); torch comes in when a kernel is built or routing runs.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Optional, Union

from moe_fsm.backends.registry import Registry, default_registry
from moe_fsm.decision import Decision, DecisionInputs, decide, make_inputs
from moe_fsm.engine.presets import LayerSpec
from moe_fsm.errors import BackendUnavailableError, SelectionError, TraceWriteError
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import PlatformFacts
from moe_fsm.inputs.request import BackendRequest
from moe_fsm.profiles import ProfileChoice
from moe_fsm.trace import document as trace_doc

DEFAULT_TRACE_DIR = Path(trace_doc.DEFAULT_TRACE_DIR)


@dataclass
class LoadedLayer:
    spec: LayerSpec
    decision: Decision
    kernel: object  # ModularKernel, or None when the engine selects only
    trace_path: Path
    cached: bool


SLUG_MAX = 120  # file names stay well under the 255 bytes file systems allow


def trace_file_name(index: int, spec: LayerSpec, rank: Optional[int] = None) -> str:
    """``layer003-model.layers.3.mlp.experts.json``; a long name is cut and keeps a hash of the whole."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec.name)
    if len(slug) > SLUG_MAX:
        slug = f"{slug[:SLUG_MAX - 13]}-{hashlib.sha256(spec.name.encode()).hexdigest()[:12]}"
    suffix = f".rank{rank}" if rank is not None else ""
    return f"layer{index:03d}-{slug}{suffix}.json"


class Engine:
    """Selects and builds the kernel of every layer of a model (``build=False``: select only, for what-ifs).

    Two ways in: the layers up front (``Engine(specs, ...).load()``), or one at a
    time as a model loads (``engine.load_layer("model.layers.3.mlp.experts", layer)``).
    Either way decisions are cached by ``DecisionInputs`` and every layer writes its
    own trace. Unset arguments get an engine's defaults: no parallelism, ``auto``,
    the process env, the probed platform, the default policy profile (``policy=``
    names one: "seeds", "vllm-0.33", ...).
    """

    def __init__(
        self,
        layers: Optional[list[LayerSpec]] = None,
        *,
        parallel: Optional[ParallelConfig] = None,
        request: Union[str, Mapping[str, str], BackendRequest, None] = None,
        env: Union[EnvSnapshot, Mapping[str, str], None] = None,
        platform: Optional[PlatformFacts] = None,
        trace_dir: Union[str, Path] = DEFAULT_TRACE_DIR,
        rank: Optional[int] = None,
        registry: Optional[Registry] = None,
        build: bool = True,
        policy: Union[str, ProfileChoice, None] = None,
    ) -> None:
        defaults = make_inputs(MoELayer(), parallel, request, env, platform, policy)  # select()'s defaults, one layer aside
        self.layers = list(layers or [])
        self.parallel = defaults.parallel
        self.request = defaults.request
        self.env = defaults.env
        self.platform = defaults.platform
        self.profile = defaults.profile
        self.trace_dir = Path(trace_dir)
        self.rank = rank
        self.registry = registry or default_registry(self.profile.name)
        self.build = build
        self.loaded: list[LoadedLayer] = []
        self._decisions: dict[DecisionInputs, Decision] = {}
        self._kernels: dict[DecisionInputs, object] = {}
        self.loaded: list[LoadedLayer] = []

    def load(self, progress=None) -> list[LoadedLayer]:
        """Decide and build every layer given up front; raises the first layer's selection error, trace written."""
        loaded = []
        for index, spec in enumerate(self.layers):
            loaded.append(self._load_layer(index, spec))
            if progress is not None:
                progress(index + 1, len(self.layers), spec.name)
        self.loaded = loaded
        return loaded

    def load_layer(self, name: str, layer: MoELayer) -> LoadedLayer:
        """Decide (or reuse the decision of an identical layer) and build one more layer; writes its trace."""
        return self._load_layer(len(self.loaded), LayerSpec(name, layer))

    def inputs_for(self, layer: MoELayer) -> DecisionInputs:
        """The cache key of a layer under this engine's parallel config, request, env and platform."""
        return DecisionInputs(layer, self.parallel, self.request, self.env, self.platform, self.profile)

    def _load_layer(self, index: int, spec: LayerSpec) -> LoadedLayer:
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
            self._kernels[inputs] = self._build(index, spec, self._decisions[inputs])
        decision = self._decisions[inputs]
        if cached:
            document = {**decision.trace, "layer_name": spec.name}
            try:
                trace_doc.write_atomic(path, trace_doc.dumps(document))
            except TraceWriteError as err:
                raise TraceWriteError(f"layer {index} ({spec.name}): the decision trace was not written: {err}") from None
            decision = replace(decision, trace=document)
        loaded = LoadedLayer(spec, decision, self._kernels[inputs], path, cached)
        self.loaded.append(loaded)
        return loaded

    def _build(self, index: int, spec: LayerSpec, decision: Decision):
        if not self.build:
            return None
        try:
            return decision.build(self.registry)
        except BackendUnavailableError as err:
            raise BackendUnavailableError(f"layer {index} ({spec.name}): {err}") from err

    @property
    def distinct_decisions(self) -> int:
        return len(self._decisions)


def route(hidden, router, top_k: int):
    """Softmax top-k routing, renormalized (Qwen/Mixtral style): float32 weights, int32 ids."""
    import torch

    logits = hidden.to(torch.float32) @ router.to(torch.float32).T
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids.to(torch.int32)
