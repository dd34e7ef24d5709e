"""Where the Triton kernels can run, and the clear errors for where they cannot.

Importing the package never imports Triton; the first launch does. That keeps
``import moe_fsm.kernels.triton_moe`` working on machines without Triton or CUDA
(CPU CI) while a call there fails with an error that says what is missing.
``TRITON_INTERPRET=1`` (Triton's interpreter) lets the kernels run on CPU tensors,
slowly, for debugging.

``launch`` is how the package starts its kernels. Triton's own launch binds and
specializes every argument again on each call (for a 45-argument GEMM that is
tens of microseconds of Python and C per launch, the bulk of an eager one-token
layer call). With ``MOE_FSM_TRITON_DIRECT_LAUNCH=1`` (experimental, off by
default) ``launch`` does that once per argument signature and then calls the
compiled kernel's launcher directly with the arguments Triton would pass: on an
H200 it cut the host time of a one-token Qwen3-30B-A3B call from 137 to 102 µs
(``fused_experts``) and 180 to 131 µs (modular kernel), and kernels so launched
were captured in CUDA graphs by the benchmark, but the modular-kernel capture
test failed with it when the first launch ran on a side stream (not diagnosed;
docs/perf/vs_vllm.md), so Triton's launch stays the default.

On Hopper and later every kernel ``launch`` starts is a programmatic dependent launch (PDL;
``MOE_FSM_PDL=0`` turns it off): the GPU may start a kernel before the previous one in the stream has
finished (``_kernels._let_next_kernel_start`` says which kernels allow it) or flushed its writes, and each
program waits for them (``griddepcontrol.wait``) before its first read. At decode a layer is four to six
short kernels in a row, and what that saves is part of each launch gap (``docs/perf/decode.md``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType
from typing import Any, Callable

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


_MAX_SIGNATURES = 4096
_compiled: dict[tuple, Any] = {}


def _signature(args: tuple) -> tuple:
    """What Triton specializes a call on, over-approximated: tensors by dtype and 16-byte alignment, other values as they are."""
    return tuple((a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor) else a for a in args)


@functools.lru_cache(maxsize=None)
def _direct_launch_ok(fn: Any, n_args: int, constexpr_names: tuple[str, ...]) -> bool:
    """Direct launches pass runtime arguments then constexprs positionally: only if that is the kernel's parameter order."""
    return tuple(fn.arg_names[n_args:]) == constexpr_names


DIRECT_LAUNCH_ENV = "MOE_FSM_TRITON_DIRECT_LAUNCH"


def direct_launch_enabled() -> bool:
    return os.environ.get(DIRECT_LAUNCH_ENV, "") not in ("", "0")


PDL_ENV = "MOE_FSM_PDL"


@functools.lru_cache(maxsize=None)
def _pdl_capable(device: int) -> bool:
    """An NVIDIA GPU of sm_90 or later (ROCm reports AMD architectures as capabilities too)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_enabled() -> bool:
    """Whether launches on the current device are programmatic dependent launches (module docstring)."""
    if interpreter_enabled() or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return _pdl_capable(torch.cuda.current_device())


def launch(fn: Any, grid: tuple, args: tuple, constexprs: dict, num_warps: int = 4, num_stages: int = 3) -> None:
    """``fn[grid](*args, **constexprs, PDL=.., num_warps=.., num_stages=..)``; in direct-launch mode, bound once per signature.

    Every kernel started here takes a last constexpr ``PDL``, true where the launch is a programmatic
    dependent one; such a kernel waits for the previous one before its first read
    (``_kernels._wait_for_previous_kernel``).

    Direct mode: the first call of a signature goes through Triton (compiling if
    needed) and keeps the compiled kernel; later calls launch it on the current
    stream directly. Launch hooks (profilers) and the interpreter always take
    Triton's path.
    """
    from triton import knobs

    pdl = pdl_enabled()
    constexprs = {**constexprs, "PDL": pdl}
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if pdl:
        options["launch_pdl"] = True
    hooks = knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls
    if not direct_launch_enabled() or interpreter_enabled() or hooks:
        fn[grid](*args, **constexprs, **options)
        return
    device = torch.cuda.current_device()
    key = (fn, device, num_warps, num_stages, tuple(constexprs.values()), _signature(args))
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = fn[grid](*args, **constexprs, **options)
        if _direct_launch_ok(fn, len(args), tuple(constexprs)) and hasattr(kernel, "packed_metadata"):
            if len(_compiled) >= _MAX_SIGNATURES:
                _compiled.clear()
            _compiled[key] = kernel
        return
    kernel.run(
        grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
        _current_stream(device), kernel.function, kernel.packed_metadata, None, None, None, *args, *constexprs.values(),
    )


@functools.lru_cache(maxsize=None)
def _stream_getter() -> Callable[[int], int]:
    from triton.runtime import driver

    return driver.active.get_current_stream


def _current_stream(device: int) -> int:
    return _stream_getter()(device)
