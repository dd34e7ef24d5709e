"""One token's layer in one launch (``fused.decode_layer``, ``_kernels.decode_layer_kernel``).

On the GPU a persistent grid runs the w1 tiles (each split over several programs' K steps where the tiles are few, the
last split to arrive summing them), waits at a grid barrier and runs the w2 tiles, the last of each output tile's slots
to arrive summing them. Triton's interpreter runs programs one after another, so a barrier there would
spin forever: under it the same kernel runs as two launches (phase 1, then phase 2) on a grid of
``INTERPRETER_DECODE_PROGRAMS`` programs, each taking several tiles, which checks the tiles, the activation, the
router weights, slots of another rank and the last arrival's sum against float64 with the output poisoned first
(``TRITON_INTERPRET=1 python3 -m pytest tests/kernels/test_triton_decode_layer.py``; float16, which the interpreter
computes). The barrier itself, the grid bound and graph replays run on the GPU:
``tests/gpu/test_triton_decode_layer.py``. The grid's bound, the w1 splits, the default's rule
(``config.takes_one_launch``) and the argument checks are tested here on the CPU; that the default off a CUDA device
launches what it did before, by the launch lists of ``test_triton_launch.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_fsm.kernels.reference import moe_reference
from moe_fsm.kernels.triton_moe.config import (
    GemmConfig, MoEConfig, decode_layer_programs, decode_layer_w1_splits, takes_one_launch,
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


@interpreter
@pytest.mark.parametrize("k,n", [(160, 64), (150, 40)])  # 5 K steps of 32 in 2 splits (3, 2); a partial last step
def test_split_w1_matches_float64(poisoned, monkeypatch, k, n):
    """w1's K steps split over programs (the last split of a tile to arrive sums them in split order) against
    float64: a slot of another rank among them, programs taking several items each."""
    from moe_fsm.kernels.triton_moe import fused, fused_experts

    splits = []
    launch = fused.launch
    monkeypatch.setattr(fused, "launch",
                        lambda fn, grid, args, *a: (splits.append(args[16]), launch(fn, grid, args, *a)))
    x, w1, w2, weights, ids = _layer(k + n, 16, 3, k, n, True)
    ref = moe_reference(x, w1.double(), w2.double(), weights * (ids >= 0), ids.clamp(min=0))
    out = torch.full((1, k), math.nan, dtype=torch.float16)
    fused_experts(x, w1, w2, weights, ids, out=out, config=_config(32, 32, 32, 32), one_launch=True)
    assert splits == [2, 2]  # 6 w1 tiles, 16 resident programs under the interpreter: 2 splits, both phases
    assert bool(torch.isfinite(out).all())
    assert float((out.double() - ref).norm() / ref.norm()) <= TOL


@pytest.mark.parametrize("work,resident,programs", [
    (448, 264, 264),  # past what is resident: the programs loop over the items
    (256, 264, 256),  # one program an item
    (40, 264, 40),
    (448, 0, 0),  # the compiled kernel does not fit: the caller keeps its launches
])
def test_the_grid_never_passes_what_is_resident(work, resident, programs):
    assert decode_layer_programs(work, resident) == programs


@pytest.mark.parametrize("tiles,k_steps,resident,expected", [
    (48, 16, 264, (4, 4)),  # Qwen3-30B-A3B TP4: 5 fit, 16 steps in 4s: 4 splits, each with work
    (48, 16, 396, (8, 2)),
    (16, 3, 264, (3, 1)),  # at most one split per K step
    (128, 12, 264, (2, 6)),
    (192, 16, 264, (1, 16)),  # two splits a tile would pass what is resident
    (896, 32, 264, (1, 32)),
    (48, 1, 264, (1, 1)),
])
def test_w1_splits_fill_the_resident_programs(tiles, k_steps, resident, expected):
    splits, per_split = decode_layer_w1_splits(tiles, k_steps, resident)
    assert (splits, per_split) == expected
    assert tiles * splits <= max(resident, tiles) and (splits - 1) * per_split < k_steps <= splits * per_split


def _decode_tiles(block_n1: int = 32, swap_ab: bool = True) -> MoEConfig:
    return MoEConfig(16, GemmConfig(block_n1, 128, 1, 4, 4, swap_ab=swap_ab),
                     GemmConfig(64, 128, 1, 4, 4, swap_ab=True))


@pytest.mark.parametrize("tokens,fp8,config,top_k,n,sms,takes", [
    (1, False, _decode_tiles(), 8, 192, 132, True),  # Qwen3-30B-A3B TP4: 96 w1 programs, the one point it won
    (1, False, _decode_tiles(), 10, 256, 132, False),  # Qwen3-Next TP2: 160, slower as one launch
    (1, False, _decode_tiles(), 8, 384, 132, False),  # Qwen3-30B-A3B TP2: 192
    (1, False, _decode_tiles(16), 8, 192, 132, False),  # narrower w1 tiles: 192 programs
    (1, False, _decode_tiles(), 8, 192, 96, False),  # as many programs as SMs
    (1, False, _decode_tiles(), 8, 192, 0, False),  # off a CUDA device
    (1, False, _decode_tiles(swap_ab=False), 8, 192, 132, False),  # not the decode tiles it was measured with
    (2, False, _decode_tiles(), 8, 192, 132, False),
    (1, True, _decode_tiles(), 8, 192, 132, False),
])
def test_default_takes_one_launch_only_where_w1_leaves_sms_idle(tokens, fp8, config, top_k, n, sms, takes):
    assert takes_one_launch(tokens, fp8, config, top_k, n, sms) is takes


@needs_triton_jit
@pytest.mark.parametrize("bad,match", [
    (dict(one_launch="yes"), "one_launch must be True, False or None"),
    (dict(one_launch=1), "one_launch must be True, False or None"),
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
