"""The documented errors of moe-fsm.

Every failure a caller can see is one of these. The selection errors subclass
the built-in types vLLM's oracles raise (``ValueError`` for a choice that
cannot run, ``NotImplementedError`` when nothing can), so an engine that
already catches those keeps working; each carries the decision trace that
explains it.
"""

from __future__ import annotations

from typing import Any


class MoeFsmError(Exception):
    """Base of every error moe-fsm raises on purpose."""


class InputError(MoeFsmError, ValueError):
    """An input (layer, parallel config, request, env, platform) is malformed."""


class EnvVarError(InputError):
    """An environment variable holds a value its parser does not accept."""

    def __init__(self, name: str, value: str, accepted: str) -> None:
        super().__init__(f"{name}={value!r} is not valid; accepted values: {accepted}")
        self.name = name
        self.value = value
        self.accepted = accepted


class SelectionError(MoeFsmError):
    """No backend could be selected; ``trace`` is the full decision record."""

    def __init__(self, message: str, trace: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.trace = trace
        self.trace_path: str | None = None


class BackendUnsupportedError(SelectionError, ValueError):
    """A backend that was asked for (by name or by env var) cannot run this layer."""


class NoBackendError(SelectionError, NotImplementedError):
    """Every candidate backend was rejected."""


class NoPolicyError(SelectionError, NotImplementedError):
    """The policy profile has no selection policy for the layer's quantization family."""


class KernelInputError(MoeFsmError, ValueError):
    """Tensors handed to a kernel have the wrong shape, dtype, device or range."""


class BackendUnavailableError(MoeFsmError, RuntimeError):
    """A selected backend's library is missing where the kernel is built."""


class TraceWriteError(MoeFsmError, OSError):
    """A trace (or run manifest) could not be written; the message names the file, and the layer where known."""
