"""The per-layer engine: decide every layer at load, build each kernel once, run forward.

This is how an inference engine uses moe-fsm. Deciding is the core's
(``moe_fsm.plan.decider.LayerDecider``: identical layers share one decision
and one trace file); the engine adds the build, one kernel per
distinct decision (``moe_fsm.runtime.build``), so a 61-layer model with one
quant scheme runs the machine once and builds one kernel.

Importing this module needs no torch; torch comes in when a kernel is built or routing runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from moe_fsm import runtime
from moe_fsm.decision import Decision, DecisionInputs
from moe_fsm.errors import BackendUnavailableError, InputError, TraceWriteError
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.plan.decider import LayerDecider, LayerSpec
from moe_fsm.trace import document as trace_doc
from moe_fsm.trace.manifest import layer_number


@dataclass
class LoadedLayer:
    spec: LayerSpec
    decision: Decision
    kernel: object  # ModularKernel, or None when the engine selects only
    trace_path: Path
    cached: bool
    stand_in: object = None  # backends.stand_ins.StandIn when a stand-in runs the decided kernel's numerics


class Engine(LayerDecider):
    """Selects and builds the kernel of every layer of a model (``build=False``: select only, for what-ifs).

    Two ways in: the layers up front (``Engine(specs, ...).load()``), or one at a
    time as a model loads (``engine.load_layer("model.layers.3.mlp.experts", layer)``).
    Either way decisions are cached by ``DecisionInputs``, one trace per distinct
    decision (``layer_traces`` lists every layer with its trace file, in load order). Unset arguments get an
    engine's defaults (see ``LayerDecider``).
    """

    def __init__(self, layers: Optional[list[LayerSpec]] = None, *, build: bool = True, strict_build: bool = False,
                 device: Optional[str] = None, max_tokens_per_rank: Optional[int] = None, **settings) -> None:
        """``settings``: the ``LayerDecider``'s (parallel, request, env, platform, trace_dir, rank, registry, policy).

        ``strict_build`` refuses stand-ins and substitutes (``runtime.build``); ``device`` is where the run computes,
        which decides whether CUDA-only kernels can be built (None: CUDA when torch sees it);
        ``max_tokens_per_rank``, the most tokens any rank passes in one call, makes the all-to-all prepare/finalize
        send fixed blocks with no host read (``runtime.build``), and is recorded in those layers' traces. On CUDA
        over NCCL such a P/F replays its eager calls from CUDA graphs of its own, which NCCL waits for before it
        destroys the process group: end with ``moe_fsm.distributed.destroy()``, or call
        ``moe_fsm.prepare_finalize.dispatch_graphs.release_graphs()`` before ``destroy_process_group`` yourself.
        """
        super().__init__(**settings)
        if layers is not None and not (isinstance(layers, (list, tuple)) and all(isinstance(s, LayerSpec) for s in layers)):
            raise InputError(f"layers must be a list of LayerSpec(name, MoELayer), got {_describe(layers)}")
        for name, flag in (("build", build), ("strict_build", strict_build)):
            if not isinstance(flag, bool):
                raise InputError(f"{name} must be True or False, got {flag!r}")
        if device is not None:
            runtime.device_type(device)  # refused here, before any layer is decided
        runtime.check_max_tokens_per_rank(max_tokens_per_rank)
        self.strict_build = strict_build
        self.device = device
        self.max_tokens_per_rank = max_tokens_per_rank
        self.layers = list(layers or [])
        self.build = build
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

    def _load_layer(self, position: int, spec: LayerSpec) -> LoadedLayer:
        index = layer_number(spec.name, position)  # the decoder layer: trace file names and messages go by it
        decided = self.decide_layer(index, spec)
        if not decided.cached:
            self._kernels[decided.inputs] = self._build(index, spec, decided.decision)
        decision = decided.decision
        kernel = self._kernels[decided.inputs]
        stand_in = getattr(kernel, "stand_in", None)
        # the trace's build section names what runs in place of the decided kernel and the weights' one-time
        # re-layout (the decision is unchanged)
        built = {"stand_in": stand_in.to_json() if stand_in is not None else None,
                 "weight_layout": getattr(getattr(kernel, "experts", None), "relayout", None),
                 # the fixed blocks an all-to-all P/F sends when the engine was given them (not a default capacity)
                 "max_tokens_per_rank": getattr(getattr(kernel, "prepare_finalize", None), "max_tokens_per_rank", None)
                 if self.max_tokens_per_rank is not None else None}
        missing = {k: v for k, v in built.items() if v is not None and k not in (decision.trace.get("build") or {})}
        if missing:
            decision = replace(decision, trace={**decision.trace, "build": {**decision.trace["build"], **missing}})
            if not decided.cached:
                self._decisions[decided.inputs] = decision
            try:
                trace_doc.write_atomic(decided.trace_path, trace_doc.dumps(decision.trace))
            except TraceWriteError as err:
                raise TraceWriteError(f"layer {index} ({spec.name}): the decision trace was not written: {err}") from None
        loaded = LoadedLayer(spec, decision, self._kernels[decided.inputs], decided.trace_path, decided.cached, stand_in)
        self.loaded.append(loaded)
        return loaded

    def _build(self, index: int, spec: LayerSpec, decision: Decision):
        if not self.build:
            return None
        try:
            return runtime.build(decision, self.registry, strict=self.strict_build, device=self.device,
                                 max_tokens_per_rank=self.max_tokens_per_rank)
        except BackendUnavailableError as err:
            raise BackendUnavailableError(f"layer {index} ({spec.name}): {err}") from err


def _describe(layers) -> str:
    """What stood where a list of LayerSpec was expected: the list's first stranger, or the whole value's type."""
    if isinstance(layers, (list, tuple)):
        index, item = next((i, s) for i, s in enumerate(layers) if not isinstance(s, LayerSpec))
        return f"{type(item).__name__} at index {index}"
    return type(layers).__name__


def route(hidden, router, top_k: int):
    """Softmax top-k routing, renormalized (Qwen/Mixtral style): float32 weights, int32 ids."""
    import torch

    logits = hidden.to(torch.float32) @ router.to(torch.float32).T
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids.to(torch.int32)
