"""moe-fsm: choose and run the MoE experts kernel for a layer, as an explicit state machine.

The names below are the library's face (``from moe_fsm import select, build, Engine``). Each is imported on
first use (PEP 562's module ``__getattr__``), not here: every module of the package imports this file first,
and the decision core (``moe_fsm.trace``, ``moe_fsm.decision``, ...) must not load the runtime, torch
included, by way of its parent package (``tests/test_import_layers.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_FACE = {
    "Decision": "moe_fsm.decision",
    "DecisionInputs": "moe_fsm.decision",
    "decide": "moe_fsm.decision",
    "make_inputs": "moe_fsm.decision",
    "replay": "moe_fsm.decision",
    "select": "moe_fsm.decision",
    "Engine": "moe_fsm.engine.engine",
    "LoadedLayer": "moe_fsm.engine.engine",
    "BackendUnavailableError": "moe_fsm.errors",
    "BackendUnsupportedError": "moe_fsm.errors",
    "InputError": "moe_fsm.errors",
    "MoeFsmError": "moe_fsm.errors",
    "NoBackendError": "moe_fsm.errors",
    "SelectionError": "moe_fsm.errors",
    "TraceWriteError": "moe_fsm.errors",
    "EnvSnapshot": "moe_fsm.inputs.env",
    "Activation": "moe_fsm.inputs.layer",
    "MoELayer": "moe_fsm.inputs.layer",
    "AllToAllKind": "moe_fsm.inputs.parallel",
    "ParallelConfig": "moe_fsm.inputs.parallel",
    "PlatformFacts": "moe_fsm.inputs.platform",
    "preset": "moe_fsm.inputs.platform",
    "probe": "moe_fsm.inputs.platform",
    "QuantFamily": "moe_fsm.inputs.quant",
    "QuantScheme": "moe_fsm.inputs.quant",
    "BackendRequest": "moe_fsm.inputs.request",
    "LayerSpec": "moe_fsm.plan.decider",
    "build": "moe_fsm.runtime",
}

__all__ = sorted(_FACE) + ["__version__"]

DISTRIBUTION = "moe-fsm"


def _version() -> str:
    """The installed distribution's version (pyproject.toml's, through the package metadata); a source tree put on
    ``sys.path`` without installing it has none, and says so."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0+not-installed"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value = _version()
    elif name in _FACE:
        value = getattr(importlib.import_module(_FACE[name]), name)
    else:
        raise AttributeError(f"module 'moe_fsm' has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see; never executed
    from moe_fsm.decision import Decision, DecisionInputs, decide, make_inputs, replay, select
    from moe_fsm.engine.engine import Engine, LoadedLayer
    from moe_fsm.errors import (
        BackendUnavailableError, BackendUnsupportedError, InputError, MoeFsmError, NoBackendError, SelectionError,
        TraceWriteError,
    )
    from moe_fsm.inputs.env import EnvSnapshot
    from moe_fsm.inputs.layer import Activation, MoELayer
    from moe_fsm.inputs.parallel import AllToAllKind, ParallelConfig
    from moe_fsm.inputs.platform import PlatformFacts, preset, probe
    from moe_fsm.inputs.quant import QuantFamily, QuantScheme
    from moe_fsm.inputs.request import BackendRequest
    from moe_fsm.plan.decider import LayerSpec
    from moe_fsm.runtime import build

    __version__: str
