"""The per-layer engine: decide every layer at load, build each kernel once, run forward.

This is how an inference engine uses moe-fsm. Layers that share their inputs
(scheme, shapes, parallel config, request, env, platform) share one decision
and one kernel: a 61-layer model with one quant scheme runs the machine once.
Every layer still gets its own trace file, named after the layer, written
atomically; a layer whose selection fails writes its trace first and the error
names the layer and the file.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from moe_fsm.backends.registry import Registry, default_registry
from moe_fsm.decision import Decision, DecisionInputs, decide
from moe_fsm.engine.presets import LayerSpec
from moe_fsm.errors import BackendUnavailableError, SelectionError, TraceWriteError
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import PlatformFacts
from moe_fsm.inputs.request import BackendRequest
from moe_fsm.trace import document as trace_doc

DEFAULT_TRACE_DIR = Path("moe-fsm-traces")


@dataclass
class LoadedLayer:
    spec: LayerSpec
    decision: Decision
    kernel: object  # ModularKernel
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
    """Selects and builds the kernel of every layer of a model (``build=False``: select only, for what-ifs)."""

    def __init__(
        self,
        layers: list[LayerSpec],
        *,
        parallel: ParallelConfig,
        request: BackendRequest,
        env: EnvSnapshot,
        platform: PlatformFacts,
        trace_dir: Path = DEFAULT_TRACE_DIR,
        rank: Optional[int] = None,
        registry: Optional[Registry] = None,
        build: bool = True,
    ) -> None:
        self.layers = layers
        self.parallel = parallel
        self.request = request
        self.env = env
        self.platform = platform
        self.trace_dir = Path(trace_dir)
        self.rank = rank
        self.registry = registry or default_registry()
        self.build = build
        self._decisions: dict[DecisionInputs, Decision] = {}
        self._kernels: dict[DecisionInputs, object] = {}
        self.loaded: list[LoadedLayer] = []

    def load(self, progress=None) -> list[LoadedLayer]:
        """Decide and build every layer; raises the first layer's selection error, trace written."""
        loaded = []
        for index, spec in enumerate(self.layers):
            loaded.append(self._load_layer(index, spec))
            if progress is not None:
                progress(index + 1, len(self.layers), spec.name)
        self.loaded = loaded
        return loaded

    def _load_layer(self, index: int, spec: LayerSpec) -> LoadedLayer:
        inputs = DecisionInputs(spec.layer, self.parallel, self.request, self.env, self.platform)
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
        return LoadedLayer(spec, decision, self._kernels[inputs], path, cached)

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


def route(hidden: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing, renormalized (Qwen/Mixtral style): float32 weights, int32 ids."""
    logits = hidden.to(torch.float32) @ router.to(torch.float32).T
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids.to(torch.int32)
