"""The Gluon block-FP8 kernel (``MoEConfig.gluon``) on an sm_90+ device, against the float64 emulation.

Every case asserts that the Gluon path really ran (``gluon_usable``), then compares the layer with the float64
emulation of both activation quantizations (1.5e-2, as ``test_triton_moe.py`` explains) and with the
pointer-load kernel on the same w1 width (its intermediate is also written in bf16 and quantized after the
GEMM, so only the order of the scale products differs: 2e-3). Outputs and the allocator's free blocks are
NaN-poisoned before each call.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

from moe_fsm.kernels.triton_moe import Fp8Spec, GemmConfig, MoEConfig, align_tokens, fused_experts  # noqa: E402
from moe_fsm.kernels.triton_moe.align import expert_runs  # noqa: E402
from moe_fsm.kernels.triton_moe.config import gluon_mid_config, gluon_pair_config  # noqa: E402
from moe_fsm.kernels.triton_moe.hopper import (  # noqa: E402
    gather_sorted,
    gluon_kernels_available,
    gluon_usable,
    pair_slots,
    quantize_real_rows,
    quantize_sorted,
)
from moe_fsm.kernels.triton_moe.quant import quantize_activation  # noqa: E402

from .moe_gpu_cases import (  # noqa: E402
    DEEPSEEK_V3,
    Shape,
    block_fp8_weights,
    dequantize_block,
    emulate_fp8,
    hidden_states,
    poison_allocator,
    rel_err,
    routing,
)

FP8_VS_EMULATION_TOL = 1.5e-2
SAME_TILES_TOL = 2e-3
BLOCK_FP8 = Fp8Spec("block", "group")

if torch.cuda.is_available() and not gluon_kernels_available(torch.cuda.current_device()):
    pytest.skip("the Gluon kernel needs a Hopper (sm_90) or later GPU and Triton's Gluon", allow_module_level=True)

# DeepSeek-V3's layer dimensions with 16 experts (the float64 checks dequantize every expert a batch hits), and a
# small ragged one: K = 576 is 4.5 scale groups (the copy engine zero-fills the last K step), and w2's 576 output
# columns end inside a 128-wide tile (its upper weight box reads the next expert's rows, masked on store)
DEEPSEEK_V3_E16 = Shape("deepseek-v3-e16", 16, DEEPSEEK_V3.hidden, DEEPSEEK_V3.intermediate, 8)
RAGGED = Shape("ragged", 8, 576, 320, 4)


def _config(block_m=64, bn1=64, bn2=128, warps=4, stages=4, group_m=8, ws=False, persistent=False):
    flags = dict(warp_specialize=ws, persistent=persistent)
    return MoEConfig(block_m, GemmConfig(bn1, 128, group_m, warps, stages, **flags),
                     GemmConfig(bn2, 128, group_m, warps, stages, **flags), False, True, True, True)


def _pointer_twin(config: MoEConfig) -> MoEConfig:
    """The pointer-load kernel on a warpgroup's tile widths: two warpgroups side by side (block_m = 8 x num_warps)
    make the Gluon tile twice a warpgroup's width, and a w1 tile 128 wide would take the pointer kernel's
    in-epilogue quantization of the intermediate (from fp32, not from the bf16 it writes: 1.1e-2 apart at these
    dimensions, past SAME_TILES_TOL)."""
    split = 16 * config.w1.num_warps // config.block_m
    return MoEConfig(config.block_m, GemmConfig(config.w1.block_n // split, 128, 8, config.w1.num_warps // split, 3),
                     GemmConfig(config.w2.block_n // split, 128, 8, config.w2.num_warps // split, 3))


def _run(x, w1, w2, g, ids, config, **kw):
    taken = gluon_usable(config, align_tokens(ids, w1.shape[0], config.block_m), x, w1, w2, block_fp8=True,
                         out_dtype=torch.bfloat16)
    assert taken, "Gluon path not taken"
    poison_allocator()
    out = torch.full((x.shape[0], w2.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    return fused_experts(x, w1, w2, g, ids, config=config, out=out, fp8=BLOCK_FP8, **kw)


@pytest.mark.parametrize(
    "shape,num_tokens,config",
    [
        (DEEPSEEK_V3_E16, 600, _config()),
        (DEEPSEEK_V3_E16, 600, _config(128, warps=8, stages=3)),
        (DEEPSEEK_V3_E16, 77, _config(bn1=32, bn2=64, stages=3, group_m=1)),
        (RAGGED, 300, _config()),
        (RAGGED, 300, _config(bn1=32, bn2=128)),
        # a producer warp for the copy engine (Gluon's warp specialization)
        (DEEPSEEK_V3_E16, 600, _config(ws=True)),
        (DEEPSEEK_V3_E16, 600, _config(128, warps=8, ws=True)),
        (RAGGED, 300, _config(bn1=32, stages=3, ws=True)),
        # persistent: one program an SM walks many tiles, the producer warp running ahead across them
        (DEEPSEEK_V3_E16, 600, _config(128, warps=8, ws=True, persistent=True)),
        (DEEPSEEK_V3_E16, 2000, _config(ws=True, persistent=True, stages=3)),
        (RAGGED, 300, _config(ws=True, persistent=True)),
        # what default_config takes for block FP8 with N >= 2048 at 40-48 rows per expert past 512 tokens
        (DEEPSEEK_V3_E16, 2000, gluon_mid_config()),
        # 64-row blocks in two warpgroups side by side, each over its own weight boxes (the default from 48 rows):
        # persistent, one role for all warps, and 32-wide boxes on the ragged layer (w2's last tile past its 576
        # columns)
        (DEEPSEEK_V3_E16, 2000, gluon_pair_config()),
        (DEEPSEEK_V3_E16, 600, _config(64, bn1=128, bn2=256, warps=8, stages=3)),
        (RAGGED, 300, _config(64, bn1=64, bn2=128, warps=8, ws=True, persistent=True)),
    ],
)
def test_matches_emulation_and_pointer_kernel(shape, num_tokens, config):
    w1q, w2q, s1, s2 = block_fp8_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=21)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=21)
    kw = dict(w1_scale=s1, w2_scale=s2)
    out = _run(x, w1q, w2q, g, ids, config, **kw)
    deq = dequantize_block(w1q, w2q, s1, s2)
    assert rel_err(out, emulate_fp8(x, w1q, w2q, g, ids, granularity="group", dequantize=deq)) < FP8_VS_EMULATION_TOL
    twin = fused_experts(x, w1q, w2q, g, ids, config=_pointer_twin(config), fp8=BLOCK_FP8, **kw)
    assert rel_err(out, twin.double()) < SAME_TILES_TOL


@pytest.mark.parametrize("on_input", [False, True])
def test_dropped_slots_and_router_weight_on_input(on_input):
    shape, num_tokens = RAGGED, 200
    w1q, w2q, s1, s2 = block_fp8_weights(shape)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=22)
    g, ids = routing(num_tokens, shape.num_experts, 1 if on_input else shape.top_k, seed=22)
    ids[::3, 0] = -1  # slots another rank owns
    kw = dict(w1_scale=s1, w2_scale=s2, apply_router_weight_on_input=on_input)
    out = _run(x, w1q, w2q, g, ids, _config(), **kw)
    twin = fused_experts(x, w1q, w2q, g, ids, config=_pointer_twin(_config()), fp8=BLOCK_FP8, **kw)
    assert rel_err(out, twin.double()) < SAME_TILES_TOL
    if not on_input:  # the emulation scales rows after w2 only
        deq = dequantize_block(w1q, w2q, s1, s2)
        emulated = emulate_fp8(x, w1q, w2q, g, ids, granularity="group", dequantize=deq)
        assert rel_err(out, emulated) < FP8_VS_EMULATION_TOL


# rows per expert: an expert's last 128-row block holds 1, 63, 64, 65, 127 or 128 rows (or the expert none), its
# last 64-row block 1, 30, 36, 63 or 64
TAIL_COUNTS = [1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 0, 255, 256, 257, 30, 100]


@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize(
    "config",
    [_config(128, warps=8, ws=True), _config(128, warps=8, ws=True, persistent=True), gluon_pair_config()],
    ids=["bm128", "bm128-persistent", "bm64-two-warpgroups"],
)
def test_every_expert_tail_length(config, on_input):
    """Pad rows of every count end the experts' last row blocks, their input rows never written (the input is
    quantized straight into the slots that hold a pair): every expert's real rows must come out as the pointer
    kernel's and the emulation's, whichever tile of a persistent program they fall in."""
    shape = DEEPSEEK_V3_E16
    w1q, w2q, s1, s2 = block_fp8_weights(shape)
    experts = torch.repeat_interleave(torch.arange(shape.num_experts), torch.tensor(TAIL_COUNTS))
    gen = torch.Generator().manual_seed(28)
    ids = experts[torch.randperm(experts.numel(), generator=gen)].to(torch.int32).view(-1, 1).cuda()
    g = torch.rand(ids.shape, generator=gen).cuda() if on_input else torch.ones(ids.shape, device="cuda")
    x = hidden_states(ids.shape[0], shape.hidden, torch.bfloat16, seed=28)
    kw = dict(w1_scale=s1, w2_scale=s2, apply_router_weight_on_input=on_input)
    out = _run(x, w1q, w2q, g, ids, config, **kw)
    twin = fused_experts(x, w1q, w2q, g, ids, config=_pointer_twin(config), fp8=BLOCK_FP8, **kw)
    assert rel_err(out, twin.double()) < SAME_TILES_TOL
    for expert in range(shape.num_experts):  # each expert's rows on their own: no expert may lose its tail
        rows = ids[:, 0] == expert
        if rows.any():
            assert rel_err(out[rows], twin[rows].double()) < SAME_TILES_TOL, f"expert {expert}"
    if not on_input:
        deq = dequantize_block(w1q, w2q, s1, s2)
        emulated = emulate_fp8(x, w1q, w2q, g, ids, granularity="group", dequantize=deq)
        assert rel_err(out, emulated) < FP8_VS_EMULATION_TOL


@pytest.mark.parametrize("ws,persistent", [(False, False), (True, False), (True, True)])
def test_cuda_graph_capture_replays_new_routing(ws, persistent):
    shape, num_tokens = DEEPSEEK_V3_E16, 512
    w1q, w2q, s1, s2 = block_fp8_weights(shape)
    config = _config(128, warps=8, ws=ws, persistent=persistent) if ws else _config()
    kw = dict(config=config, fp8=BLOCK_FP8, w1_scale=s1, w2_scale=s2)
    x = hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=23)
    g, ids = routing(num_tokens, shape.num_experts, shape.top_k, seed=23)
    assert gluon_usable(config, align_tokens(ids, shape.num_experts, config.block_m), x, w1q, w2q, block_fp8=True,
                        out_dtype=torch.bfloat16)
    out = torch.empty(num_tokens, shape.hidden, dtype=torch.bfloat16, device="cuda")
    fused_experts(x, w1q, w2q, g, ids, out=out, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts(x, w1q, w2q, g, ids, out=out, **kw)
    x.copy_(hidden_states(num_tokens, shape.hidden, torch.bfloat16, seed=24))
    g2, ids2 = routing(num_tokens, shape.num_experts, shape.top_k, seed=24)
    g.copy_(g2)
    ids.copy_(ids2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    deq = dequantize_block(w1q, w2q, s1, s2)
    assert rel_err(out, emulate_fp8(x, w1q, w2q, g2, ids2, granularity="group", dequantize=deq)) < FP8_VS_EMULATION_TOL


@pytest.mark.parametrize("num_experts,num_tokens,top_k,block_m", [(256, 2000, 8, 128), (8, 3000, 2, 64), (16, 5, 2, 64)])
def test_expert_runs_name_each_row_blocks_expert_run(num_experts, num_tokens, top_k, block_m):
    """The tile order's input: per row block in use, its expert's first row block and row block count."""
    _, ids = routing(num_tokens, num_experts, top_k, seed=26)
    aligned = align_tokens(ids, num_experts, block_m)
    first, count = expert_runs(aligned)
    in_use = int(aligned.num_padded.item()) // block_m
    owners = aligned.block_expert[:in_use].tolist()
    assert first[:in_use].tolist() == [owners.index(e) for e in owners]
    assert count[:in_use].tolist() == [owners.count(e) for e in owners]


def test_a_width_off_the_tile_grid_runs_the_triton_kernel():
    shape = Shape("off-grid", 4, 256, 160, 2)  # 160 is not a multiple of w1.block_n 64
    w1q, w2q, s1, s2 = block_fp8_weights(shape)
    x = hidden_states(64, shape.hidden, torch.bfloat16, seed=25)
    g, ids = routing(64, shape.num_experts, shape.top_k, seed=25)
    config = _config()
    assert not gluon_usable(config, align_tokens(ids, shape.num_experts, config.block_m), x, w1q, w2q, block_fp8=True,
                            out_dtype=torch.bfloat16)
    out = fused_experts(x, w1q, w2q, g, ids, config=config, fp8=BLOCK_FP8, w1_scale=s1, w2_scale=s2)
    deq = dequantize_block(w1q, w2q, s1, s2)
    assert rel_err(out, emulate_fp8(x, w1q, w2q, g, ids, granularity="group", dequantize=deq)) < FP8_VS_EMULATION_TOL


@pytest.mark.parametrize("num_experts,num_tokens,top_k,k_dim",
                         [(256, 2000, 8, 7168), (8, 300, 4, 576), (16, 3, 2, 256)])
def test_float_input_quantized_straight_into_sorted_rows(num_experts, num_tokens, top_k, k_dim):
    """The Gluon path's input: each token quantized once into its slots equals quantizing then gathering, bit for
    bit, in every slot that holds a pair (pad slots are never read into a real row)."""
    x = hidden_states(num_tokens, k_dim, torch.bfloat16, seed=27)
    _, ids = routing(num_tokens, num_experts, top_k, seed=27)
    ids[::7, 0] = -1  # a slot another rank owns: no sorted slot
    aligned = align_tokens(ids, num_experts, 128)
    slot_of_pair = pair_slots(aligned)
    q, scale = quantize_sorted(x, aligned, slot_of_pair)
    q_ref, scale_ref = quantize_activation(x, "group")
    gathered, gathered_scale = gather_sorted(q_ref, scale_ref, 3, aligned)
    in_use = int(aligned.num_padded.item())
    real = aligned.sorted_ids[:in_use] < aligned.num_pairs
    assert torch.equal(q[:in_use][real].view(torch.uint8), gathered[:in_use][real].view(torch.uint8))
    assert torch.equal(scale[:in_use][real], gathered_scale[:in_use][real])
    # pair_slots inverts the sorted list: each local pair's slot, -1 for a pair another rank owns
    slots = torch.arange(in_use, device=x.device, dtype=torch.int32)[real]
    assert torch.equal(slot_of_pair[aligned.sorted_ids[:in_use][real].long()], slots)
    assert torch.equal((slot_of_pair < 0).view(num_tokens, top_k), ids < 0)


@pytest.mark.parametrize("num_experts,num_tokens,top_k,n", [(256, 2000, 8, 2048), (8, 300, 4, 576), (16, 3, 2, 256)])
def test_intermediate_quantized_in_the_rows_that_hold_a_pair(num_experts, num_tokens, top_k, n):
    """The Gluon path's intermediate: every sorted row that holds a pair is quantized as the quantization pass
    does, bit for bit (the other rows are the w2 GEMM's pad rows, whose results are never read)."""
    _, ids = routing(num_tokens, num_experts, top_k, seed=31)
    ids[::5, -1] = -1  # a slot another rank owns
    aligned = align_tokens(ids, num_experts, 128)
    inter = hidden_states(aligned.sorted_ids.numel(), n, torch.bfloat16, seed=31)
    real = torch.zeros(inter.shape[0], dtype=torch.bool, device=inter.device)
    in_use = int(aligned.num_padded.item())
    real[:in_use] = aligned.sorted_ids[:in_use] < aligned.num_pairs
    q, scale = quantize_real_rows(inter, aligned)
    q_ref, scale_ref = quantize_activation(inter, "group")
    assert torch.equal(q[real].view(torch.uint8), q_ref[real].view(torch.uint8))
    assert torch.equal(scale[real], scale_ref[real])
    assert int(real.sum()) == num_tokens * top_k - int((ids < 0).sum())


def test_an_fp32_output_runs_the_triton_kernel():
    """The Gluon epilogue stores 16-bit tiles: FP8 input asked for a float32 output takes the Triton TMA kernel
    with the same config, and still matches the emulation."""
    shape = RAGGED
    w1q, w2q, s1, s2 = block_fp8_weights(shape)
    x = hidden_states(300, shape.hidden, torch.bfloat16, seed=29)
    g, ids = routing(300, shape.num_experts, shape.top_k, seed=29)
    q, scale = quantize_activation(x, "group")
    config = _config()
    aligned = align_tokens(ids, shape.num_experts, config.block_m)
    assert gluon_usable(config, aligned, q, w1q, w2q, block_fp8=True, out_dtype=torch.bfloat16)
    assert not gluon_usable(config, aligned, q, w1q, w2q, block_fp8=True, out_dtype=torch.float32)
    poison_allocator()
    out = fused_experts(q, w1q, w2q, g, ids, config=config, fp8=BLOCK_FP8, w1_scale=s1, w2_scale=s2, a1_scale=scale,
                        out_dtype=torch.float32)
    assert out.dtype == torch.float32
    deq = dequantize_block(w1q, w2q, s1, s2)
    assert rel_err(out, emulate_fp8(x, w1q, w2q, g, ids, granularity="group", dequantize=deq)) < FP8_VS_EMULATION_TOL
