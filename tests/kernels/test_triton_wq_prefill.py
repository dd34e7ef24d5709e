"""The weight-quantized MoE's prefill path (``WqConfig.hopper_bf16``) on CPU: the hit experts' weights dequantized
into a 16-bit scratch by ``wq_dequant_kernel``, then the bf16 Hopper GEMMs (``kernels.triton_moe.hopper``).

Under Triton's interpreter (``TRITON_INTERPRET=1 python3 -m pytest tests/kernels/test_triton_wq_prefill.py``; float16
activations, small shapes) every stored format runs the whole path against float64 on the weights the kernel holds,
outputs poisoned first. The interpreter has no GPU to ask for tensor descriptors or SMs, so the tests hand the path a
non-persistent TMA tile and say the call may take it; ``tests/gpu/test_triton_wq.py`` runs it as it is on CUDA.
The config and table checks run everywhere.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_wq_shards import SHAPES, _problem, check_every_stored_layout, interpreter

from moe_fsm.kernels.triton_moe.config import GemmConfig, MoEConfig
from moe_fsm.kernels.triton_wq import WeightQuant, prefill
from moe_fsm.kernels.triton_wq.fused import WqConfig, default_wq_config, relayout_nibbles
from moe_fsm.quantize.weights import dequantize_weights, interleave_gate_up


@pytest.fixture
def hopper_path(monkeypatch):
    """The path as the interpreter can run it: a 16-row, non-persistent TMA tile (no SM count to ask for); every
    call that takes the path is counted."""
    calls = []
    real = prefill.prefill_experts
    monkeypatch.setattr(prefill, "usable", lambda hidden, n, k: True)
    monkeypatch.setattr(prefill, "bf16_config", lambda *a: MoEConfig(16, GemmConfig(32, 32), GemmConfig(32, 32), hopper=True))
    monkeypatch.setattr(prefill, "prefill_experts", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@interpreter
@pytest.mark.parametrize("name", list(SHAPES))
def test_every_format_through_the_scratch_and_the_bf16_kernels(poisoned, hopper_path, name):  # noqa: F811
    check_every_stored_layout(name, 5, WqConfig(16, hopper_bf16=True))
    assert len(hopper_path) == (1 if WeightQuant.for_scheme(SHAPES[name][0]).kind == "int8" else 2)


@interpreter
def test_dequantized_scratch_holds_the_hit_experts_deinterleaved_with_the_bias_columns(poisoned):  # noqa: F811
    """The pass itself: the hit experts' rows exactly as ``dequantize_weights`` gives them (16-bit), gate/up rows
    de-interleaved, the bias in a head and a tail column, zeros after; experts no pair names untouched."""
    scheme, _, w1, w2, scales, b1, _, _, _, _ = _problem("mxfp4 bias", 5)
    w1f, _ = dequantize_weights(w1, w2, scales, scheme, torch.float64)
    experts, rows, k = w1f.shape
    from moe_fsm.kernels.triton_wq.fused import _kernels

    hit = torch.tensor([1, 0, 1, 0, 0], dtype=torch.int32)
    out = torch.full((experts, rows, k + prefill.bias_columns(k)), -7.0, dtype=torch.float16)
    prefill._dequantize(_kernels(), relayout_nibbles(interleave_gate_up(w1)), interleave_gate_up(scales.w1_scale),
                        None, None, interleave_gate_up(b1), hit, out, rows=rows, cols=k, group=32, kind=0,
                        zero_code=128, split=True, deinterleave=True)
    for e in (0, 2):
        assert torch.equal(out[e, :, :k].double(), w1f[e].to(torch.float16).double())
        head, tail = out[e, :, k].double(), out[e, :, k + 1].double()
        assert torch.equal(head, b1[e].to(torch.float16).double())
        # the head alone is off by up to 2**-12 of the bias; head + tail by far less
        assert float((head + tail - b1[e].double()).abs().max()) <= 2**-18 * float(b1[e].abs().max())
        assert not out[e, :, k + 2 :].any()
    assert bool((out[[1, 3]] == -7.0).all())


@pytest.mark.parametrize("flag", ["hopper_bf16", "chain_acc"])
def test_the_flags_round_trip_and_stay_out_of_a_table_until_set(flag):
    tile = WqConfig(128, 64, 128, 4, 3)
    assert flag not in tile.to_json()  # older tables and the tuner's entries read back unchanged
    on = WqConfig.from_json({**tile.to_json(), flag: True})
    assert getattr(on, flag) is True and on.to_json()[flag] is True
    on.check()


@pytest.mark.parametrize("tokens,top_k,experts,takes", [
    (8192, 4, 32, True), (2048, 4, 32, True), (8192, 4, 128, True), (8192, 8, 128, True),  # 256-1024 rows an expert
    (512, 4, 32, False), (2048, 4, 128, False), (2048, 8, 128, False),  # 64-128 rows: the swap-AB kernel was faster
    (255, 8, 4, False),  # many rows, but under 256 tokens
])
def test_default_tile_takes_the_bf16_hopper_path_from_256_rows_an_expert(tokens, top_k, experts, takes):
    config = default_wq_config(tokens, top_k, experts, 2880, 2880)
    assert config.hopper_bf16 is takes
    config.check()  # its swap-AB tile stays valid for calls that cannot take the path


def test_experts_count_the_weight_scratch_where_the_default_takes_the_path():
    from moe_fsm.experts.triton_wq_experts import TritonMxfp4Experts
    from moe_fsm.inputs.layer import MoELayer
    from moe_fsm.inputs.quant import QuantScheme

    layer = MoELayer(quant=QuantScheme.mxfp4(), dtype="bfloat16", num_experts=32, top_k=4, hidden_size=2880,
                     intermediate_size=2880, bias=True, activation="swigluoai", swiglu_limit=7.0)
    experts = TritonMxfp4Experts(layer)
    scratch = prefill.scratch_bytes(32, 2880, 2880, True)
    assert scratch == 32 * 2 * 2880 * 2944 * 2  # w1 with K padded to 2944 for the bias columns
    per_token = (experts.workspace_bytes(4096) - experts.workspace_bytes(2048)) / 2048
    assert experts.workspace_bytes(2048) > scratch > experts.workspace_bytes(1024)
    assert experts.workspace_bytes(8192) - experts.workspace_bytes(4096) == pytest.approx(4096 * per_token)
