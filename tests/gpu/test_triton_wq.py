"""The weight-quantized Triton MoE (MXFP4 gpt-oss style; INT4/INT8 WNA16) on CUDA, against float64.

The reference runs in float64 on the weights the kernel holds (dequantized), so
only the kernel's arithmetic is judged: bf16 operands (the dequantized weight
tile is rounded to bf16 before the tensor-core dot), fp32 accumulation, a bf16
intermediate and output. Tolerance: relative Frobenius 1e-2, as for the bf16
Triton experts (measured around 3e-3). The caching allocator is filled with NaN
first, so an element the kernels never write fails.
"""

from __future__ import annotations

import zlib
from dataclasses import replace

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

from moe_fsm.experts.triton_wq_experts import TritonMxfp4Experts, TritonWna16Experts  # noqa: E402
from moe_fsm.inputs.layer import MoELayer  # noqa: E402
from moe_fsm.inputs.quant import QuantScheme  # noqa: E402
from moe_fsm.kernels.reference import moe_reference  # noqa: E402
from moe_fsm.kernels.triton_wq import WeightQuant, fused_wq_experts  # noqa: E402
from moe_fsm.kernels.triton_wq.fused import WqConfig, default_wq_config, relayout_nibbles  # noqa: E402
from moe_fsm.modular.kernel import ModularKernel  # noqa: E402
from moe_fsm.prepare_finalize.local import LocalPrepareFinalize  # noqa: E402
from moe_fsm.quantize.weights import dequantize_weights, interleave_gate_up, quantize_weights  # noqa: E402

from .moe_gpu_cases import poison_allocator, rel_err  # noqa: E402

TOL = 1e-2
GPT_OSS = dict(num_experts=32, top_k=4, hidden_size=2880, intermediate_size=2880)  # gpt-oss-20b experts
QWEN3 = dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768)  # Qwen3-30B-A3B experts
SCHEMES = {
    "mxfp4": QuantScheme.mxfp4(),
    "int4 g32": QuantScheme.int_wna16(4, 32),
    "int4 g128": QuantScheme.int_wna16(4, 128),
    "int4 g32 zp": QuantScheme.int_wna16(4, 32, True, "compressed-tensors"),
    "int4 channel": QuantScheme.int_wna16(4, -1),
    "int4 g32 act-order": QuantScheme.int_wna16(4, 32, act_order=True),
    "int4 g128 zp act-order": QuantScheme.int_wna16(4, 128, True, "compressed-tensors", act_order=True),
    "int4 g128 zp": QuantScheme.int_wna16(4, 128, True, "awq"),
    "int8 channel": QuantScheme.int_wna16(8, -1),
    "int8 g64 zp": QuantScheme.int_wna16(8, 64, True, "compressed-tensors"),
}


def _layer(name: str, shape: dict) -> MoELayer:
    scheme = SCHEMES[name]
    gpt_oss = name == "mxfp4"
    return MoELayer(quant=scheme, dtype="bfloat16", bias=gpt_oss, activation="swigluoai" if gpt_oss else "silu",
                    swiglu_limit=7.0 if gpt_oss else None, **shape)


def _problem(layer: MoELayer, tokens: int, seed: int):
    """Weights, inputs and the float64 reference, all made on the GPU.

    On the host, drawing and dequantizing the gpt-oss shape and its float64 reference took 15-70 s a test, which
    kept the GPU suite from finishing; the reference's math is the same on either device.
    """
    gen = torch.Generator(device="cuda").manual_seed(seed)
    e, n, k = layer.num_experts, layer.intermediate_size, layer.hidden_size
    w1 = torch.randn(e, 2 * n, k, generator=gen, device="cuda") / k**0.5
    w2 = torch.randn(e, k, n, generator=gen, device="cuda") / n**0.5
    w1q, w2q, scales = quantize_weights(w1, w2, layer.quant)
    del w1, w2
    w1f, w2f = dequantize_weights(w1q, w2q, scales, layer.quant, torch.float32)
    if layer.bias:
        scales = replace(scales, w1_bias=torch.randn(e, 2 * n, generator=gen, device="cuda") * 0.1,
                         w2_bias=torch.randn(e, k, generator=gen, device="cuda") * 0.1)
    x = torch.randn(tokens, k, generator=gen, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, e, generator=gen, device="cuda")
    g, ids = torch.topk(torch.softmax(logits, -1), layer.top_k, dim=-1)
    ref = moe_reference(x, w1f, w2f, g, ids, activation=layer.activation.value, swiglu_limit=layer.swiglu_limit,
                        w1_bias=scales.w1_bias, w2_bias=scales.w2_bias).cpu()
    return x, w1q, w2q, scales, g, ids.to(torch.int32), ref


def _run_layer(layer: MoELayer, x, w1, w2, scales, g, ids, **options):
    """``fused_wq_experts`` on a ``_problem``'s layer: its format, scales, zero points, biases and activation (the
    tests vary only the layout, the decode path and the tile, ``options``)."""
    return fused_wq_experts(
        x, w1, w2, g, ids, quant=WeightQuant.for_scheme(layer.quant), w1_scale=scales.w1_scale,
        w2_scale=scales.w2_scale, w1_zero_point=scales.w1_zero_point, w2_zero_point=scales.w2_zero_point,
        w1_bias=scales.w1_bias, w2_bias=scales.w2_bias, activation=layer.activation.value,
        swiglu_limit=layer.swiglu_limit, **options,
    )


@pytest.mark.parametrize("tokens", [1, 37, 300])
@pytest.mark.parametrize("name,shape", [("mxfp4", GPT_OSS), ("int4 g128", QWEN3), ("int4 g32 zp", QWEN3),
                                        ("int8 channel", QWEN3), ("int8 g64 zp", QWEN3)])
def test_experts_match_reference(name, shape, tokens):
    layer = _layer(name, shape)
    x, w1, w2, scales, g, ids, ref = _problem(layer, tokens, zlib.crc32(f"{name}-{tokens}".encode()))
    experts = TritonMxfp4Experts(layer) if name == "mxfp4" else TritonWna16Experts(layer)
    kernel = ModularKernel(LocalPrepareFinalize(), experts, layer)
    poison_allocator()
    out = kernel(x, w1, w2, g, ids, scales=scales)
    assert rel_err(out.cpu(), ref) <= TOL


@pytest.mark.parametrize("tokens", [3, 200])
def test_mxfp4_reads_interleaved_gate_up(tokens):
    """gpt-oss checkpoints interleave gate and up rows (gate 2n, up 2n+1); the kernel reads that layout directly."""
    layer = _layer("mxfp4", dict(num_experts=8, top_k=4, hidden_size=512, intermediate_size=384))
    x, w1, w2, scales, g, ids, ref = _problem(layer, tokens, 11 + tokens)
    poison_allocator()
    out = fused_wq_experts(
        x, interleave_gate_up(w1), w2, g, ids, quant=WeightQuant.for_scheme(layer.quant),
        w1_scale=interleave_gate_up(scales.w1_scale), w2_scale=scales.w2_scale,
        w1_bias=interleave_gate_up(scales.w1_bias), w2_bias=scales.w2_bias,
        activation="swigluoai", swiglu_limit=7.0, interleaved=True,
    )
    assert rel_err(out.cpu(), ref) <= TOL


def test_slots_of_other_ranks_are_skipped():
    """Ids of -1 (experts on another rank) contribute nothing and leave no NaN behind."""
    layer = _layer("int4 g128", QWEN3)
    x, w1, w2, scales, g, ids, _ = _problem(layer, 16, 5)
    ids[:, 0] = -1
    w1f, w2f = dequantize_weights(w1, w2, scales, layer.quant)
    ref = moe_reference(x, w1f, w2f, g[:, 1:], ids[:, 1:]).cpu()
    poison_allocator()
    out = fused_wq_experts(x, w1, w2, g, ids, quant=WeightQuant.for_scheme(layer.quant),
                           w1_scale=scales.w1_scale, w2_scale=scales.w2_scale)
    assert rel_err(out.cpu(), ref) <= TOL


# Every dequantization path (checkpoint or SPLIT nibble order, inline-PTX or plain Triton dequant) and tile shapes
# that exercise masked K tails (2880 = 22.5 x 128), per-row scale-on-accumulator (BLOCK_K <= group) and
# per-element group scales (BLOCK_K > group), pair blocks (one token) and sorted row blocks.
VARIANT_SHAPE = dict(num_experts=8, top_k=4, hidden_size=2880, intermediate_size=768)
# g128 layers need K a multiple of 128: 2944 = 23 x 128 = 11.5 x 256 keeps a masked K tail for BLOCK_K 256
VARIANT_SHAPE_G128 = dict(VARIANT_SHAPE, hidden_size=2944)
CONFIGS = [WqConfig(16, 64, 128, 4, 4), WqConfig(16, 32, 256, 4, 3), WqConfig(64, 128, 64, 8, 3),
           WqConfig(128, 128, 64, 8, 3, group_m=8)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "m{}n{}k{}".format(c.block_m, c.block_n, c.block_k))
@pytest.mark.parametrize("split,fast", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("name", ["mxfp4", "int4 g128", "int4 g32 zp"])
@pytest.mark.parametrize("tokens", [1, 45])
def test_dequant_paths_and_tiles(name, tokens, split, fast, cfg):
    layer = _layer(name, VARIANT_SHAPE_G128 if name == "int4 g128" else VARIANT_SHAPE)
    x, w1, w2, scales, g, ids, ref = _problem(layer, tokens, zlib.crc32(f"v-{name}-{tokens}".encode()))
    if split:
        w1, w2 = relayout_nibbles(w1), relayout_nibbles(w2)
    poison_allocator()
    out = _run_layer(layer, x, w1, w2, scales, g, ids, split=split, fast=fast, config=cfg)
    assert rel_err(out.cpu(), ref) <= TOL


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "m{}n{}k{}".format(c.block_m, c.block_n, c.block_k))
@pytest.mark.parametrize("tokens", [1, 45])
def test_mxfp4_scaled_dot_path(tokens, cfg):
    """MXFP4 in checkpoint nibble order through tl.dot_scaled (Triton's upcast and E8M0 scaling)."""
    layer = _layer("mxfp4", VARIANT_SHAPE)
    x, w1, w2, scales, g, ids, ref = _problem(layer, tokens, zlib.crc32(f"sd-{tokens}".encode()))
    poison_allocator()
    out = fused_wq_experts(
        x, w1, w2, g, ids, quant=WeightQuant.for_scheme(layer.quant), w1_scale=scales.w1_scale,
        w2_scale=scales.w2_scale, w1_bias=scales.w1_bias, w2_bias=scales.w2_bias, activation="swigluoai",
        swiglu_limit=7.0, scaled_dot=True, config=cfg,
    )
    assert rel_err(out.cpu(), ref) <= TOL


@pytest.mark.parametrize("scaled_dot", [False, True])
def test_mxfp4_experts_either_path(monkeypatch, scaled_dot):
    """The experts class with either MXFP4 path (SPLIT re-layout + inline PTX, or checkpoint order + dot_scaled)."""
    monkeypatch.setattr(TritonMxfp4Experts, "scaled_dot", scaled_dot)
    layer = _layer("mxfp4", GPT_OSS)
    x, w1, w2, scales, g, ids, ref = _problem(layer, 19, 123)
    experts = TritonMxfp4Experts(layer)
    assert experts.split is not scaled_dot
    kernel = ModularKernel(LocalPrepareFinalize(), experts, layer)
    poison_allocator()
    out = kernel(x, w1, w2, g, ids, scales=scales)
    assert rel_err(out.cpu(), ref) <= TOL


# Tensor-parallel shards: K and N multiples of 16 (and of the scale group), not of the SPLIT layout's 64-column
# chunks. gpt-oss-120b over two GPUs has N = 1440; the experts pad the rows to whole chunks at the re-layout.
# Activation-ordered (GPTQ desc_act) weights are sorted by group at the same build, the activations gathered.
GPT_OSS_TP2 = dict(num_experts=32, top_k=4, hidden_size=2880, intermediate_size=1440)
SHARDS = [("mxfp4", GPT_OSS_TP2), ("int4 g32 zp", GPT_OSS_TP2), ("int4 channel", dict(GPT_OSS_TP2, intermediate_size=720)),
          ("int8 g64 zp", dict(GPT_OSS_TP2, intermediate_size=1472)), ("int4 g32 act-order", GPT_OSS_TP2),
          ("int4 g128 zp act-order", QWEN3)]


@pytest.mark.parametrize("tokens", [1, 37, 300])
@pytest.mark.parametrize("name,shape", SHARDS, ids=lambda v: v if isinstance(v, str) else "N{intermediate_size}".format(**v))
def test_shard_shapes_match_reference(name, shape, tokens):
    layer = _layer(name, shape)
    x, w1, w2, scales, g, ids, ref = _problem(layer, tokens, zlib.crc32(f"shard-{name}-{tokens}".encode()))
    experts = TritonMxfp4Experts(layer) if name == "mxfp4" else TritonWna16Experts(layer)
    assert experts.split is (name != "int8 g64 zp")
    kernel = ModularKernel(LocalPrepareFinalize(), experts, layer)
    poison_allocator()
    out = kernel(x, w1, w2, g, ids, scales=scales)
    assert rel_err(out.cpu(), ref) <= TOL


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=lambda c: "m{}n{}k{}".format(c.block_m, c.block_n, c.block_k))
def test_padded_split_layout_on_every_dequant_path(cfg, fast):
    """MXFP4 at gpt-oss-120b's TP2 shard in the padded SPLIT layout, inline-PTX and plain-Triton dequant."""
    layer = _layer("mxfp4", GPT_OSS_TP2)
    x, w1, w2, scales, g, ids, ref = _problem(layer, 45, zlib.crc32(b"padded-split"))
    w1, w2 = relayout_nibbles(w1), relayout_nibbles(w2)
    assert w2.shape[-1] == 1472 // 2
    poison_allocator()
    out = fused_wq_experts(
        x, w1, w2, g, ids, quant=WeightQuant.for_scheme(layer.quant), w1_scale=scales.w1_scale,
        w2_scale=scales.w2_scale, w1_bias=scales.w1_bias, w2_bias=scales.w2_bias, activation="swigluoai",
        swiglu_limit=7.0, split=True, fast=fast, config=cfg,
    )
    assert rel_err(out.cpu(), ref) <= TOL


# Many-pair swap-AB tiles with each K tile's dots chained onto the running sums (``chain_acc``): the prefill
# benchmark's candidates
MANY_PAIR = [WqConfig(64, 128, 64, 8, 3, chain_acc=True), WqConfig(128, 128, 64, 8, 3, group_m=8, chain_acc=True),
             WqConfig(128, 128, 128, 8, 3, group_m=8, chain_acc=True)]


@pytest.mark.parametrize("cfg", MANY_PAIR, ids=lambda c: "m{}n{}k{}-chained".format(c.block_m, c.block_n, c.block_k))
@pytest.mark.parametrize("tokens", [45, 700])
@pytest.mark.parametrize("name,shape", [("mxfp4", GPT_OSS), ("mxfp4", GPT_OSS_TP2), ("int4 g32 zp", QWEN3)],
                         ids=lambda v: v if isinstance(v, str) else "N{intermediate_size}".format(**v))
def test_many_pair_tiles_match_reference(name, shape, tokens, cfg):
    """Both GEMMs at the many-pair tiles, in the SPLIT layout with the inline-PTX decode, against float64: gpt-oss's
    whole chunks and its TP2 shard's padded ones (N = 1440: w2's last K tile is half a chunk, masked)."""
    layer = _layer(name, shape)
    x, w1, w2, scales, g, ids, ref = _problem(layer, tokens, zlib.crc32(f"many-{name}-{tokens}-{shape}".encode()))
    w1, w2 = relayout_nibbles(w1), relayout_nibbles(w2)
    poison_allocator()
    out = _run_layer(layer, x, w1, w2, scales, g, ids, split=True, fast=True, config=cfg)
    assert rel_err(out.cpu(), ref) <= TOL


# NVFP4 weight-only: what runs where vLLM 0.33 decides Marlin for NVFP4 on Hopper (e2m1, e4m3 scales per 16, a global
# scale per expert, bf16 activations).
NVFP4_SHAPES = [dict(num_experts=32, top_k=8, hidden_size=2048, intermediate_size=768),
                dict(num_experts=32, top_k=4, hidden_size=2880, intermediate_size=1440)]


@pytest.mark.parametrize("tokens", [1, 37, 300])
@pytest.mark.parametrize("shape", NVFP4_SHAPES, ids=lambda s: "K{hidden_size}N{intermediate_size}".format(**s))
def test_marlins_nvfp4_stand_in_is_the_triton_nvfp4_experts(shape, tokens):
    from moe_fsm.decision import select
    from moe_fsm.experts.triton_wq_experts import TritonNvfp4Experts
    from moe_fsm.inputs.platform import preset
    from moe_fsm.runtime import build

    declared = MoELayer(quant=QuantScheme.nvfp4(), dtype="bfloat16", **shape)
    decision = select(declared, platform=preset("sm90"), env={}, policy="vllm-0.33")
    assert decision.kernel == "MarlinExperts"
    kernel = build(decision, device="cuda")
    assert isinstance(kernel.experts, TritonNvfp4Experts) and kernel.stand_in.weight_only
    layer = kernel.layer  # NVFP4 weights, 16-bit activations: what Marlin computes
    x, w1, w2, scales, g, ids, ref = _problem(layer, tokens, zlib.crc32(f"nvfp4-{tokens}-{shape}".encode()))
    poison_allocator()
    out = kernel(x, w1, w2, g, ids, scales=scales)
    assert rel_err(out.cpu(), ref) <= TOL


@pytest.mark.parametrize("split,fast", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=lambda c: "m{}n{}k{}".format(c.block_m, c.block_n, c.block_k))
def test_nvfp4_dequant_paths_and_tiles(cfg, split, fast):
    from moe_fsm.inputs.quant import NVFP4_STATIC, QuantFamily

    layer = MoELayer(quant=QuantScheme(QuantFamily.NVFP4, NVFP4_STATIC, None), dtype="bfloat16", **NVFP4_SHAPES[1])
    x, w1, w2, scales, g, ids, ref = _problem(layer, 45, zlib.crc32(b"nvfp4-paths"))
    if split:
        w1, w2 = relayout_nibbles(w1), relayout_nibbles(w2)
    poison_allocator()
    out = fused_wq_experts(
        x, w1, w2, g, ids, quant=WeightQuant.for_scheme(layer.quant), w1_scale=scales.w1_scale,
        w2_scale=scales.w2_scale, w1_global_scale=scales.w1_global_scale, w2_global_scale=scales.w2_global_scale,
        split=split, fast=fast, config=cfg,
    )
    assert rel_err(out.cpu(), ref) <= TOL


# Split-K decode (few tokens): the default tile's split and a forced one on both GEMMs, at decode shapes with the
# real K and N (fewer experts than the models, which keeps the float64 reference small): a Kimi-K2-like EP8 shard
# (K7168, N2048, group 32), Qwen3-235B-A22B (K4096, N1536, g128 zero points, with activation order and without: AWQ's
# default decode tile has 128 weight rows, ``DECODE_ROWS_BY_FORMAT``), gpt-oss-120b TP2 (MXFP4, N1440).
DECODE = [("int4 g32", dict(num_experts=10, top_k=8, hidden_size=7168, intermediate_size=2048)),
          ("int4 g128 zp act-order", dict(num_experts=10, top_k=8, hidden_size=4096, intermediate_size=1536)),
          ("int4 g128 zp", dict(num_experts=10, top_k=8, hidden_size=4096, intermediate_size=1536)),  # 128 rows
          ("mxfp4", GPT_OSS_TP2)]


@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("name,shape", DECODE, ids=lambda v: v if isinstance(v, str) else "K{hidden_size}N{intermediate_size}".format(**v))
def test_split_k_decode_matches_reference(name, shape, fast, tokens):
    from moe_fsm.kernels.triton_wq.fused import sort_act_order

    layer = _layer(name, shape)
    x, w1, w2, scales, g, ids, ref = _problem(layer, tokens, zlib.crc32(f"splitk-{name}-{tokens}".encode()))
    quant = WeightQuant.for_scheme(layer.quant)
    perms = {}
    if quant.act_order:
        (w1, p1), (w2, p2) = sort_act_order(w1, scales.w1_g_idx, quant), sort_act_order(w2, scales.w2_g_idx, quant)
        perms = dict(w1_perm=p1, w2_perm=p2)
    w1, w2 = relayout_nibbles(w1), relayout_nibbles(w2)
    default = default_wq_config(tokens, layer.top_k, layer.num_experts, layer.intermediate_size, layer.hidden_size,
                                torch.cuda.get_device_properties(0).multi_processor_count, quant.kind, quant=quant)
    if tokens == 1:
        assert max(default.splits("w1"), default.splits("w2")) > 1  # few programs at one token: the rule splits
    for cfg in (default, WqConfig(16, 64, 128, 4, 4, split_k=5, w2_split_k=3)):
        poison_allocator()
        out = fused_wq_experts(
            x, w1, w2, g, ids, quant=quant, w1_scale=scales.w1_scale, w2_scale=scales.w2_scale,
            w1_zero_point=scales.w1_zero_point, w2_zero_point=scales.w2_zero_point, w1_bias=scales.w1_bias,
            w2_bias=scales.w2_bias, activation=layer.activation.value, swiglu_limit=layer.swiglu_limit, split=True,
            fast=fast, config=cfg, **perms,
        )
        assert rel_err(out.cpu(), ref) <= TOL, cfg


@pytest.mark.parametrize("tokens", [1, 8])
def test_split_k_nvfp4_decode_matches_reference(tokens):
    """NVFP4 weight-only split along K: the per-expert global scale applied once, after the slices are added."""
    from moe_fsm.inputs.quant import NVFP4_STATIC, QuantFamily

    layer = MoELayer(quant=QuantScheme(QuantFamily.NVFP4, NVFP4_STATIC, None), dtype="bfloat16", **NVFP4_SHAPES[0])
    x, w1, w2, scales, g, ids, ref = _problem(layer, tokens, zlib.crc32(f"nvfp4-splitk-{tokens}".encode()))
    w1, w2 = relayout_nibbles(w1), relayout_nibbles(w2)
    poison_allocator()
    out = fused_wq_experts(
        x, w1, w2, g, ids, quant=WeightQuant.for_scheme(layer.quant), w1_scale=scales.w1_scale,
        w2_scale=scales.w2_scale, w1_global_scale=scales.w1_global_scale, w2_global_scale=scales.w2_global_scale,
        split=True, config=WqConfig(16, 64, 128, 4, 4, split_k=4, w2_split_k=2),
    )
    assert rel_err(out.cpu(), ref) <= TOL


# The fast (inline PTX) decode paths form the very bf16 weights the plain Triton path forms: INT4 with group scales
# in runs (group 32 / 64, or a tile wider than the group) rounds (code - zero point) x fp16 scale once, as the fp32
# product is rounded; with one scale a K tile (g128, 128-column tile) code - zero point is exact either way, in the
# SPLIT layout and in checkpoint order; zero points (AWQ, compressed-tensors asymmetric) are subtracted in bf16,
# exactly; NVFP4 carries value x e4m3 scale (exact) times 2^-8 and scales the fp32 sums back by 2^8. So the layer's
# output is the same bit for bit, in one pass and split along K.
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("name", ["int4 g32", "int4 g64", "int4 g128 tile 256", "int4 g32 zp", "int4 g128 zp",
                                  "int4 g128 zp tile 256", "int4 g128 zp checkpoint order", "nvfp4"])
def test_fast_decode_dequant_is_the_plain_path_bit_for_bit(name, tokens):
    from moe_fsm.inputs.quant import NVFP4_STATIC, QuantFamily

    if name == "nvfp4":
        layer = MoELayer(quant=QuantScheme(QuantFamily.NVFP4, NVFP4_STATIC, None), dtype="bfloat16", **NVFP4_SHAPES[0])
    else:
        zero_point = " zp" in name
        scheme = QuantScheme.int_wna16(4, int(name.split()[1][1:]), zero_point, "awq" if zero_point else "gptq")
        layer = MoELayer(quant=scheme, dtype="bfloat16", activation="silu", **QWEN3)
    x, w1, w2, scales, g, ids, ref = _problem(layer, tokens, zlib.crc32(f"fast-bits-{name}-{tokens}".encode()))
    split = "checkpoint order" not in name
    if split:
        w1, w2 = relayout_nibbles(w1), relayout_nibbles(w2)
    block_k = 256 if "tile 256" in name else 128
    for cfg in (WqConfig(16, 64, block_k, 4, 3), WqConfig(16, 64, block_k, 4, 3, split_k=3, w2_split_k=2)):
        outs = []
        for fast in (True, False):
            poison_allocator()
            outs.append(fused_wq_experts(
                x, w1, w2, g, ids, quant=WeightQuant.for_scheme(layer.quant), w1_scale=scales.w1_scale,
                w2_scale=scales.w2_scale, w1_zero_point=scales.w1_zero_point, w2_zero_point=scales.w2_zero_point,
                w1_global_scale=scales.w1_global_scale, w2_global_scale=scales.w2_global_scale, split=split,
                fast=fast, config=cfg,
            ))
        assert torch.equal(outs[0], outs[1]), cfg
        assert rel_err(outs[0].cpu(), ref) <= TOL, cfg


# Prefill on the bf16 Hopper kernels (``WqConfig.hopper_bf16``): the hit experts dequantized into a 16-bit scratch,
# both GEMMs on the TMA kernels with the bf16 experts' tile; every stored format, biases folded into K, NVFP4's global
# scale, activation order, a tensor-parallel N (1440), interleaved gate/up rows and other ranks' slots.
PREFILL = [("mxfp4", GPT_OSS), ("mxfp4", GPT_OSS_TP2), ("int4 g128", QWEN3), ("int4 g32 zp", QWEN3),
           ("int4 g128 zp act-order", QWEN3), ("int4 channel", QWEN3), ("int8 g64 zp", QWEN3)]


def _count_prefill_calls(monkeypatch) -> list:
    from moe_fsm.kernels.triton_wq import prefill

    calls = []
    real = prefill.prefill_experts
    monkeypatch.setattr(prefill, "prefill_experts", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _needs_tma():
    from moe_fsm.kernels.triton_moe.hopper import tma_kernels_available

    if not tma_kernels_available(0):
        pytest.skip("the bf16 Hopper kernels need an sm_90+ GPU and Triton's tensor descriptors")


@pytest.mark.parametrize("tokens", [300, 2100])
@pytest.mark.parametrize("name,shape", PREFILL, ids=lambda v: v if isinstance(v, str) else "E{num_experts}K{hidden_size}N{intermediate_size}".format(**v))
def test_prefill_on_the_bf16_hopper_kernels_matches_reference(monkeypatch, name, shape, tokens):
    from moe_fsm.kernels.triton_wq.fused import sort_act_order

    _needs_tma()
    layer = _layer(name, shape)
    x, w1, w2, scales, g, ids, ref = _problem(layer, tokens, zlib.crc32(f"prefill-{name}-{tokens}-{shape}".encode()))
    quant = WeightQuant.for_scheme(layer.quant)
    perms = {}
    if quant.act_order:
        (w1, p1), (w2, p2) = sort_act_order(w1, scales.w1_g_idx, quant), sort_act_order(w2, scales.w2_g_idx, quant)
        perms = dict(w1_perm=p1, w2_perm=p2)
    split = quant.kind != "int8"
    if split:
        w1, w2 = relayout_nibbles(w1), relayout_nibbles(w2)
    calls = _count_prefill_calls(monkeypatch)
    poison_allocator(3 << 30)
    out = fused_wq_experts(
        x, w1, w2, g, ids, quant=quant, w1_scale=scales.w1_scale, w2_scale=scales.w2_scale,
        w1_zero_point=scales.w1_zero_point, w2_zero_point=scales.w2_zero_point, w1_bias=scales.w1_bias,
        w2_bias=scales.w2_bias, activation=layer.activation.value, swiglu_limit=layer.swiglu_limit, split=split,
        config=WqConfig(128, hopper_bf16=True), **perms,
    )
    assert calls, "the call did not take the bf16 Hopper path"
    assert rel_err(out.cpu(), ref) <= TOL


def test_prefill_path_reads_interleaved_rows_nvfp4_and_skips_other_ranks(monkeypatch):
    """gpt-oss's interleaved gate/up rows (de-interleaved by the dequantization), NVFP4's global scales, and slots
    of other ranks (-1) that leave nothing behind."""
    from moe_fsm.inputs.quant import NVFP4_STATIC, QuantFamily

    _needs_tma()
    calls = _count_prefill_calls(monkeypatch)
    layer = _layer("mxfp4", dict(num_experts=8, top_k=4, hidden_size=512, intermediate_size=384))
    x, w1, w2, scales, g, ids, ref = _problem(layer, 400, 23)
    poison_allocator()
    out = fused_wq_experts(
        x, relayout_nibbles(interleave_gate_up(w1)), relayout_nibbles(w2), g, ids,
        quant=WeightQuant.for_scheme(layer.quant), w1_scale=interleave_gate_up(scales.w1_scale),
        w2_scale=scales.w2_scale, w1_bias=interleave_gate_up(scales.w1_bias), w2_bias=scales.w2_bias,
        activation="swigluoai", swiglu_limit=7.0, interleaved=True, split=True, config=WqConfig(128, hopper_bf16=True),
    )
    assert rel_err(out.cpu(), ref) <= TOL

    layer = MoELayer(quant=QuantScheme(QuantFamily.NVFP4, NVFP4_STATIC, None), dtype="bfloat16", **NVFP4_SHAPES[1])
    x, w1, w2, scales, g, ids, _ = _problem(layer, 600, 29)
    ids[:, 0] = -1
    w1f, w2f = dequantize_weights(w1, w2, scales, layer.quant)
    ref = moe_reference(x, w1f, w2f, g[:, 1:], ids[:, 1:]).cpu()
    poison_allocator()
    out = fused_wq_experts(
        x, relayout_nibbles(w1), relayout_nibbles(w2), g, ids, quant=WeightQuant.for_scheme(layer.quant),
        w1_scale=scales.w1_scale, w2_scale=scales.w2_scale, w1_global_scale=scales.w1_global_scale,
        w2_global_scale=scales.w2_global_scale, split=True, config=WqConfig(128, hopper_bf16=True),
    )
    assert len(calls) == 2
    assert rel_err(out.cpu(), ref) <= TOL


def test_experts_take_the_bf16_hopper_path_by_default_at_prefill(monkeypatch):
    """The experts with no tile given: from 256 pairs an expert the default tile runs the bf16 Hopper path."""
    _needs_tma()
    calls = _count_prefill_calls(monkeypatch)
    shape = dict(num_experts=8, top_k=2, hidden_size=1024, intermediate_size=512)  # 1100 x 2 / 8 = 275 pairs an expert
    for name in ("mxfp4", "int4 g32 zp"):
        layer = _layer(name, shape)
        x, w1, w2, scales, g, ids, ref = _problem(layer, 1100, zlib.crc32(f"prefill-default-{name}".encode()))
        experts = TritonMxfp4Experts(layer) if name == "mxfp4" else TritonWna16Experts(layer)
        kernel = ModularKernel(LocalPrepareFinalize(), experts, layer)
        poison_allocator()
        out = kernel(x, w1, w2, g, ids, scales=scales)
        assert rel_err(out.cpu(), ref) <= TOL, name
    assert len(calls) == 2
