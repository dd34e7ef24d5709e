"""Bad input is refused before any kernel runs, with a message naming what is wrong and what is accepted."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from modular_cases import kernel_for, layer_for, make_call, seed_for, single_thread  # noqa: F401

from moe_fsm.errors import InputError, KernelInputError
from moe_fsm.experts.torch_experts import TorchBatchedExperts, TorchExperts
from moe_fsm.inputs.quant import Granularity, QuantFamily, QuantKey, QuantScheme
from moe_fsm.modular.kernel import ModularKernel
from moe_fsm.prepare_finalize.local import LocalBatchedPrepareFinalize, LocalPrepareFinalize

FP8_BLOCK = QuantScheme.fp8("block", "group")
FP8_STATIC = QuantScheme.fp8("tensor", "tensor", True)
NVFP4 = QuantScheme.nvfp4()


def refused(scheme: QuantScheme, message: str, **changes) -> None:
    """Run a valid call with ``changes`` applied (tensors by name, or 'scales' fields) and expect ``message``."""
    layer = layer_for(scheme)
    call = make_call(layer, 8, seed_for("valid", scheme))
    args = dict(hidden_states=call.hidden, w1=call.w1, w2=call.w2, topk_weights=call.topk_weights, topk_ids=call.topk_ids)
    expert_map = changes.pop("expert_map", None)
    scale_changes = changes.pop("scales", {})
    args.update({k: (v(args[k]) if callable(v) else v) for k, v in changes.items()})
    scales = replace(call.scales, **{k: (v(getattr(call.scales, k)) if callable(v) else v) for k, v in scale_changes.items()})
    with pytest.raises(KernelInputError, match=re.escape(message)):
        kernel_for(layer)(*args.values(), scales=scales, expert_map=expert_map)


def test_a_valid_call_passes() -> None:
    for scheme in (QuantScheme.unquantized(), FP8_BLOCK, FP8_STATIC, NVFP4):
        layer = layer_for(scheme)
        call = make_call(layer, 8, seed_for("valid", scheme))
        kernel_for(layer)(*call.args(), scales=call.scales)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(hidden_states=lambda h: h[:, :100]), "hidden_states has shape [8, 100]; this layer accepts [M, 160]"),
        (dict(hidden_states=lambda h: h[0]), "hidden_states has shape [160]; this layer accepts [M, 160]"),
        (dict(hidden_states=lambda h: h.to(torch.bfloat16)), "hidden_states has dtype torch.bfloat16; accepted: torch.float32"),
        (dict(w1=lambda w: w[:, :100]), "w1 has shape [6, 100, 160]; this layer accepts [6, 192, 160] ([E, 2N, K])"),
        (dict(w2=lambda w: w[:5]), "w2 has shape [5, 160, 96]; this layer accepts [6, 160, 96] ([E, K, N])"),
        (dict(w1=lambda w: w.to(torch.float16)), "w1 has dtype torch.float16; accepted: torch.float32"),
        (dict(topk_ids=lambda t: t.float()), "topk_ids has dtype torch.float32; accepted: torch.int32, torch.int64"),
        (dict(topk_ids=lambda t: t[:, :1]), "topk_ids has shape [8, 1]; this layer accepts [8, 2] ([M, top_k])"),
        (dict(topk_weights=lambda t: t[:4]), "topk_weights has shape [4, 2]; this layer accepts [8, 2] ([M, top_k])"),
        (dict(topk_weights=lambda t: t.long()), "topk_weights has dtype torch.int64; accepted: a floating dtype"),
        (dict(topk_ids=lambda t: torch.where(t == t[0, 0], 6, t)), "topk_ids holds expert id 6; accepted: 0..5 (-1 only with an expert_map)"),
        (dict(topk_ids=lambda t: torch.where(t == t[0, 0], -1, t)), "topk_ids holds expert id -1; accepted: 0..5 (-1 only with an expert_map)"),
        (dict(w1=lambda w: w.to("meta")), "w1 is on meta; every tensor must be on hidden_states' device cpu"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_unquantized_refusals(changes, message) -> None:
    refused(QuantScheme.unquantized(), message, **changes)


def test_expert_map_refusals() -> None:
    unq = QuantScheme.unquantized()
    refused(unq, "topk_ids holds expert id -2; accepted: 0..5 or -1 (slot skipped)",
            topk_ids=lambda t: torch.where(t == t[0, 0], -2, t), expert_map=torch.arange(6))
    refused(unq, "expert_map has shape [5]; this layer accepts [6]", expert_map=torch.arange(5))
    refused(unq, "expert_map has dtype torch.float32; accepted: torch.int32, torch.int64", expert_map=torch.arange(6.0))
    refused(unq, "expert_map values must lie in -1..5 (w1 holds 6 local experts)", expert_map=torch.tensor([0, 1, 2, 3, 4, 6]))
    refused(unq, "expert_map must name each of the 6 local experts exactly once; it maps 6 global experts to 5 distinct local ids",
            expert_map=torch.tensor([0, 1, 2, 3, 4, 4]))


def test_fp8_refusals() -> None:
    refused(FP8_BLOCK, "w1 has dtype torch.float32; accepted: torch.float8_e4m3fn", w1=lambda w: w.float())
    refused(FP8_BLOCK, "ExpertScales.w1_scale is missing; weight quantization fp8_e4m3:static:block128x128 needs it",
            scales={"w1_scale": None})
    refused(FP8_BLOCK, "ExpertScales.w2_scale has shape [6, 1, 1]; this layer accepts [6, 2, 1]",
            scales={"w2_scale": lambda s: s[:, :1]})
    refused(FP8_BLOCK, "ExpertScales.w1_scale has dtype torch.float64; accepted: torch.float32",
            scales={"w1_scale": lambda s: s.double()})
    refused(FP8_STATIC, "ExpertScales.a1_scale is missing; activation quantization fp8_e4m3:static:tensor needs it",
            scales={"a1_scale": None})
    refused(FP8_STATIC, "ExpertScales.a2_scale has 3 elements; fp8_e4m3:static:tensor accepts [1]",
            scales={"a2_scale": torch.ones(3)})
    refused(FP8_STATIC, "ExpertScales.a1_scale must be finite and positive; got [0.0]", scales={"a1_scale": torch.zeros(1)})
    refused(QuantScheme.fp8("channel", "token", True), "ExpertScales.a1_scale has 3 elements; fp8_e4m3:static:token accepts [1, 8]",
            scales={"a1_scale": torch.ones(3)})


def test_nvfp4_refusals() -> None:
    refused(NVFP4, "w1 has shape [6, 192, 160]; this layer accepts [6, 192, 80] ([E, 2N, K/2, 2 values per byte])",
            w1=lambda w: torch.zeros(6, 192, 160, dtype=torch.uint8))
    refused(NVFP4, "w2 has dtype torch.int8; accepted: torch.uint8", w2=lambda w: w.to(torch.int8))
    refused(NVFP4, "ExpertScales.w1_global_scale is missing; weight quantization nvfp4:static:group1x16 needs it",
            scales={"w1_global_scale": None})
    refused(NVFP4, "ExpertScales.w2_scale has shape [6, 160, 5]; this layer accepts [6, 160, 6]",
            scales={"w2_scale": lambda s: s[..., :5]})
    refused(NVFP4, "ExpertScales.a1_global_scale is missing; activation quantization nvfp4:dynamic:group1x16 needs it",
            scales={"a1_global_scale": None})
    refused(NVFP4, "ExpertScales.a2_global_scale has 2 elements; nvfp4:dynamic:group1x16 accepts [1, 6]",
            scales={"a2_global_scale": torch.ones(2)})


def test_nvfp4_needs_intermediate_divisible_by_16() -> None:
    """Refused where the layer is described, before any selection or kernel sees it (issue 12, item 5)."""
    with pytest.raises(InputError, match="NVFP4 needs intermediate_size divisible by 16 .* got 40"):
        layer_for(NVFP4, intermediate_size=40)


def test_mismatched_formats_are_refused_at_construction() -> None:
    layer = layer_for()
    with pytest.raises(KernelInputError, match="LocalPrepareFinalize moves tokens in the standard activation format but "
                       "TorchBatchedExperts computes in the batched format"):
        ModularKernel(LocalPrepareFinalize(), TorchBatchedExperts(layer), layer)
    with pytest.raises(KernelInputError, match="LocalBatchedPrepareFinalize moves tokens in the batched activation format but "
                       "TorchExperts computes in the standard format"):
        ModularKernel(LocalBatchedPrepareFinalize(), TorchExperts(layer), layer)


def test_experts_built_for_another_layer_are_refused() -> None:
    with pytest.raises(KernelInputError, match="TorchExperts was built for a different layer than this kernel's"):
        ModularKernel(LocalPrepareFinalize(), TorchExperts(layer_for(top_k=1)), layer_for())


def test_a_scheme_without_emulation_is_refused_by_the_experts() -> None:
    """A key outside the tables (here an FP8 weight with NVFP4-style 1x16 groups) cannot be emulated."""
    scheme = object.__new__(QuantScheme)
    for name, value in (("family", QuantFamily.FP8), ("weight", QuantKey("fp8_e4m3", Granularity.GROUP_1x16, True)),
                        ("activation", None)):
        object.__setattr__(scheme, name, value)
    with pytest.raises(KernelInputError, match=r"weight quantization fp8_e4m3:static:group1x16 has no emulation; accepted: \["):
        TorchExperts(layer_for(scheme))
