"""One token's layer in one launch on a CUDA device (``fused.decode_layer``): the persistent grid, the split w1 tiles'
and the w2 tiles' last-arrival sums and the grid barrier, against the float64 reference (BF16_TOL, as every bf16 layer) and against the
launches it replaces, with unwritten memory poisoned first; then captured in a CUDA graph and replayed twice in a
row and on new routing, where the barrier's word and the tiles' counters must be back at rest after every call (no
memset between replays); and that ``fused_experts``' default takes it exactly where ``config.takes_one_launch`` says.
The CPU runs the same code as two launches under Triton's interpreter (``tests/kernels/test_triton_decode_layer.py``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

from moe_fsm.kernels.triton_moe import _runtime, fused, fused_experts  # noqa: E402
from moe_fsm.kernels.triton_moe._runtime import device_name, kernels  # noqa: E402
from moe_fsm.kernels.triton_moe.config import get_config, takes_one_launch  # noqa: E402

from .moe_gpu_cases import (  # noqa: E402
    MIXTRAL_8X7B, QWEN3_30B, Shape, float_weights, hidden_states, poison_allocator, reference, rel_err, routing,
)

BF16_TOL = 1e-2
LAUNCHES_TOL = 1e-2  # the two-launch path rounds each slot's w2 row to bf16 before summing; this sums in fp32

CASES = [
    (QWEN3_30B, {}),
    (MIXTRAL_8X7B, {}),  # 2 slots, 14336-wide intermediate
    (Shape("qwen3-30b-a3b-tp4", 128, 2048, 192, 8), {}),  # where the default takes it; w1's K steps split
    (Shape("qwen3-next-tp2", 512, 2048, 256, 10), {}),  # top-k 10 over 512 experts; w1 split, w2 tiles past resident
    (Shape("gpt-oss-tp2", 128, 2880, 1440, 4), dict(activation="swigluoai", swiglu_limit=7.0)),  # partial K steps
    (Shape("top1-on-input", 16, 2048, 1024, 1), dict(apply_router_weight_on_input=True)),  # top-k 1, one w2 slot, split
]


def _config(shape: Shape):
    return get_config(device_name(torch.device("cuda")), shape.num_experts, shape.intermediate, shape.hidden,
                      shape.top_k, 1, "bfloat16", None)


@pytest.mark.parametrize("shape,kwargs", CASES, ids=[c[0].name for c in CASES])
def test_one_launch_decode_layer(monkeypatch, shape, kwargs):
    grids = []
    launch = fused.launch
    monkeypatch.setattr(fused, "launch", lambda fn, grid, *a, **k: (grids.append((fn, grid)), launch(fn, grid, *a, **k)))
    w1, w2 = float_weights(shape)
    x = hidden_states(1, shape.hidden, torch.bfloat16, seed=3)
    g, ids = routing(1, shape.num_experts, shape.top_k, seed=3)
    if shape.top_k > 2:
        ids[0, 1] = -1  # a slot of another rank
    if kwargs.get("apply_router_weight_on_input"):
        g = g * 0.6
    ref_kwargs = dict(kwargs)
    config = _config(shape)
    poison_allocator()
    out = torch.full((1, shape.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    # decode_layer itself, so that a grid the device cannot hold (None: the caller's fallback) fails here
    assert fused.decode_layer(x, w1, w2, g, ids, out, swiglu_limit=kwargs.get("swiglu_limit"),
                              activation=kwargs.get("activation", "silu"),
                              apply_router_weight_on_input=kwargs.get("apply_router_weight_on_input", False),
                              config=config) is out
    assert bool(torch.isfinite(out).all())
    assert rel_err(out, reference(x, w1, w2, g, ids, **ref_kwargs)) < BF16_TOL
    launches = fused_experts(x, w1, w2, g, ids, one_launch=False, **kwargs)
    assert rel_err(out, launches.to(torch.float64)) < LAUNCHES_TOL
    again = fused_experts(x, w1, w2, g, ids, one_launch=True, **kwargs)
    assert torch.equal(again, out)  # the slots of a tile summed in slot order, whichever program came last

    # one launch, whose grid never passes what the compiled kernel's occupancy puts on the device at once
    kernel = kernels().decode_layer_kernel
    assert [fn for fn, _ in grids[-1:]] == [kernel]
    resident = [n for key, n in _runtime._occupancy.items() if key[0] is kernel]
    assert resident and 1 <= grids[-1][1][0] <= min(resident)

    g2, ids2 = routing(1, shape.num_experts, shape.top_k, seed=4)
    g_in, ids_in = g.clone(), ids.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first = fused_experts(x, w1, w2, g_in, ids_in, one_launch=True, **kwargs)
        # a second layer call inside the same graph: the barrier word and counters are reused at once
        second = fused_experts(first, w1, w2, g_in, ids_in, one_launch=True, **kwargs)
    for _ in range(2):  # twice in a row, the same inputs: the same outputs
        first.fill_(float("nan"))
        second.fill_(float("nan"))
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(first, out)
        assert rel_err(second, reference(out, w1, w2, g, ids, **ref_kwargs)) < BF16_TOL
    g_in.copy_(g2 * 0.6 if kwargs.get("apply_router_weight_on_input") else g2)
    ids_in.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(first, reference(x, w1, w2, g_in, ids2, **ref_kwargs)) < BF16_TOL
    # at rest after every call: the barrier word's low 31 bits (its top bit flips each time) and every tile counter
    for counters in fused._decode_workspace.values():
        assert int(counters[0]) & 0x7FFFFFFF == 0 and int(counters[1:].count_nonzero()) == 0


@pytest.mark.parametrize("shape,takes", [
    (Shape("qwen3-30b-a3b-tp4", 128, 2048, 192, 8), True),  # 96 w1 programs on the launches: fewer than the SMs
    (Shape("qwen3-next-tp2", 512, 2048, 256, 10), False),  # 160: measured slower as one launch
], ids=lambda v: getattr(v, "name", str(v)))
def test_default_takes_one_launch_by_the_rule(monkeypatch, shape, takes):
    """fused_experts' default (one_launch=None) launches the one-launch kernel exactly where
    ``config.takes_one_launch`` says, on this device's SM count (an H100's and an H200's 132), and not at 2 tokens."""
    kernels_launched = []
    launch = fused.launch
    monkeypatch.setattr(fused, "launch", lambda fn, *a, **k: (kernels_launched.append(fn), launch(fn, *a, **k)))
    w1, w2 = float_weights(shape)
    decode_kernel = kernels().decode_layer_kernel
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    config = _config(shape)
    rule = takes_one_launch(1, False, config, shape.top_k, shape.intermediate, sms)
    if sms == 132:
        assert rule is takes
    for tokens in (1, 2):
        x = hidden_states(tokens, shape.hidden, torch.bfloat16, seed=5)
        g, ids = routing(tokens, shape.num_experts, shape.top_k, seed=5)
        kernels_launched.clear()
        out = fused_experts(x, w1, w2, g, ids)
        assert rel_err(out, reference(x, w1, w2, g, ids)) < BF16_TOL
        assert (kernels_launched == [decode_kernel]) is (rule and tokens == 1)

