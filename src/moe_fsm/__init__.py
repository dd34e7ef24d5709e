"""moe-fsm: choose and run the MoE experts kernel for a layer, as an explicit state machine."""

__version__ = "0.1.0"

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

__all__ = [
    "Activation", "AllToAllKind", "BackendRequest", "BackendUnavailableError", "BackendUnsupportedError", "Decision",
    "DecisionInputs", "Engine", "EnvSnapshot", "InputError", "LayerSpec", "LoadedLayer", "MoELayer", "MoeFsmError", "NoBackendError", "ParallelConfig",
    "PlatformFacts", "QuantFamily", "QuantScheme", "SelectionError", "decide", "make_inputs", "preset", "probe",
    "replay", "select", "TraceWriteError", "build",
]
