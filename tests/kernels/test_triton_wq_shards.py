"""The weight-quantized Triton MoE at K and N that are multiples of 16 only, as tensor-parallel shards are,
in every stored format: MXFP4, INT4/INT8 with group 32/64/128 or channel scales, zero points, activation order.

gpt-oss-120b split over two GPUs has N = 1440, not a multiple of the SPLIT layout's
64-column chunks: the rows are padded with zero codes to whole chunks once, at the
re-layout, and the kernels mask the pad. Every stored format runs here under Triton's
interpreter on CPU (``TRITON_INTERPRET=1``; small shapes, float16 activations since
the interpreter has no bfloat16 arithmetic, so the plain-Triton dequantization),
against float64 on the weights the kernel holds, outputs poisoned with NaN first.
Triton picks the interpreter when the kernels are defined, so these run only in a
process started with it: ``TRITON_INTERPRET=1 python3 -m pytest tests/kernels/test_triton_wq_shards.py``
(the shape checks run everywhere). ``tests/gpu/test_triton_wq.py`` runs realistic
shard shapes on CUDA.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch_moe_cases import NVFP4_WEIGHT_ONLY, seed_for
from triton_launches import interpreter

from moe_fsm.engine.engine import Engine
from moe_fsm.engine.presets import LayerSpec
from moe_fsm.errors import KernelInputError
from moe_fsm.decision import select
from moe_fsm.experts.triton_wq_experts import TritonMxfp4Experts, TritonNvfp4Experts, TritonWna16Experts
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import preset as platform_preset
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.kernels import intq
from moe_fsm.kernels.reference import moe_reference
from moe_fsm.kernels.triton_wq import WeightQuant, fused_wq_experts
from moe_fsm.kernels.triton_wq.fused import (
    MIN_K_TILES_PER_SLICE, MXFP4_MANY_PAIR_TILE, MXFP4_MID_TILE, PROGRAMS_PER_SM, WqConfig, _epilogue_block,
    decode_tile, default_wq_config, get_wq_config, relayout_nibbles, sort_act_order, split_columns, undo_relayout_nibbles,
)
from moe_fsm.modular.kernel import ModularKernel
from moe_fsm.prepare_finalize.local import LocalPrepareFinalize
from moe_fsm.quantize.weights import dequantize_weights, interleave_gate_up, quantize_weights
from moe_fsm.runtime import build
from moe_fsm.trace import schema as trace_schema

TOL = 1e-2  # fp16 operands and intermediate, fp32 accumulation (measured 3e-4 to 1e-3)
# (scheme, K, N): reduction lengths that are multiples of 16 (and of the scale group) but not of 64 where the
# format allows it; group 64 and 128 layers have both multiples of 64 by construction, so their rows are odd
SHAPES = {
    "mxfp4 bias": (QuantScheme.mxfp4(), 96, 160),
    "int4 g32": (QuantScheme.int_wna16(4, 32), 160, 96),
    "int4 g32 zp": (QuantScheme.int_wna16(4, 32, True, "compressed-tensors"), 96, 224),
    "int4 g64 zp": (QuantScheme.int_wna16(4, 64, True, "compressed-tensors"), 192, 320),
    "int4 g128": (QuantScheme.int_wna16(4, 128), 384, 128),
    "int4 g128 zp": (QuantScheme.int_wna16(4, 128, True, "awq"), 384, 128),
    "int4 channel": (QuantScheme.int_wna16(4, -1), 80, 48),
    "int8 g32 zp": (QuantScheme.int_wna16(8, 32, True, "compressed-tensors"), 96, 160),
    "int8 channel": (QuantScheme.int_wna16(8, -1), 80, 48),
    "int4 g32 act-order": (QuantScheme.int_wna16(4, 32, act_order=True), 160, 96),
    "int4 g64 zp act-order": (QuantScheme.int_wna16(4, 64, True, "compressed-tensors", act_order=True), 192, 320),
    "int8 g32 act-order": (QuantScheme.int_wna16(8, 32, act_order=True), 96, 160),
}
# the third splits both GEMMs along K (w1 into 2 slices, w2 into as many as its K tiles allow); the last chains each K
# tile's dots onto the running sums (``chain_acc``, the many-pair tiles' form)
CONFIGS = [WqConfig(16, 32, 64, 4, 1), WqConfig(16, 16, 128, 4, 1), WqConfig(16, 32, 64, 4, 1, split_k=2, w2_split_k=3),
           WqConfig(32, 32, 64, 4, 1, chain_acc=True)]


def _problem(name: str, tokens: int, experts: int = 4, top_k: int = 2):
    scheme, k, n = SHAPES[name]
    gen = torch.Generator().manual_seed(seed_for(("wq-shard", name, tokens)))
    w1 = torch.randn(experts, 2 * n, k, generator=gen) / k**0.5
    w2 = torch.randn(experts, k, n, generator=gen) / n**0.5
    w1q, w2q, scales = quantize_weights(w1, w2, scheme)
    w1f, w2f = dequantize_weights(w1q, w2q, scales, scheme, torch.float64)
    bias = name.startswith("mxfp4")
    b1 = torch.randn(experts, 2 * n, generator=gen) * 0.1 if bias else None
    b2 = torch.randn(experts, k, generator=gen) * 0.1 if bias else None
    x = torch.randn(tokens, k, generator=gen).to(torch.float16)
    g, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=gen), -1), top_k, dim=-1)
    ref = moe_reference(x, w1f, w2f, g, ids, activation="silu", w1_bias=b1, w2_bias=b2)
    return scheme, x, w1q, w2q, scales, b1, b2, g, ids.to(torch.int32), ref


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.to(torch.float64) - ref).norm() / ref.norm())


def check_every_stored_layout(name: str, tokens: int, config: WqConfig) -> None:
    """``name``'s layer with ``config`` in each layout its weights may be stored in (checkpoint order and, for 4-bit
    codes, the SPLIT re-layout; act-order weights sorted as the build sorts them) against float64."""
    scheme, x, w1, w2, scales, b1, b2, g, ids, ref = _problem(name, tokens)
    quant = WeightQuant.for_scheme(scheme)
    p1 = p2 = None
    if quant.act_order:  # the build's sort: each expert's columns in group order, activations gathered
        (w1, p1), (w2, p2) = sort_act_order(w1, scales.w1_g_idx, quant), sort_act_order(w2, scales.w2_g_idx, quant)
    for split in ((False, True) if quant.kind != "int8" else (False,)):
        out = fused_wq_experts(
            x, relayout_nibbles(w1) if split else w1, relayout_nibbles(w2) if split else w2, g, ids, quant=quant,
            w1_scale=scales.w1_scale, w2_scale=scales.w2_scale, w1_zero_point=scales.w1_zero_point,
            w2_zero_point=scales.w2_zero_point, w1_perm=p1, w2_perm=p2, w1_bias=b1, w2_bias=b2, split=split,
            fast=False, config=config,
        )
        assert out.shape == ref.shape and bool(torch.isfinite(out).all()), (name, split)
        assert _rel(out, ref) <= TOL, (name, split)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"n{c.block_n}k{c.block_k}s{c.split_k}" + ("-chained" if c.chain_acc else ""))
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("name", list(SHAPES))
@interpreter
def test_every_format_at_shard_shapes(poisoned, name, tokens, cfg):
    check_every_stored_layout(name, tokens, cfg)


@pytest.mark.parametrize("cfg", [MXFP4_MID_TILE, MXFP4_MANY_PAIR_TILE], ids=["mid", "many-pair"])
@interpreter
def test_mxfp4_default_chained_tiles(poisoned, cfg):
    """The chained tiles MXFP4 takes by default from 33 pairs an expert, on the shard shape (K = 96, N = 160: the
    tiles' K steps run past the rows' ends) with 40 tokens (80 pairs over 4 experts)."""
    check_every_stored_layout("mxfp4 bias", 40, cfg)


@interpreter
@pytest.mark.parametrize("tokens", [1, 6])
def test_split_k_epilogues_read_interleaved_rows_clamp_and_skip_other_ranks(poisoned, tokens):
    """Split-K's two epilogue passes: w1's (biases of interleaved gate/up rows, SwiGLU-OAI clamped at 7, the
    activation after all slices are added) and w2's (bias, router weight, top-k sum skipping ids of other ranks)."""
    scheme, k, n = QuantScheme.mxfp4(), 128, 192
    gen = torch.Generator().manual_seed(seed_for(("wq-splitk-epilogue", tokens)))
    w1 = torch.randn(4, 2 * n, k, generator=gen) / k**0.5 * 4  # large enough that the clamp bites
    w2 = torch.randn(4, k, n, generator=gen) / n**0.5
    w1q, w2q, scales = quantize_weights(w1, w2, scheme)
    w1f, w2f = dequantize_weights(w1q, w2q, scales, scheme, torch.float64)
    b1, b2 = torch.randn(4, 2 * n, generator=gen) * 0.1, torch.randn(4, k, generator=gen) * 0.1
    x = torch.randn(tokens, k, generator=gen).to(torch.float16)
    g, ids = torch.topk(torch.softmax(torch.randn(tokens, 4, generator=gen), -1), 3, dim=-1)
    ids = ids.to(torch.int32)
    ids[0, 1] = -1  # another rank's expert: no contribution
    keep = ids >= 0
    ref = moe_reference(x, w1f, w2f, g * keep, ids.clamp(min=0).long(), activation="swigluoai", swiglu_limit=7.0,
                        w1_bias=b1, w2_bias=b2)
    cfg = WqConfig(16, 32, 64, 4, 1, split_k=2)  # w1: 2 slices of K = 128; w2: 3 of N = 192
    out = fused_wq_experts(
        x, relayout_nibbles(interleave_gate_up(w1q)), relayout_nibbles(w2q), g, ids, quant=WeightQuant.for_scheme(scheme),
        w1_scale=interleave_gate_up(scales.w1_scale), w2_scale=scales.w2_scale, w1_bias=interleave_gate_up(b1),
        w2_bias=b2, activation="swigluoai", swiglu_limit=7.0, interleaved=True, split=True, fast=False, config=cfg,
    )
    assert bool(torch.isfinite(out).all()) and _rel(out, ref) <= TOL


# (tokens, top_k, experts, N, K): Kimi-K2-like EP8 shard, Mixtral-8x7B, Qwen3-235B-A22B, gpt-oss-120b
DECODE_SHAPES = [(8, 48, 2048, 7168), (2, 8, 14336, 4096), (8, 128, 1536, 4096), (4, 128, 2880, 2880)]


@pytest.mark.parametrize("top_k,experts,n,k", DECODE_SHAPES)
def test_default_tile_splits_decode_along_k_until_the_sms_are_busy(top_k, experts, n, k):
    """At one token the default decode tile splits a GEMM whose programs are fewer than PROGRAMS_PER_SM per SM, each
    slice keeping MIN_K_TILES_PER_SLICE K tiles; at 512 tokens (row blocks enough) it does not split."""
    sms = 132
    one = default_wq_config(1, top_k, experts, n, k, sms)
    for which, rows, kred in (("w1", n, k), ("w2", k, n)):
        splits = one.splits(which)
        programs = top_k * -(-rows // one.block_n)  # one token: a row block per expert it hits
        k_tiles = -(-kred // one.block_k)
        assert k_tiles // splits >= MIN_K_TILES_PER_SLICE or splits == 1
        if programs >= PROGRAMS_PER_SM * sms:
            assert splits == 1, which
        elif k_tiles >= 2 * MIN_K_TILES_PER_SLICE:
            assert splits > 1 and (splits - 1) * programs < PROGRAMS_PER_SM * sms, which
    many = default_wq_config(512, top_k, experts, n, k, sms)
    assert many.splits("w1") == many.splits("w2") == 1
    assert default_wq_config(1, top_k, experts).split_k == 1  # no shape given: the one-pass tile


def test_decode_split_counts_are_the_ones_measured_fastest():
    """The rule's slices (w1, w2) at one token on 132 SMs are the counts that ran fastest on an H200
    (docs/perf/weight_quantized.md): w1 in 2 where a GEMM has 1.35-1.42 programs an SM, Mixtral's w2 (0.91 an SM) in 3,
    one pass from 2.5 an SM (the rule before split gpt-oss-120b 3/3, slower than one pass there)."""
    splits = {shape: (lambda c: (c.splits("w1"), c.splits("w2")))(default_wq_config(1, *shape, 132))
              for shape in DECODE_SHAPES}
    assert splits == {(8, 48, 2048, 7168): (2, 1), (2, 8, 14336, 4096): (1, 3), (8, 128, 1536, 4096): (2, 1),
                      (4, 128, 2880, 2880): (2, 2)}
    # derived from the device: half the SMs, half the programs wanted
    assert default_wq_config(1, 4, 128, 2880, 2880, 66).split_k == 1


@pytest.mark.parametrize("tokens,top_k,experts,n,k", [(512, 4, 32, 2880, 2880), (2048, 4, 128, 2880, 2880),
                                                      (1024, 8, 128, 768, 2048), (384, 8, 48, 2048, 7168)])
def test_mid_counts_take_the_64_row_4_warp_tile(tokens, top_k, experts, n, k):
    """33-96 pairs an expert (gpt-oss-20b at 512 tokens, gpt-oss-120b at 2048, ...): 64 pairs by 64 weight rows with 4
    warps, the fastest of the five mid-count candidates on the H100 (1.22-1.23x the 64 x 128 8-warp tile it
    replaces) and on an H200 (docs/perf/weight_quantized.md); 32 pairs and fewer keep 32-row blocks, from 256 the
    prefill path."""
    assert default_wq_config(tokens, top_k, experts, n, k, 132) == WqConfig(64, 64, 128, 4, 3)
    assert default_wq_config(256, 4, 32, n, k, 132).block_m == 32  # 32 pairs an expert
    assert default_wq_config(4 * tokens, top_k, experts, n, k, 132).block_m == 128


@pytest.mark.parametrize("tokens,top_k,experts,expected", [
    (512, 4, 32, MXFP4_MID_TILE), (2048, 4, 128, MXFP4_MID_TILE),  # 64 pairs an expert
    (1024, 4, 32, MXFP4_MANY_PAIR_TILE),  # 128: the swap-AB kernel
    (2048, 4, 32, replace(MXFP4_MANY_PAIR_TILE, hopper_bf16=True)),  # 256: the bf16 Hopper path, the tile its fallback
    (256, 4, 32, WqConfig(32, 64, 128, 4, 4))])  # 32 pairs: as every format
def test_mxfp4_takes_its_chained_tiles_from_33_pairs_an_expert(tokens, top_k, experts, expected):
    """MXFP4's dots chained onto the running sums at 33 pairs an expert and more (measured faster on an H200, INT4
    g128 slower: docs/perf/weight_quantized.md); the other formats keep their tiles, and an untuned MXFP4 layer
    gets MXFP4's (the runtime's lookup hands the default its format)."""
    assert default_wq_config(tokens, top_k, experts, 2880, 2880, 132, "mxfp4") == expected
    if expected.chain_acc:
        assert not default_wq_config(tokens, top_k, experts, 2880, 2880, 132, "int4").chain_acc
        quant = WeightQuant.for_scheme(QuantScheme.mxfp4())
        assert get_wq_config("NO_TABLE_GPU", quant, experts, 2880, 2880, top_k, tokens, sm_count=132) == expected


# (tokens, top_k, experts, N, K) at 0.06-16 pairs an expert: Qwen3-30B-A3B, Mixtral-8x7B, Qwen3-235B-A22B TP4 (the
# shapes the zero-point decode rule was checked on, left out of its choice), Qwen3-235B-A22B (where it was chosen)
AWQ_DECODE_POINTS = [(1, 8, 128, 768, 2048), (64, 8, 128, 768, 2048), (1, 2, 8, 14336, 4096), (64, 2, 8, 14336, 4096),
                     (8, 8, 128, 384, 4096), (32, 8, 128, 1536, 4096)]


@pytest.mark.parametrize("tokens,top_k,experts,n,k", AWQ_DECODE_POINTS)
def test_zero_point_g128_decode_takes_128_weight_rows(tokens, top_k, experts, n, k):
    """INT4 with zero points in groups of 128 (AWQ) takes 128 weight rows in the decode tile, its K slices ruled for
    128-row tiles (1.08-1.27x the 64-row tile at 8-64 tokens on three shapes left out of the choice, on an H200:
    docs/perf/weight_quantized.md); zero points in groups of 32 and symmetric INT4, measured slower at 128 rows, keep
    64, and so do the formats not timed (activation order among them); from 17 pairs an expert the tiles are every
    format's. The runtime's lookup (no table for the shape) hands the rule the layer's stored format."""
    quant = WeightQuant.for_scheme(QuantScheme.int_wna16(4, 128, True, "awq"))
    awq = default_wq_config(tokens, top_k, experts, n, k, 132, "int4", quant=quant)
    assert awq == decode_tile(tokens, top_k, experts, n, k, 132, block_n=128) and awq.block_n == 128
    assert get_wq_config("NO_TABLE_GPU", quant, experts, n, k, top_k, tokens, sm_count=132) == awq
    for other in (WeightQuant("int4", 32, zero_point=True), WeightQuant("int4", 128), WeightQuant("int4", 32),
                  WeightQuant("int4", 64, zero_point=True), WeightQuant("int8", 128, zero_point=True),
                  WeightQuant("int4", -1, zero_point=True), WeightQuant("int4", 128, True, act_order=True)):
        tile = default_wq_config(tokens, top_k, experts, n, k, 132, other.kind, quant=other)
        assert tile == decode_tile(tokens, top_k, experts, n, k, 132) and tile.block_n == 64, other
    past = -(-17 * experts // top_k)  # 17 pairs an expert and more: past the decode tile
    assert default_wq_config(past, top_k, experts, n, k, 132, "int4", quant=quant) == \
        default_wq_config(past, top_k, experts, n, k, 132, "int4")


@interpreter
@pytest.mark.parametrize("tokens", [1, 5])
def test_zero_point_g128_default_decode_tile_matches_reference(poisoned, tokens):
    """The 128-row decode tile the zero-point g128 rule serves, one pass and split along K (w1 in 3 slices), on a
    layer whose N (128 rows a GEMM) and K are one and three such tiles, against float64."""
    scheme, k, n = SHAPES["int4 g128 zp"]
    quant = WeightQuant.for_scheme(scheme)
    served = default_wq_config(tokens, 2, 4, n, k, 132, quant.kind, quant=quant)
    assert served.block_n == 128
    for cfg in (served, replace(served, split_k=3, w2_split_k=1)):
        check_every_stored_layout("int4 g128 zp", tokens, cfg)


@pytest.mark.parametrize("cols,rows,expected", [(2880, 1, (64, 1)), (2880, 4, (64, 1)), (2880, 64, (1024, 8)),
                                                (1536, 16, (128, 2)), (1536, 256, (1024, 8)), (100, 1, (64, 1))])
def test_split_k_epilogue_gives_every_sm_a_program_where_the_rows_allow(cols, rows, expected):
    """One decode token's w2 sum (one row) took 1024 columns a program: 3 programs for 132 SMs."""
    assert _epilogue_block(cols, rows, 132) == expected


def test_relayout_pads_rows_to_whole_chunks_and_undoes_exactly():
    gen = torch.Generator().manual_seed(seed_for("relayout-pad"))
    w = torch.randint(0, 256, (3, 5, 720), generator=gen, dtype=torch.uint8)  # 1440 columns: 22.5 chunks
    relaid = relayout_nibbles(w)
    assert split_columns(1440) == 1472 and relaid.shape == (3, 5, 736)
    assert torch.equal(undo_relayout_nibbles(relaid, 1440), w)
    # the pad (columns 1440-1471) sits in the high nibbles of the last chunk's bytes, all zero
    assert int((relaid[..., 704:] >> 4).max()) == 0
    assert torch.equal(relaid[..., 704:] & 15, torch.stack((w[..., 704:] & 15, w[..., 704:] >> 4), -1).reshape(3, 5, 32))


@interpreter
def test_stored_shape_must_match_the_layout():
    scheme, x, w1, w2, scales, *_ = _problem("int4 g32", 3)
    quant = WeightQuant.for_scheme(scheme)
    with pytest.raises(KernelInputError, match="SPLIT layout"):
        fused_wq_experts(x, w1, w2, torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.int32), quant=quant,
                         w1_scale=scales.w1_scale, w2_scale=scales.w2_scale, split=True)


@pytest.mark.parametrize("name", ["mxfp4 bias", "int4 g32 zp"])
def test_experts_take_the_split_layout_at_shard_shapes_and_say_so(name):
    scheme, k, n = SHAPES[name]
    layer = MoELayer(quant=scheme, dtype="float16", num_experts=4, top_k=2, hidden_size=k, intermediate_size=n,
                     bias=name.startswith("mxfp4"))
    experts = (TritonMxfp4Experts if name.startswith("mxfp4") else TritonWna16Experts)(layer)
    assert experts.split
    padded = [f"{d} {c} -> {split_columns(c)}" for d, c in (("K", k), ("N", n)) if c % 64]
    assert padded and all(p in experts.relayout for p in padded)


def test_the_engine_records_the_padded_relayout_in_the_trace(tmp_path):
    """The trace's build section says how the weights were re-laid, the pad included (an H100 build; no run)."""
    layer = MoELayer(quant=SHAPES["int4 g32 zp"][0], dtype="bfloat16", num_experts=128, top_k=4, hidden_size=2880,
                     intermediate_size=1440)
    (loaded,) = Engine([LayerSpec("model.layers.0.mlp.experts", layer)], parallel=ParallelConfig(), env=EnvSnapshot(),
                       platform=platform_preset("sm90"), trace_dir=tmp_path, device="cuda", policy="vllm-0.33").load()
    assert isinstance(loaded.kernel.experts, TritonWna16Experts) and loaded.stand_in is None
    trace = json.loads(loaded.trace_path.read_text())
    assert trace["build"]["weight_layout"].endswith("rows padded with zero codes to whole chunks (N 1440 -> 1472)")
    assert trace_schema.errors(trace) == []


def test_act_order_sort_makes_groups_contiguous_and_refuses_uneven_groups():
    scheme = SHAPES["int4 g32 act-order"][0]
    quant = WeightQuant.for_scheme(scheme)
    gen = torch.Generator().manual_seed(seed_for("act-order-sort"))
    w = torch.randn(2, 8, 128, generator=gen) * torch.rand(128, generator=gen)
    codes, scales, _, g_idx = intq.act_order_quantize_weight(w, 4, 32, zero_point=False, scale_dtype=torch.float16)
    sorted_codes, perm = sort_act_order(codes, g_idx, quant)
    assert perm.dtype == torch.int32 and perm.shape == (2, 128)
    # sorted column j is column perm[j]; in group order the plain dequantization gives those columns
    plain = intq.dequantize_weight(sorted_codes, scales, None, 4)
    ordered = intq.dequantize_weight(codes, scales, None, 4, g_idx=g_idx)
    assert torch.equal(plain, torch.gather(ordered, -1, perm.long().unsqueeze(1).expand(ordered.shape)))
    uneven = g_idx.clone()
    uneven[0, 0] = (uneven[0, 0] + 1) % 4
    with pytest.raises(KernelInputError, match="exactly 32 columns"):
        sort_act_order(codes, uneven, quant)


@interpreter
@pytest.mark.parametrize("name", ["int4 g32 act-order", "int4 g32 zp"])
def test_experts_sort_and_relay_once_then_match_reference(poisoned, name):
    """Through the experts class: the build's sort by g_idx and SPLIT re-layout, kept for the next call."""
    scheme, k, n = SHAPES[name]
    layer = MoELayer(quant=scheme, dtype="float16", num_experts=4, top_k=2, hidden_size=k, intermediate_size=n)
    _, x, w1, w2, scales, _, _, g, ids, ref = _problem(name, 5)
    experts = TritonWna16Experts(layer)
    kernel = ModularKernel(LocalPrepareFinalize(), experts, layer)
    for _ in range(2):
        out = kernel(x, w1, w2, g, ids, scales=scales)
        assert _rel(out, ref) <= TOL
    assert len(experts._relaid) == 2  # w1 and w2, re-laid once


# NVFP4 weight-only (W4A16) ---------------------------------------------------------------------------------------


@interpreter
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"n{c.block_n}k{c.block_k}s{c.split_k}")
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("k,n", [(96, 160), (128, 64)])
def test_nvfp4_weight_only_matches_reference(poisoned, k, n, tokens, cfg):
    """e2m1 values, e4m3 scales per 16 columns, a global scale per expert; checkpoint order and SPLIT."""
    scheme = NVFP4_WEIGHT_ONLY
    gen = torch.Generator().manual_seed(seed_for(("nvfp4-wq", k, n, tokens)))
    w1 = torch.randn(4, 2 * n, k, generator=gen) / k**0.5 * torch.logspace(-1, 1, 4)[:, None, None]
    w2 = torch.randn(4, k, n, generator=gen) / n**0.5
    w1q, w2q, scales = quantize_weights(w1, w2, scheme)
    w1f, w2f = dequantize_weights(w1q, w2q, scales, scheme, torch.float64)
    x = torch.randn(tokens, k, generator=gen).to(torch.float16)
    g, ids = torch.topk(torch.softmax(torch.randn(tokens, 4, generator=gen), -1), 2, dim=-1)
    ref = moe_reference(x, w1f, w2f, g, ids)
    quant = WeightQuant.for_scheme(scheme)
    for split in (False, True):
        out = fused_wq_experts(
            x, relayout_nibbles(w1q) if split else w1q, relayout_nibbles(w2q) if split else w2q, g, ids.to(torch.int32),
            quant=quant, w1_scale=scales.w1_scale, w2_scale=scales.w2_scale, w1_global_scale=scales.w1_global_scale,
            w2_global_scale=scales.w2_global_scale, split=split, fast=False, config=cfg,
        )
        assert bool(torch.isfinite(out).all()) and _rel(out, ref) <= TOL, split


def test_nvfp4_weight_only_layers_take_the_nvfp4_kind_and_w4a4_ones_do_not():
    quant = WeightQuant.for_scheme(NVFP4_WEIGHT_ONLY)
    assert (quant.kind, quant.group, quant.packing) == ("nvfp4", 16, 2)
    with pytest.raises(KernelInputError, match="16-bit activations"):
        WeightQuant.for_scheme(QuantScheme.nvfp4())


@interpreter
def test_marlins_nvfp4_decision_builds_and_runs_the_triton_nvfp4_experts(poisoned):
    """vLLM 0.33 decides MarlinExperts for NVFP4 on Hopper; built for CUDA, the Triton NVFP4 experts stand in."""
    declared = MoELayer(quant=QuantScheme.nvfp4(), dtype="float16", num_experts=4, top_k=2, hidden_size=96,
                        intermediate_size=160)
    decision = select(declared, platform=platform_preset("sm90"), env={}, policy="vllm-0.33")
    assert decision.kernel == "MarlinExperts"
    kernel = build(decision, device="cuda")
    assert isinstance(kernel.experts, TritonNvfp4Experts) and kernel.stand_in.label == "moe-fsm Triton NVFP4, 16-bit activations"
    gen = torch.Generator().manual_seed(seed_for("marlin-nvfp4"))
    w1, w2 = torch.randn(4, 320, 96, generator=gen) / 10, torch.randn(4, 96, 160, generator=gen) / 13
    w1q, w2q, scales = quantize_weights(w1, w2, kernel.layer.quant)
    w1f, w2f = dequantize_weights(w1q, w2q, scales, kernel.layer.quant, torch.float64)
    x = torch.randn(7, 96, generator=gen).to(torch.float16)
    g, ids = torch.topk(torch.softmax(torch.randn(7, 4, generator=gen), -1), 2, dim=-1)
    out = kernel(x, w1q, w2q, g, ids.to(torch.int32), scales=scales)
    assert _rel(out, moe_reference(x, w1f, w2f, g, ids)) <= TOL
