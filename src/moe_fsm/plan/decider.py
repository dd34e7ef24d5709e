"""Decide a model's MoE layers one after another: one decision and one trace per distinct input.

This is the deciding half of an engine, with nothing to build: ``moe-fsm plan``
uses it alone, and the runtime's ``Engine`` builds each distinct decision's
kernel on top of it. Decisions are cached by ``DecisionInputs``, and so are
failed selections: a layer whose inputs were decided before gets the cached
decision under its own name and shares the earlier layer's trace file, so a
directory holds one trace per distinct decision (48 identical layers: one
file); ``layer_traces`` maps every layer to its file, which the callers write
to a manifest (``plan.manifest``, ``run.manifest``). A failed selection writes
its trace first and the error names the layer and the file.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Optional, Union

from moe_fsm import profiles
from moe_fsm.backends.registry import Registry, default_registry
from moe_fsm.decision import Decision, DecisionInputs, decide, make_inputs
from moe_fsm.errors import InputError, SelectionError, TraceWriteError
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

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise InputError(f"a layer's name must be a string (its module, e.g. 'model.layers.0.mlp.experts'), "
                             f"got {self.name!r}")
        if not isinstance(self.layer, MoELayer):
            raise InputError(f"layer {self.name!r} must be a MoELayer, got {type(self.layer).__name__}")


@dataclass(frozen=True)
class DecidedLayer:
    inputs: DecisionInputs
    decision: Decision
    trace_path: Path
    cached: bool  # the decision of an earlier layer with the same inputs (trace_path is that layer's file)


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
        speed_table=None,
    ) -> None:
        if not isinstance(trace_dir, (str, os.PathLike)) or not isinstance(os.fspath(trace_dir), str):
            raise InputError(f"trace_dir must be a directory path (a str or a pathlib.Path), got {trace_dir!r}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            # the rank goes into trace file names: anything but a number could point them out of trace_dir
            raise InputError(f"rank must be None or an integer >= 0 (this process's rank), got {rank!r}")
        # select()'s defaults, one layer aside; speed_table (a table, its path, None: this device's, False: none)
        # is kept only under a profile that reads one
        defaults = make_inputs(MoELayer(), parallel, request, env, platform, policy, speed_table)
        self.parallel = defaults.parallel
        self.request = defaults.request
        self.env = defaults.env
        self.platform = defaults.platform
        self.profile = defaults.profile
        self.speed_table = defaults.speed_table
        self.trace_dir = Path(trace_dir)
        self.rank = rank
        self.registry = registry or default_registry(self.profile.name)
        self._reads_model_facts = profiles.get(self.profile.name).reads_model_facts
        self._decisions: dict[DecisionInputs, Decision] = {}
        self._paths: dict[DecisionInputs, Path] = {}  # where each distinct decision's trace was written
        self._failures: dict[DecisionInputs, SelectionError] = {}
        self.layer_traces: list[tuple[str, Path]] = []  # every layer asked for, in order, with its trace file

    def inputs_for(self, layer: MoELayer) -> DecisionInputs:
        """The cache key of a layer under this decider's parallel config, request, env and platform.

        A layer's model facts (its checkpoint's architecture and quant method) are left out under a profile
        that does not read them, so its decisions and traces are those of the layer alone."""
        if layer.model is not None and not self._reads_model_facts:
            layer = replace(layer, model=None)
        return DecisionInputs(layer, self.parallel, self.request, self.env, self.platform, self.profile, self.speed_table)

    def decide_layer(self, index: int, spec: LayerSpec) -> DecidedLayer:
        """Decide (or reuse the decision of an identical layer) for one more layer.

        A new decision writes its trace (file number ``index``); a layer with the inputs of an earlier one gets
        that decision, renamed, and that layer's trace file: nothing is written. A selection that failed for
        the same inputs before fails again, naming this layer and the earlier trace.
        """
        inputs = self.inputs_for(spec.layer)
        failed = self._failures.get(inputs)
        if failed is not None:
            self.layer_traces.append((spec.name, Path(failed.trace_path)))
            raise self._named(failed, index, spec) from failed
        if inputs in self._decisions:
            path = self._paths[inputs]
            decision = self._decisions[inputs]
            decision = replace(decision, trace={**decision.trace, "layer_name": spec.name})
            self.layer_traces.append((spec.name, path))
            return DecidedLayer(inputs, decision, path, True)
        path = self.trace_dir / trace_file_name(index, spec, self.rank)
        try:
            self._decisions[inputs] = decide(inputs, registry=self.registry, layer_name=spec.name, trace_path=path)
        except TraceWriteError as err:
            raise TraceWriteError(f"layer {index} ({spec.name}): {err}") from None
        except SelectionError as err:
            if err.trace_path:
                self._failures[inputs] = err
                self.layer_traces.append((spec.name, Path(err.trace_path)))
            raise self._named(err, index, spec) from err
        self._paths[inputs] = path
        self.layer_traces.append((spec.name, path))
        return DecidedLayer(inputs, self._decisions[inputs], path, False)

    @staticmethod
    def _named(err: SelectionError, index: int, spec: LayerSpec) -> SelectionError:
        named = type(err)(f"layer {index} ({spec.name}): {err.message} [trace: {err.trace_path}]", trace=err.trace)
        named.trace_path = err.trace_path
        return named

    @property
    def distinct_traces(self) -> int:
        return len(self._paths) + len(self._failures)

    @property
    def distinct_decisions(self) -> int:
        return len(self._decisions)
