"""Starting the wire kernels without Triton's per-call binding: the compiled kernel's launcher, called directly.

An eager dispatch + combine launches four to six small Triton kernels, and each ``kernel[grid](...)`` goes
through ``JITFunction.run`` before the driver call: it binds every argument again, specializes each one (dtype,
16-byte alignment, integers equal to 1 or divisible by 16), builds the cache key, looks the compiled kernel up and
asks for launch metadata. For kernels whose work is a few microseconds of GPU time, host time is the call's time:
that binding was 4-17 of the 30-70 µs a wire-kernel launch took on an H200 host, and 5-7 µs (against 2.5-3.4 µs
here) on a CPU with the driver stubbed (docs/perf/distributed.md, "The eager call's host time step by step").

:func:`launch` does that work once per *specialization*: the first call with a given key goes through Triton
(compiling if needed) and keeps the compiled kernel it returns; later calls with the same key call that kernel's
launcher on the current stream with the arguments Triton would pass. The key holds everything Triton specializes
a kernel on for these arguments (:func:`specialization_key`: tensors by dtype and 16-byte alignment, integers by
``== 1``, ``% 16 == 0`` and their integer type, other values as they are), plus the constexprs, ``num_warps`` and
the device, so two calls with one key run one compiled kernel under Triton too.

Triton's path is kept where the direct one cannot be trusted: under the interpreter, while a launch hook is set
(profilers), with ``MOE_FSM_WIRE_DIRECT_LAUNCH=0`` (read at import), and where the compiled kernel or the kernel's
parameters are not the shape this module expects (a Triton release whose ``CompiledKernel`` has no ``packed_metadata`` or
``function``, or constexprs that are not the kernel's last parameters in the order given): then every call takes
Triton's path. ``moe_fsm.kernels.triton_moe._runtime.launch`` does the same for the pointer path's GEMMs behind
an opt-in switch; the wire kernels are plain launches (no PDL), and their integer arguments (row counts,
totals) change from call to call, so they are keyed by what Triton specializes on, not by their values.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

import torch

DIRECT_LAUNCH_ENV = "MOE_FSM_WIRE_DIRECT_LAUNCH"
# Read once: ``launch`` runs several times a call, and an environment lookup costs about as much as the key.
direct_launch = os.environ.get(DIRECT_LAUNCH_ENV, "1") != "0"

_INT32_MIN, _INT32_MAX, _UINT64_FROM = -(1 << 31), (1 << 31) - 1, 1 << 63
# (kernel, compiled kernel) by key; the compiled kernel None where the direct path does not fit (Triton's path is
# taken for that key).
_MAX_KEYS = 4096
_compiled: dict[tuple, Any] = {}


def _specialize(arg: Any) -> Any:
    if type(arg) is int:
        # Triton: 1 becomes a constant, multiples of 16 are marked divisible, and the value picks i32 / i64 / u64.
        return arg == 1, arg & 15 == 0, _INT32_MIN <= arg <= _INT32_MAX, arg >= _UINT64_FROM
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    return type(arg), arg


def specialization_key(args: tuple) -> tuple:
    """What Triton's binder specializes a kernel on for these runtime arguments, as a hashable key.

    Two argument tuples with the same key compile to the same kernel; it may tell apart some that Triton would
    not (a bool's value, say), which only costs one more entry. (An int's entry is a 4-tuple of bools, a
    tensor's starts with a dtype and anything else's with its type, so entries of different kinds never equal.)
    """
    return tuple(map(_specialize, args))


@functools.lru_cache(maxsize=None)
def _triton_runtime() -> tuple[Any, type]:
    """Triton's runtime knobs (launch hooks) and its JIT kernel class, imported on the first launch."""
    from triton import knobs
    from triton.runtime.jit import JITFunction

    return knobs.runtime, JITFunction


def _launch_hooks_set(runtime: Any) -> bool:
    return any(getattr(hook, "calls", hook) for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


def _fits_direct_path(fn: Any, compiled: Any, n_args: int, constexpr_names: tuple[str, ...]) -> bool:
    """The launcher takes the runtime arguments then the constexprs positionally, in the kernel's parameter order."""
    names = tuple(getattr(fn, "arg_names", ()))
    return (
        len(names) == n_args + len(constexpr_names)
        and names[n_args:] == constexpr_names
        and all(hasattr(compiled, attribute) for attribute in ("function", "packed_metadata", "run"))
    )


@functools.lru_cache(maxsize=None)
def _stream_getter() -> Callable[[int], int]:
    from triton.runtime import driver

    return driver.active.get_current_stream


def launch(fn: Any, grid: tuple, args: tuple, constexprs: dict, *, num_warps: int = 4) -> None:
    """``fn[grid](*args, **constexprs, num_warps=num_warps)``, bound once per specialization (module docstring).

    ``args`` are the kernel's runtime parameters in order, ``constexprs`` its remaining (compile-time) ones, in
    the kernel's order.
    """
    runtime, jit_function = _triton_runtime()
    # The interpreter's kernels are not JITFunctions; a profiler's launch hooks need Triton's launch metadata.
    if not direct_launch or type(fn) is not jit_function or _launch_hooks_set(runtime):
        fn[grid](*args, **constexprs, num_warps=num_warps)
        return
    device = torch.cuda.current_device()
    # By the kernel's id (a JITFunction hashes its source digest under a lock); the entry holds the kernel, so the
    # id is not reused while the entry lives.
    key = (id(fn), device, num_warps, *constexprs.values(), specialization_key(args))
    held = _compiled.get(key)
    if held is not None:
        compiled = held[1]
        if compiled is not None:
            compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                         _stream_getter()(device), compiled.function, compiled.packed_metadata, None, None, None,
                         *args, *constexprs.values())
            return
        fn[grid](*args, **constexprs, num_warps=num_warps)
        return
    compiled = fn[grid](*args, **constexprs, num_warps=num_warps)
    if len(_compiled) >= _MAX_KEYS:
        _compiled.clear()
    _compiled[key] = (fn, compiled if _fits_direct_path(fn, compiled, len(args), tuple(constexprs)) else None)


def compiled_for(fn: Any, args: tuple, constexprs: dict, *, num_warps: int = 4, device: Optional[int] = None) -> Any:
    """The compiled kernel :func:`launch` keeps for these arguments (None: not launched yet, or Triton's path)."""
    device = torch.cuda.current_device() if device is None else device
    held = _compiled.get((id(fn), device, num_warps, *constexprs.values(), specialization_key(args)))
    return held[1] if held is not None else None
