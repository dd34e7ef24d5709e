"""``wire_launch.launch``: the wire kernels started through their compiled launcher, on CPU (no GPU needed).

A stand-in CUDA driver (its launcher records what it is handed, loading a binary does nothing) lets Triton compile
the kernels for sm_90 with its own ptxas and go all the way to the driver call on CPU tensors. The kernels are a
fresh copy of ``_wire_triton`` whose compiled kernels this file alone holds, so no stand-in launcher outlives it.
Checked: a direct launch hands the launcher what Triton's own launch hands it; a call Triton would specialize
differently (an integer that stops being a multiple of 16, a tensor that loses its 16-byte alignment) compiles
again through Triton instead of reusing a kernel; the key agrees with Triton's binder on every pair of argument
tuples; and Triton's path is kept where the compiled kernel or the parameters are not what the direct call
expects, while a launch hook is set, and with ``MOE_FSM_WIRE_DIRECT_LAUNCH=0``.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from moe_fsm.prepare_finalize import wire_launch  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="compiles the kernels with Triton's JIT: needs Triton, not its interpreter")

WIRE_KERNELS = Path(wire_launch.__file__).with_name("_wire_triton.py")


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        return 1, 1, 32, 0, 1024  # module, function, registers, spills, most threads a block

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

    def unload_module(self, module):
        pass


class _Driver:
    """An sm_90 device as far as compiling and launching ask; every launch is appended to ``launches``."""

    def __init__(self, launches: list) -> None:
        self.utils = _Utils()
        driver = self

        class Launcher:
            def __init__(self, src, metadata):
                pass

            def __call__(self, *launch_args):
                driver.launches.append(launch_args)

        self.launcher_cls = Launcher
        self.launches = launches

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 7  # what the direct launch must pass on

    def get_device_capability(self, device=0):
        return 9, 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@pytest.fixture
def stand_in(monkeypatch):
    """(fresh kernel module, the launches the stand-in driver received)."""
    from triton.runtime import driver

    launches: list = []
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(wire_launch, "_compiled", {})
    monkeypatch.setattr(wire_launch, "direct_launch", True)
    spec = importlib.util.spec_from_file_location("moe_fsm_test_wire_triton_stand_in", WIRE_KERNELS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    wire_launch._stream_getter.cache_clear()
    monkeypatch.setattr(driver, "_active", _Driver(launches))  # the driver in use before comes back after the test
    try:
        yield module, launches
    finally:
        # The stand-in "loaded" these kernels: no real driver may unload them when they are collected.
        for fn in vars(module).values():
            for kernel_cache, *_ in getattr(fn, "device_caches", {}).values():
                for kernel in kernel_cache.values():
                    kernel.module = None
        wire_launch._stream_getter.cache_clear()
        del sys.modules[spec.name]


def _local_ids_call(rows: int = 40, top_k: int = 8, experts: int = 64, offset: int = 0):
    """(grid, runtime args, constexprs) of a ``local_ids_kernel`` launch as ``wire_kernels.local_ids`` makes it."""
    storage = torch.zeros(rows * top_k + offset, dtype=torch.int64)
    ids = storage[offset:].view(rows, top_k)
    out = torch.empty((rows, top_k), dtype=torch.int64)
    expert_map = torch.full((experts,), -1, dtype=torch.int32)
    return (1,), (out, ids, ids.stride(0), expert_map, rows, top_k, experts), dict(BLOCK_R=512, BLOCK_K=8)


def test_a_direct_launch_hands_the_launcher_what_tritons_launch_does(stand_in) -> None:
    module, launches = stand_in
    fn = module.local_ids_kernel
    grid, args, constexprs = _local_ids_call()
    fn[grid](*args, **constexprs, num_warps=4)  # Triton's own launch
    wire_launch.launch(fn, grid, args, constexprs)  # first with this key: through Triton, kept
    wire_launch.launch(fn, grid, args, constexprs)  # direct
    assert len(launches) == 3
    by_triton, first, direct = launches
    compiled = wire_launch.compiled_for(fn, args, constexprs)
    assert compiled is not None
    assert direct[:5] == (1, 1, 1, 7, compiled.function) and direct[5] is compiled.packed_metadata
    assert direct[6:9] == (None, None, None)  # no launch metadata, no hooks
    assert by_triton[:6] == first[:6] == direct[:6]
    assert by_triton[9:] == first[9:] == direct[9:] == (*args, *constexprs.values())


def test_a_call_triton_would_specialize_differently_compiles_again(stand_in, monkeypatch) -> None:
    module, launches = stand_in
    fn = module.local_ids_kernel
    compiles = []
    original = type(fn).run

    def counted(self, *a, **k):
        compiles.append(k["warmup"])
        return original(self, *a, **k)

    monkeypatch.setattr(type(fn), "run", counted)
    grid, args, constexprs = _local_ids_call(rows=32)
    wire_launch.launch(fn, grid, args, constexprs)
    wire_launch.launch(fn, grid, args, constexprs)
    assert len(compiles) == 1  # the second went direct
    for changed in (_local_ids_call(rows=33), _local_ids_call(rows=32, offset=1), _local_ids_call(rows=1)):
        wire_launch.launch(fn, *changed)
        assert wire_launch.compiled_for(fn, changed[1], changed[2]) is not wire_launch.compiled_for(fn, args, constexprs)
    assert len(compiles) == 4  # rows 33 (not a multiple of 16), ids off 16-byte alignment, rows 1: Triton each time
    wire_launch.launch(fn, *_local_ids_call(rows=48))  # a multiple of 16 again, as 32: the kept kernel
    assert len(compiles) == 4 and len(launches) == 6


def _triton_specialization(fn, args, constexprs):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    return repr(binder(*args, **constexprs, num_warps=4)[1])


def test_the_key_tells_apart_every_pair_tritons_binder_does(stand_in) -> None:
    """Over integers at the edges of Triton's rules (1, multiples of 16, the i32 / i64 / u64 ranges) and tensors
    of two dtypes at aligned and unaligned offsets: equal keys always mean equal specializations."""
    module, _ = stand_in
    fn = module.combine_kernel
    ints = [0, 1, 2, 15, 16, 17, 48, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**40, 2**63, 2**64 - 16]
    storage = torch.zeros(64, dtype=torch.float32)
    tensors = [storage[0:8], storage[1:9], storage[4:12], storage.view(torch.int32)[0:8], storage.view(torch.bfloat16)[2:10]]
    seen: dict[tuple, str] = {}
    for tensor, value in itertools.product(tensors, ints):
        args = (tensor, 16, tensor, value, tensor, value, 7)
        constexprs = dict(WORLD=2, BLOCK=1024)
        key = wire_launch.specialization_key(args)
        specialization = _triton_specialization(fn, args, constexprs)
        assert seen.setdefault(key, specialization) == specialization, (key, specialization)
    assert len(set(seen.values())) == len(seen)  # and no finer than Triton here


def test_tritons_path_where_the_direct_call_does_not_fit(stand_in, monkeypatch) -> None:
    module, launches = stand_in
    fn = module.local_ids_kernel
    grid, args, constexprs = _local_ids_call()
    wire_launch.launch(fn, grid, args, constexprs)
    compiled = wire_launch.compiled_for(fn, args, constexprs)
    assert wire_launch._fits_direct_path(fn, compiled, len(args), tuple(constexprs))
    # constexprs out of the kernel's order: the launcher would get them in the wrong places
    assert not wire_launch._fits_direct_path(fn, compiled, len(args), ("BLOCK_K", "BLOCK_R"))
    # a compiled kernel of another shape (a Triton release without packed_metadata)
    assert not wire_launch._fits_direct_path(fn, object(), len(args), tuple(constexprs))
    wire_launch._compiled.clear()
    monkeypatch.setattr(wire_launch, "_fits_direct_path", lambda *a: False)
    via_triton = []
    original = type(fn).run
    monkeypatch.setattr(type(fn), "run", lambda self, *a, **k: via_triton.append(1) or original(self, *a, **k))
    for _ in range(3):
        wire_launch.launch(fn, grid, args, constexprs)
    assert len(via_triton) == 3 and wire_launch.compiled_for(fn, args, constexprs) is None


@pytest.mark.parametrize("why", ["switched off", "launch hook"])
def test_tritons_path_when_switched_off_or_hooked(stand_in, monkeypatch, why) -> None:
    from triton import knobs

    module, launches = stand_in
    fn = module.local_ids_kernel
    grid, args, constexprs = _local_ids_call()
    wire_launch.launch(fn, grid, args, constexprs)  # kept for the direct path
    hooked = []
    if why == "switched off":
        monkeypatch.setattr(wire_launch, "direct_launch", False)
    else:
        knobs.runtime.launch_enter_hook.add(hooked.append)
    try:
        wire_launch.launch(fn, grid, args, constexprs)
    finally:
        if why == "launch hook":
            knobs.runtime.launch_enter_hook.remove(hooked.append)
    second = launches[-1]
    assert second[6] is not None or why == "switched off"  # Triton's launch: its launch metadata and hooks
    assert second[7] is knobs.runtime.launch_enter_hook
