"""Kernel launches recorded on CPU tensors and bound as Triton's JIT binds them, for an sm_90 target.

A test swaps a kernel for a ``Recorder``, runs the host code that launches it, then ``bind``s each recorded
launch: a renamed, missing or extra argument fails there, on a machine without a GPU, and not at the first
launch on one. Needs Triton (not CUDA). Also the two skip markers the kernel tests share: ``interpreter`` for tests
that run the kernels under Triton's interpreter, ``needs_triton_jit`` for tests that record and bind launches with
Triton's JIT (which the interpreter replaces).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
UNDER_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

interpreter = pytest.mark.skipif(not (HAS_TRITON and UNDER_INTERPRETER),
                                 reason="runs the kernels under Triton's interpreter: start pytest with TRITON_INTERPRET=1")
needs_triton_jit = pytest.mark.skipif(not HAS_TRITON or UNDER_INTERPRETER,
                                      reason="records and binds launches with Triton's JIT: needs Triton, not its interpreter")


class Recorder:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kwargs)`` is recorded, not run."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, grid, args, kwargs))


def bind(fn, args, kwargs):
    """(signature, constexprs) of a launch, bound by Triton's JIT binder for sm_90; raises on a mismatch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    assert list(bound) == fn.arg_names, "every kernel parameter is bound, in order"
    _, signature, constexprs, _ = fn._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs


def record_layer_launches(monkeypatch) -> list:
    """Every ``*_kernel`` of the Triton MoE layer swapped for a ``Recorder`` and the device checks of the modules
    that launch them switched off, so that ``fused_experts`` runs its host code on CPU tensors; returns the list the
    launches are appended to, as (kernel, grid, args, kwargs)."""
    from triton.runtime.jit import JITFunction

    from moe_fsm.kernels.triton_moe import _kernels, align, fused, quant

    calls: list = []
    for name, fn in vars(_kernels).copy().items():
        if isinstance(fn, JITFunction) and name.endswith("_kernel"):
            monkeypatch.setattr(_kernels, name, Recorder(fn, calls))
    for module in (fused, align, quant):
        monkeypatch.setattr(module, "require_device", lambda *tensors: None)
    return calls
