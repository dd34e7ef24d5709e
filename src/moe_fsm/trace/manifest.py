"""Manifests: which trace file holds each layer's decision.

``moe-fsm plan``, ``moe-fsm run`` and ``integrations.transformers.enable`` write one
trace per *distinct* decision (a 48-layer model whose layers all decide alike writes
one file, named after the first layer that got it), and a manifest that maps every
layer to its file: ``plan.manifest``, ``run.manifest``, ``model.manifest``. Their content is JSON; their names are
not *.json, so ``moe-fsm explain DIR/*.json`` still reads only traces.

``explain`` and ``replay`` take a manifest where they take a trace:
``moe-fsm explain DIR/plan.manifest --layer 5`` (a decoder layer number or a module
name) tells layer 5's story from the trace it shares, under its own name;
without ``--layer`` every distinct decision in turn. A layer's number means one thing
in every manifest, table and trace file name (``layer_number``): the decoder layer,
the N of ``model.layers.N``. Torch-free, core.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

from moe_fsm.errors import InputError

_DECODER_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")

RUN_MANIFEST_NAME = "run.manifest"
RUN_MANIFEST_SCHEMA = "moe-fsm/run-manifest"
PLAN_MANIFEST_NAME = "plan.manifest"
PLAN_MANIFEST_SCHEMA = "moe-fsm/plan-manifest"
MODEL_MANIFEST_NAME = "model.manifest"  # transformers' enable(model)
MODEL_MANIFEST_SCHEMA = "moe-fsm/model-manifest"
SCHEMAS = (RUN_MANIFEST_SCHEMA, PLAN_MANIFEST_SCHEMA, MODEL_MANIFEST_SCHEMA)


@dataclass(frozen=True)
class LayerEntry:
    """One layer of a manifest: its index, its module name and the trace that holds its decision (None: none)."""

    index: int
    name: str
    trace: Optional[Path]


def layer_number(name: str, position: int) -> int:
    """The number a layer goes by in manifests, tables, trace file names and ``--layer N``: the decoder layer its
    experts module belongs to (the N of ``model.layers.N.mlp.experts``, also under a multimodal model's
    ``language_model.``), else, for a name without one, its position among the model's MoE layers."""
    found = _DECODER_LAYER.search(name) if isinstance(name, str) else None
    return int(found.group(1)) if found and len(found.group(1)) <= 9 else position


def is_manifest(document) -> bool:
    return isinstance(document, dict) and document.get("schema") in SCHEMAS


def trace_groups(entries: Iterable[tuple[str, Optional[str]]]) -> dict[str, list[str]]:
    """``{trace file: [layer names]}`` in order of first appearance (the manifests' ``traces`` section)."""
    groups: dict[str, list[str]] = {}
    for name, trace in entries:
        if trace:
            groups.setdefault(trace, []).append(name)
    return groups


def layer_entries(document: dict, path: Path, rank: int = 0) -> list[LayerEntry]:
    """Every layer of a manifest with its trace file (resolved next to the manifest); InputError if malformed."""
    layers = document.get("layers")
    if not isinstance(layers, list):
        raise InputError(f"manifest {path} has no list of layers")
    entries = []
    for position, row in enumerate(layers):
        if not isinstance(row, dict):
            raise InputError(f"manifest {path}: layers[{position}] is not an object")
        index, name = row.get("index", position), row.get("name", row.get("module"))
        if isinstance(index, bool) or not isinstance(index, int) or not isinstance(name, str):
            raise InputError(f"manifest {path}: layers[{position}] needs an integer index and a name")
        if document.get("schema") == RUN_MANIFEST_SCHEMA:
            files = row.get("trace_files")
            if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
                raise InputError(f"manifest {path}: layers[{position}].trace_files is not a list of file names")
            if files and not 0 <= rank < len(files):
                raise InputError(f"manifest {path}: layer {index} has traces for ranks 0..{len(files) - 1}, not {rank}")
            trace = files[rank] if files else None
        else:
            trace = row.get("trace")
            if trace is not None and not isinstance(trace, str):
                raise InputError(f"manifest {path}: layers[{position}].trace is not a file name")
        if trace is not None and (Path(trace).name != trace or trace in ("", ".", "..")):
            raise InputError(f"manifest {path}: layers[{position}] names trace {trace!r}, not a file beside the manifest")
        entries.append(LayerEntry(index, name, path.parent / trace if trace else None))
    return entries


def pick(entries: Sequence[LayerEntry], layer: str, path: Path) -> LayerEntry:
    """The layer ``layer`` names: a decoder layer number ("5", see ``layer_number``) or a module name."""
    text = layer.strip()
    found = [e for e in entries if (str(e.index) == text if text.isdigit() else e.name == text)]
    if not found:
        names = ", ".join(f"{e.index} ({e.name})" for e in entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise InputError(f"manifest {path} has no layer {layer!r}; give a layer index or module name: {names or 'none'}")
    if found[0].trace is None:
        raise InputError(f"manifest {path}: layer {found[0].index} ({found[0].name}) has no trace (it was not decided)")
    return found[0]


def distinct(entries: Sequence[LayerEntry]) -> list[tuple[Path, list[LayerEntry]]]:
    """The traces of a manifest, each with the layers that share it, in order of first appearance."""
    groups: dict[Path, list[LayerEntry]] = {}
    for entry in entries:
        if entry.trace is not None:
            groups.setdefault(entry.trace, []).append(entry)
    return list(groups.items())


def write_layer_manifest(trace_dir: Path, name: str, schema: str, header: dict, layers: Sequence[dict]) -> Path:
    """``trace_dir/name``: ``header``, each layer (``index``, ``name``, ``trace`` file name or None, ...) and
    ``traces`` (each file's layers). The plan's and transformers' manifests; ``run.manifest`` has its own writer."""
    from moe_fsm.trace.document import write_atomic

    document = {"schema": schema, "schema_version": 1, **header, "layers": list(layers),
                "traces": trace_groups((row["name"], row["trace"]) for row in layers)}
    return write_atomic(Path(trace_dir) / name, json.dumps(document, indent=2, allow_nan=False) + "\n")


def write_plan_manifest(trace_dir: Path, *, config: str, profile: dict, platform: dict, parallel: dict, request,
                        layers: Sequence[dict]) -> Path:
    """``trace_dir/plan.manifest``: each planned layer (index, module, status, backend, trace) and the traces' layers."""
    header = {"config": config, "profile": profile, "platform": platform, "parallel": parallel, "request": request}
    return write_layer_manifest(trace_dir, PLAN_MANIFEST_NAME, PLAN_MANIFEST_SCHEMA, header, layers)
