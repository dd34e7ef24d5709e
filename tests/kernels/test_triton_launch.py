"""How ``_runtime.launch`` starts the pointer-path kernels, on CPU: no GPU needed.

On Hopper and later each launch is a programmatic dependent one (``launch_pdl``) and the kernel gets
``PDL=True``, which makes its programs wait for the previous kernel before their first read; with
``MOE_FSM_PDL=0``, below sm_90 and under Triton's interpreter it is a plain launch with ``PDL=False``. Every
launch ``fused_experts`` makes on the pointer path (alignments, quantizers, GEMMs, the top-k sum) is recorded
and bound to its kernel by Triton's binder for sm_90.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from moe_fsm.kernels.triton_moe import _runtime  # noqa: E402
from moe_fsm.kernels.triton_moe.config import GemmConfig, MoEConfig  # noqa: E402
from moe_fsm.kernels.triton_moe.fused import Fp8Spec  # noqa: E402
from triton_launches import Recorder, bind, record_layer_launches  # noqa: E402

# Under TRITON_INTERPRET=1, set when Triton is imported, the kernels are the interpreter's functions: there is no JIT
# binder to bind a launch with, and no JITFunction to read the arguments of.
needs_jit = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                               reason="binds launches with Triton's JIT binder: needs Triton, not its interpreter")


@pytest.fixture
def hopper(monkeypatch):
    """``launch`` as it runs on an sm_90 device (the capability is the only thing it asks the device)."""
    monkeypatch.delenv(_runtime.PDL_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_runtime, "_pdl_capable", lambda device: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _launch_kwargs(**constexprs) -> dict:
    calls = []
    _runtime.launch(Recorder(None, calls), (1,), (), constexprs, num_warps=8, num_stages=2)
    (_, _, _, kwargs), = calls
    return kwargs


def test_launches_are_programmatic_dependent_on_hopper(hopper):
    assert _launch_kwargs(BLOCK=64) == dict(BLOCK=64, PDL=True, num_warps=8, num_stages=2, launch_pdl=True)


@pytest.mark.parametrize("off", ["env", "capability", "interpreter"])
def test_plain_launches_where_pdl_is_off(hopper, monkeypatch, off):
    if off == "env":
        monkeypatch.setenv(_runtime.PDL_ENV, "0")
    elif off == "capability":
        monkeypatch.setattr(_runtime, "_pdl_capable", lambda device: False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _launch_kwargs(BLOCK=64) == dict(BLOCK=64, PDL=False, num_warps=8, num_stages=2)


@pytest.mark.parametrize("hip,capability,expected", [(None, (9, 0), True), (None, (10, 0), True),
                                                     (None, (8, 9), False), ("6.2", (9, 4), False)])
def test_pdl_needs_an_nvidia_gpu_of_sm90_or_later(monkeypatch, hip, capability, expected):
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    assert _runtime._pdl_capable.__wrapped__(0) is expected


@needs_jit
def test_every_kernel_launch_starts_takes_pdl_last():
    """``launch`` appends ``PDL`` after the caller's constexprs: each kernel must declare it last."""
    from triton.runtime.jit import JITFunction

    from moe_fsm.kernels.triton_moe import _kernels

    kernels = {name: fn for name, fn in vars(_kernels).items() if isinstance(fn, JITFunction) and name.endswith("_kernel")}
    assert len(kernels) >= 10
    for name, fn in kernels.items():
        assert fn.arg_names[-1] == "PDL", name


DECODE = MoEConfig(16, GemmConfig(32, 128, 1, 4, 4, swap_ab=True), GemmConfig(64, 128, 1, 4, 3, swap_ab=True))
PREFILL = MoEConfig(64, GemmConfig(64, 64, 8, 4, 3), GemmConfig(128, 64, 8, 4, 3))
# (fp8 weight layout, tokens, config, the kernels one call launches, in order); 9 tokens, past
# align.UNSORTED_MAX_TOKENS, sort in one program (8 of this small layer's tokens would skip the sort)
LAYER_CASES = [
    (None, 1, DECODE, ["moe_gemm_kernel", "moe_gemm_kernel", "topk_sum_kernel"]),
    (None, 9, DECODE, ["align_small_kernel", "moe_gemm_kernel", "moe_gemm_kernel", "topk_sum_kernel"]),
    (None, 300, PREFILL,
     ["align_count_kernel", "align_scatter_kernel", "moe_gemm_kernel", "moe_gemm_kernel", "topk_sum_kernel"]),
    ("channel", 9, DECODE,
     ["row_quant_kernel", "align_small_kernel", "moe_gemm_kernel", "row_quant_kernel", "moe_gemm_kernel",
      "topk_sum_kernel"]),
    ("tensor", 300, PREFILL,
     ["tensor_amax_kernel", "row_quant_kernel", "align_count_kernel", "align_scatter_kernel", "moe_gemm_kernel",
      "tensor_amax_kernel", "row_quant_kernel", "moe_gemm_kernel", "topk_sum_kernel"]),
    ("block", 9, MoEConfig(16, GemmConfig(128, 128, 1, 4, 3), GemmConfig(128, 128, 1, 4, 3)),
     ["group_quant_kernel", "align_small_kernel", "moe_gemm_kernel", "moe_gemm_kernel", "topk_sum_kernel"]),
]


@needs_jit
@pytest.mark.parametrize("fp8,num_tokens,config,expected", LAYER_CASES,
                         ids=[f"{f}-{t}" for f, t, _, _ in LAYER_CASES])
def test_every_layer_launch_binds_with_pdl(hopper, monkeypatch, fp8, num_tokens, config, expected):
    """What ``fused_experts`` launches for one call, each launch bound to its kernel with ``PDL=True``."""
    from moe_fsm.kernels.triton_moe import fused
    from moe_fsm.kernels.triton_moe.quant import FP8_DTYPE

    calls = record_layer_launches(monkeypatch)
    monkeypatch.setattr(fused, "hopper_usable", lambda *args: False)
    experts, n, k, top_k = 4, 256, 512, 4
    dt = FP8_DTYPE if fp8 else torch.bfloat16
    w1, w2 = torch.zeros(experts, 2 * n, k, dtype=dt), torch.zeros(experts, k, n, dtype=dt)
    kwargs = {}
    if fp8 == "channel":
        kwargs = dict(fp8=Fp8Spec("channel", "token"), w1_scale=torch.ones(experts, 2 * n), w2_scale=torch.ones(experts, k))
    elif fp8 == "tensor":
        kwargs = dict(fp8=Fp8Spec("tensor", "tensor"), w1_scale=torch.ones(experts), w2_scale=torch.ones(experts))
    elif fp8 == "block":
        kwargs = dict(fp8=Fp8Spec("block", "group"), w1_scale=torch.ones(experts, 2 * n // 128, k // 128),
                      w2_scale=torch.ones(experts, k // 128, n // 128))
    ids = (torch.arange(num_tokens * top_k, dtype=torch.int32) % experts).reshape(num_tokens, top_k)
    fused.fused_experts(torch.zeros(num_tokens, k, dtype=torch.bfloat16), w1, w2,
                        torch.full(ids.shape, 1 / top_k), ids, config=config, **kwargs)
    assert [fn.__name__ for fn, _, _, _ in calls] == expected
    for fn, _, args, launch_kwargs in calls:
        assert launch_kwargs["launch_pdl"] is True
        _, constexprs = bind(fn, args, launch_kwargs)
        assert constexprs[(fn.arg_names.index("PDL"),)] is True
