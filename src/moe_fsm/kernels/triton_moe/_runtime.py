"""Where the Triton kernels can run, and the clear errors for where they cannot.

Importing the package never imports Triton; the first launch does. That keeps
``import moe_fsm.kernels.triton_moe`` working on machines without Triton or CUDA
(CPU CI) while a call there fails with an error that says what is missing.
``TRITON_INTERPRET=1`` (Triton's interpreter) lets the kernels run on CPU tensors,
slowly, for debugging.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType

import torch

from moe_fsm.errors import BackendUnavailableError

HAS_TRITON = importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def require_device(*tensors: torch.Tensor) -> None:
    """Raise BackendUnavailableError unless Triton is importable and every tensor is on CUDA."""
    if not HAS_TRITON:
        raise BackendUnavailableError(
            "the Triton MoE kernels need the 'triton' package, which is not installed here; "
            "install triton (it ships with CUDA builds of torch) or pick another experts backend"
        )
    if interpreter_enabled():
        return
    for t in tensors:
        if t is not None and t.device.type != "cuda":
            raise BackendUnavailableError(
                f"the Triton MoE kernels run on CUDA tensors; got a tensor on {t.device} "
                "(set TRITON_INTERPRET=1 to run them on CPU through Triton's interpreter, for debugging only)"
            )


@functools.lru_cache(maxsize=None)
def kernels() -> ModuleType:
    """The module of @triton.jit kernels, imported on first use."""
    from moe_fsm.kernels.triton_moe import _kernels

    return _kernels


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The name the config table is keyed by (``cpu-interpreter`` off CUDA)."""
    if device.type != "cuda":
        return "cpu-interpreter"
    return torch.cuda.get_device_name(device)
