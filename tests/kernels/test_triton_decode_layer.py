"""One token's layer in one launch (``fused.decode_layer``, ``_kernels.decode_layer_kernel``).

On the GPU a persistent grid runs the w1 tiles, waits at a grid barrier and runs the w2 tiles, the last of each output
tile's slots to arrive summing them. Triton's interpreter runs programs one after another, so a barrier there would
spin forever: under it the same kernel runs as two launches (phase 1, then phase 2) on a grid of
``INTERPRETER_DECODE_PROGRAMS`` programs, each taking several tiles, which checks the tiles, the activation, the
router weights, slots of another rank and the last arrival's sum against float64 with the output poisoned first
(``TRITON_INTERPRET=1 python3 -m pytest tests/kernels/test_triton_decode_layer.py``; float16, which the interpreter
computes). The barrier itself, the grid bound and graph replays run on the GPU:
``tests/gpu/test_triton_decode_layer.py``. The grid's bound and the argument checks are tested here on the CPU; that
the default (``one_launch=False``) launches what it did before, by the launch lists of ``test_triton_launch.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_fsm.kernels.reference import moe_reference
from moe_fsm.kernels.triton_moe.config import (
    DECODE_LAYER_PROGRAMS_PER_SM, GemmConfig, MoEConfig, decode_layer_programs,
)

from triton_launches import interpreter, needs_triton_jit

TOL = 1e-2  # fp16 operands and intermediate, fp32 accumulation


def _config(block_n1: int, block_k1: int, block_n2: int, block_k2: int) -> MoEConfig:
    return MoEConfig(16, GemmConfig(block_n1, block_k1, 1, 4, 2, swap_ab=True),
                     GemmConfig(block_n2, block_k2, 1, 4, 2, swap_ab=True))


def _layer(seed: int, experts: int, top_k: int, k: int, n: int, foreign_slot: bool):
    gen = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(experts, 2 * n, k, generator=gen) / k**0.5).half()
    w2 = (torch.randn(experts, k, n, generator=gen) / n**0.5).half()
    x = torch.randn(1, k, generator=gen).half()
    ids = torch.randperm(experts, generator=gen)[:top_k].reshape(1, top_k).to(torch.int32)
    if foreign_slot and top_k > 1:
        ids[0, 1] = -1  # another rank's expert
    weights = torch.softmax(torch.randn(1, top_k, generator=gen), -1)
    return x, w1, w2, weights, ids


@interpreter
@pytest.mark.parametrize("top_k,foreign_slot", [(1, False), (3, True), (10, False)])
@pytest.mark.parametrize("k,n,tiles", [
    (64, 48, (16, 32, 32, 16)),  # whole K steps both GEMMs; 3 w1 tiles a slot, 2 w2 tiles
    (80, 40, (16, 32, 32, 32)),  # the last K step of both GEMMs is partial, and so are the last tiles
])
def test_one_token_matches_float64(poisoned, top_k, foreign_slot, k, n, tiles):
    from moe_fsm.kernels.triton_moe import fused_experts

    x, w1, w2, weights, ids = _layer(top_k * 100 + k, 16, top_k, k, n, foreign_slot)
    ref = moe_reference(x, w1.double(), w2.double(), weights * (ids >= 0), ids.clamp(min=0))
    out = torch.full((1, k), math.nan, dtype=torch.float16)
    fused_experts(x, w1, w2, weights, ids, out=out, config=_config(*tiles), one_launch=True)
    assert bool(torch.isfinite(out).all())
    assert float((out.double() - ref).norm() / ref.norm()) <= TOL


@interpreter
@pytest.mark.parametrize("activation,limit", [("gelu", None), ("swigluoai", 7.0)])
def test_other_activations_match_float64(poisoned, activation, limit):
    from moe_fsm.kernels.triton_moe import fused_experts

    x, w1, w2, weights, ids = _layer(7, 8, 2, 64, 32, False)
    ref = moe_reference(x, w1.double(), w2.double(), weights, ids, activation=activation, swiglu_limit=limit)
    out = torch.full((1, 64), math.nan, dtype=torch.float16)
    fused_experts(x, w1, w2, weights, ids, out=out, config=_config(16, 32, 32, 16), activation=activation,
                  swiglu_limit=limit, one_launch=True)
    assert float((out.double() - ref).norm() / ref.norm()) <= TOL


@interpreter
def test_router_weight_on_input(poisoned):
    from moe_fsm.kernels.triton_moe import fused_experts

    x, w1, w2, weights, ids = _layer(11, 8, 1, 64, 32, False)
    weights = weights * 0.3  # top-1 softmax is 1: a weight that is not, so applying it twice would show
    ref = moe_reference(x, w1.double(), w2.double(), weights, ids, apply_router_weight_on_input=True)
    out = torch.full((1, 64), math.nan, dtype=torch.float16)
    fused_experts(x, w1, w2, weights, ids, out=out, config=_config(16, 32, 32, 16), apply_router_weight_on_input=True,
                  one_launch=True)
    assert float((out.double() - ref).norm() / ref.norm()) <= TOL


@interpreter
def test_no_local_slot_gives_zeros(poisoned):
    from moe_fsm.kernels.triton_moe import fused_experts

    x, w1, w2, weights, _ = _layer(5, 8, 2, 64, 32, False)
    out = torch.full((1, 64), math.nan, dtype=torch.float16)
    fused_experts(x, w1, w2, weights, torch.tensor([[-1, 9]], dtype=torch.int32), out=out,
                  config=_config(16, 32, 32, 16), one_launch=True)
    assert bool((out == 0).all())


@pytest.mark.parametrize("work,resident,sms,programs", [
    (448, 264, 132, 132 * DECODE_LAYER_PROGRAMS_PER_SM),  # the SMs bound it
    (40, 264, 132, 40),  # fewer tiles than SMs: one program a tile
    (448, 100, 132, min(100, 132 * DECODE_LAYER_PROGRAMS_PER_SM)),  # never past what the device holds at once
    (448, 0, 132, 0),  # the compiled kernel does not fit: the caller keeps its launches
])
def test_the_grid_never_passes_what_is_resident(work, resident, sms, programs):
    assert decode_layer_programs(work, resident, sms) == programs


@needs_triton_jit
@pytest.mark.parametrize("bad,match", [
    (dict(one_launch="yes"), "one_launch must be True or False"),
    (dict(one_launch=None), "one_launch must be True or False"),
    (dict(one_launch=True, tokens=2), "one_launch=True runs one token of a bf16/fp16 layer; got 2 tokens"),
])
def test_one_launch_arguments_are_checked(monkeypatch, bad, match):
    from triton_launches import record_layer_launches

    from moe_fsm.errors import KernelInputError
    from moe_fsm.kernels.triton_moe import fused

    record_layer_launches(monkeypatch)
    tokens = bad.pop("tokens", 1)
    w1, w2 = torch.zeros(4, 64, 64, dtype=torch.bfloat16), torch.zeros(4, 64, 32, dtype=torch.bfloat16)
    ids = torch.zeros(tokens, 2, dtype=torch.int32)
    with pytest.raises(KernelInputError, match=match):
        fused.fused_experts(torch.zeros(tokens, 64, dtype=torch.bfloat16), w1, w2, torch.ones(tokens, 2), ids, **bad)


@needs_triton_jit
def test_one_launch_refuses_fp8_layers(monkeypatch):
    from triton_launches import record_layer_launches

    from moe_fsm.errors import KernelInputError
    from moe_fsm.kernels.triton_moe import fused
    from moe_fsm.kernels.triton_moe.quant import FP8_DTYPE

    record_layer_launches(monkeypatch)
    w1, w2 = torch.zeros(4, 64, 64, dtype=FP8_DTYPE), torch.zeros(4, 64, 32, dtype=FP8_DTYPE)
    ids = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(KernelInputError, match="one_launch=True runs one token of a bf16/fp16 layer; got 1 tokens of an"):
        fused.fused_experts(torch.zeros(1, 64, dtype=torch.bfloat16), w1, w2, torch.ones(1, 2), ids, one_launch=True,
                            fp8=fused.Fp8Spec("tensor", "tensor"), w1_scale=torch.ones(4), w2_scale=torch.ones(4))
