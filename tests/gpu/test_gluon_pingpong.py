"""The Gluon ping-pong kernel (``MoEConfig.gluon`` on bf16 / fp16 layers) on an sm_90+ device, against float64.

Every case asserts that the Gluon path really ran (``gluon_usable``), then compares the layer with the float64
reference (1e-2 relative Frobenius, as the other bf16 kernels) and with the pointer-load kernel on the same tiles.
That twin computes the activation from the fp32 sums where the ping-pong kernel rounds gate and up to the
output dtype first (as vLLM's separate activation kernel reads them), so the two differ by about one rounding of
the intermediate: 6e-3. Outputs and the allocator's free blocks are NaN-poisoned before each call.

The cases cover both math warpgroups over many tiles a program (the turn barriers, the shared ring), programs
with one tile or none (a handful of tokens), w1 through the Triton TMA kernel (no ``gather_input``), ragged
widths, fp16, every activation, dropped slots, the router weight on the input, and CUDA-graph replays.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

from moe_fsm.kernels.triton_moe import GemmConfig, MoEConfig, align_tokens, fused_experts  # noqa: E402
from moe_fsm.kernels.triton_moe.hopper import gluon_kernels_available, gluon_usable  # noqa: E402

from .moe_gpu_cases import (  # noqa: E402
    MIXTRAL_8X7B,
    QWEN3_30B,
    Shape,
    float_weights,
    hidden_states,
    poison_allocator,
    reference,
    rel_err,
    routing,
)

BF16_TOL = 1e-2
ROUNDED_INTERMEDIATE_TOL = 6e-3

if torch.cuda.is_available() and not gluon_kernels_available(torch.cuda.current_device()):
    pytest.skip("the Gluon kernels need a Hopper (sm_90) or later GPU and Triton's Gluon", allow_module_level=True)

# K = 576 is 9 K steps of 64, N = 320 five; w2's 576 output columns end inside a 128-wide tile (its upper weight
# box reads the next expert's rows, masked on store)
RAGGED = Shape("ragged", 8, 576, 320, 4)
# Qwen3-30B-A3B with 32 experts: the float64 reference multiplies every expert a batch hits
QWEN3_E32 = Shape("qwen3-e32", 32, QWEN3_30B.hidden, QWEN3_30B.intermediate, 8)


def _config(block_m=128, bn1=64, bn2=128, bk=64, stages=4, group_m=8, gather=True):
    ping_pong = dict(persistent=True, warp_specialize=True)
    w1 = (GemmConfig(bn1, bk, group_m, 4, stages, **ping_pong) if gather
          else GemmConfig(2 * bn1, bk, group_m, 8, stages, persistent=True, paired=True, flatten=True))
    return MoEConfig(block_m, w1, GemmConfig(bn2, bk, group_m, 4, stages, **ping_pong), False, True, gather, True)


def _pointer_twin(config: MoEConfig) -> MoEConfig:
    return MoEConfig(config.block_m, GemmConfig(config.w1.block_n, config.w1.block_k, 8, 4, 3),
                     GemmConfig(config.w2.block_n, config.w2.block_k, 8, 4, 3))


def _run(x, w1, w2, g, ids, config, **kw):
    taken = gluon_usable(config, align_tokens(ids, w1.shape[0], config.block_m), x, w1, w2, block_fp8=False,
                         scaled=False)
    assert taken, "Gluon path not taken"
    poison_allocator()
    out = torch.full((x.shape[0], w2.shape[1]), float("nan"), dtype=x.dtype, device="cuda")
    return fused_experts(x, w1, w2, g, ids, config=config, out=out, **kw)


def _check(shape, num_tokens, config, dtype=torch.bfloat16, seed=None, **kw):
    seed = num_tokens if seed is None else seed
    w1, w2 = float_weights(shape, dtype)
    x = hidden_states(num_tokens, shape.hidden, dtype, seed=seed)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=seed)
    out = _run(x, w1, w2, g, ids, config, **kw)
    assert not out.isnan().any()
    assert rel_err(out, reference(x, w1, w2, g, ids, **kw)) < BF16_TOL
    twin = fused_experts(x, w1, w2, g, ids, config=_pointer_twin(config), **kw)
    assert rel_err(out, twin.double()) < ROUNDED_INTERMEDIATE_TOL


@pytest.mark.parametrize(
    "shape,num_tokens,config",
    [
        (QWEN3_E32, 2000, _config()),
        (QWEN3_E32, 2000, _config(gather=False)),
        (QWEN3_E32, 2000, _config(block_m=64)),
        (QWEN3_E32, 2000, _config(bn1=32, bn2=64, group_m=4)),
        (QWEN3_E32, 2000, _config(bk=32, stages=6)),
        (MIXTRAL_8X7B, 700, _config()),
        (MIXTRAL_8X7B, 700, _config(gather=False, stages=3)),
        (RAGGED, 300, _config()),
        (RAGGED, 300, _config(block_m=64, gather=False)),
        # a handful of tokens: most programs get one tile or none, so one math warpgroup may have nothing to do
        (QWEN3_E32, 3, _config()),
        (RAGGED, 1, _config(block_m=64)),
    ],
    ids=["qwen", "qwen-triton-w1", "qwen-bm64", "qwen-narrow", "qwen-bk32", "mixtral", "mixtral-triton-w1",
         "ragged", "ragged-bm64-triton-w1", "qwen-3-tokens", "ragged-1-token"],
)
def test_bf16_matches_reference_and_pointer_kernel(shape, num_tokens, config):
    _check(shape, num_tokens, config)


def test_fp16():
    _check(RAGGED, 500, _config(), dtype=torch.float16)


@pytest.mark.parametrize("activation,limit", [("gelu", None), ("swigluoai", 7.0)])
def test_activations(activation, limit):
    _check(RAGGED, 400, _config(), activation=activation, swiglu_limit=limit)


@pytest.mark.parametrize("on_input", [False, True])
def test_dropped_slots_and_router_weight_on_input(on_input):
    shape, num_tokens = RAGGED, 200
    w1, w2 = float_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=32)
    g, ids = routing(num_tokens, shape.num_experts, 1 if on_input else shape.top_k, seed=32)
    ids[::3, 0] = -1  # slots another rank owns
    kw = dict(apply_router_weight_on_input=on_input)
    out = _run(x, w1, w2, g, ids, _config(), **kw)
    assert rel_err(out, reference(x, w1, w2, g, ids, **kw)) < BF16_TOL
    twin = fused_experts(x, w1, w2, g, ids, config=_pointer_twin(_config()), **kw)
    assert rel_err(out, twin.double()) < ROUNDED_INTERMEDIATE_TOL


@pytest.mark.parametrize("gather", [True, False])
def test_cuda_graph_capture_replays_new_routing(gather):
    shape, num_tokens = QWEN3_E32, 1024
    w1, w2 = float_weights(shape)
    config = _config(gather=gather)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=33)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=33)
    assert gluon_usable(config, align_tokens(ids, shape.num_experts, config.block_m), x, w1, w2, block_fp8=False,
                        scaled=False)
    out = torch.empty(num_tokens, shape.hidden, dtype=torch.bfloat16, device="cuda")
    fused_experts(x, w1, w2, g, ids, out=out, config=config)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts(x, w1, w2, g, ids, out=out, config=config)
    x.copy_(hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=34))
    g2, ids2 = routing(num_tokens, shape.num_experts, shape.top_k, seed=34)
    g.copy_(g2)
    ids.copy_(ids2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(x, w1, w2, g2, ids2)) < BF16_TOL


def test_fp8_per_channel_layers_take_the_triton_kernels():
    """No Gluon kernel scales per channel: such a layer whose config asks for gluon runs the Triton TMA tiles."""
    shape = RAGGED
    w1, w2 = float_weights(shape)
    x = hidden_states(64, shape.hidden, torch.bfloat16, seed=35)
    g, ids = routing(64, shape.num_experts, shape.top_k, seed=35)
    assert not gluon_usable(_config(), align_tokens(ids, shape.num_experts, 128), x, w1, w2, block_fp8=False,
                            scaled=True)
