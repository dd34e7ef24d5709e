"""A weight-only kernel's stand-in keeps its numerics: vLLM's Marlin runs 16-bit activations, so does what runs it here.

vLLM 0.33 decides MARLIN for an NVFP4 (W4A4) checkpoint on Hopper: Marlin dequantizes the FP4 weights and
quantizes nothing else. The stand-in that runs it where Marlin cannot load must compute that function, not the
W4A4 emulation's (relative error 1.6e-1 against the float64 reference of the dequantized weights, where a
weight-only kernel stays near 3e-3).
"""

from __future__ import annotations

import json

import pytest
import torch

from moe_fsm.backends import stand_ins
from moe_fsm.backends.registry import default_registry
from moe_fsm.decision import select
from moe_fsm.engine.run import WEIGHT_ONLY_TOLERANCE, make_weights, tolerance
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.platform import preset
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.kernels.reference import moe_reference
from moe_fsm.runtime import build
from moe_fsm.trace.schema import errors as schema_errors

NVFP4 = MoELayer(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64, dtype="bfloat16",
                 quant=QuantScheme.nvfp4())


def _marlin_decision(layer: MoELayer):
    decision = select(layer, platform=preset("sm90"), env={}, policy="vllm-0.33")
    assert (decision.backend, decision.kernel) == ("MARLIN", "MarlinExperts")
    return decision


def test_marlin_is_weight_only_in_the_profile_and_the_triton_experts_are_not():
    kernels = default_registry("vllm-0.33").kernels
    assert kernels["MarlinExperts"].weight_only and kernels["BatchedMarlinExperts"].weight_only
    assert not kernels["TritonExperts"].weight_only and not kernels["FlashInferExperts"].weight_only


def test_the_stand_in_of_marlin_runs_the_nvfp4_weights_with_16_bit_activations():
    kernel = build(_marlin_decision(NVFP4), device="cpu")
    assert kernel.stand_in.weight_only and kernel.stand_in.label == "moe-fsm torch experts, 16-bit activations"
    assert kernel.layer.quant.activation is None and kernel.layer.quant.weight == NVFP4.quant.weight
    assert kernel.stand_in.to_json()["activations"] == "16-bit, as the weight-only kernel it replaces computes"

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(32, NVFP4.hidden_size, generator=gen).to(torch.bfloat16)
    weights = make_weights(NVFP4, gen, torch.device("cpu"), x)
    logits = torch.randn(32, NVFP4.num_experts, generator=gen)
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, -1), NVFP4.top_k, -1)
    out = torch.full_like(x, float("nan"))
    out.copy_(kernel(x, weights.w1, weights.w2, topk_weights, topk_ids, scales=weights.scales))
    ref = moe_reference(x.double(), weights.w1_ref.double(), weights.w2_ref.double(), topk_weights.double(), topk_ids)
    err = float((out.double() - ref).norm() / ref.norm())
    # bf16 rounding of the output and the intermediate: ~3e-3; the W4A4 emulation gave ~1.7e-1 here
    assert err < 1e-2, err
    assert tolerance(kernel.layer) == WEIGHT_ONLY_TOLERANCE


def test_the_trace_names_the_activations_the_stand_in_computes_with(tmp_path):
    from moe_fsm.engine.engine import Engine
    from moe_fsm.plan.decider import LayerSpec

    loaded = Engine([LayerSpec("l0", NVFP4)], platform=preset("sm90"), env={}, policy="vllm-0.33",
                    trace_dir=tmp_path, device="cpu").load()
    document = json.loads(loaded[0].trace_path.read_text())
    stand_in = document["build"]["stand_in"]
    assert stand_in["replaces"] == "MarlinExperts" and stand_in["activations"].startswith("16-bit")
    # the key is part of the trace's schema: the written trace validates (it did not when the key was new)
    assert schema_errors(document) == []


@pytest.mark.parametrize("device, impl", [("cpu", stand_ins.TORCH), ("cuda", stand_ins.TRITON_NVFP4)])
def test_a_weight_only_stand_in_is_chosen_for_the_layer_the_kernel_computes(device, impl):
    layer = MoELayer(quant=QuantScheme.nvfp4(), dtype="bfloat16")
    chosen = stand_ins.choose(layer, ActivationFormat.STANDARD, device, "MarlinExperts", "not loadable",
                              weight_only=True)
    assert chosen.impl == impl and chosen.weight_only
    computed = stand_ins.computed_layer(layer, True)
    assert computed.quant.activation is None and computed.family is layer.family
    unchanged = stand_ins.choose(layer, ActivationFormat.STANDARD, device, "X", "not loadable")
    assert not unchanged.weight_only and stand_ins.computed_layer(layer, False) is layer


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fp8_marlin_keeps_the_declared_scheme_where_moe_fsm_has_no_fp8_weight_only_one(device):
    """moe-fsm's FP8 schemes all carry an activation key: the stand-in emulates it, and does not claim otherwise;
    on CUDA it is the Triton w8a8 experts, which take that scheme."""
    layer = MoELayer(quant=QuantScheme.fp8("channel", "token"), dtype="bfloat16")
    assert stand_ins.computed_layer(layer, True) is layer
    chosen = stand_ins.choose(layer, ActivationFormat.STANDARD, device, "MarlinExperts", "not loadable",
                              weight_only=True)
    assert not chosen.weight_only
    assert chosen.impl == (stand_ins.TRITON if device == "cuda" else stand_ins.TORCH)
