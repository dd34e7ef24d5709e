"""Small random MoE calls for the modular-kernel tests (shapes, routing, scales)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import pytest
import torch

from moe_fsm.experts.torch_experts import TorchBatchedExperts, TorchExperts
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.kernels.reference import moe_reference
from moe_fsm.modular.interfaces import ExpertScales
from moe_fsm.modular.kernel import ModularKernel
from moe_fsm.prepare_finalize.local import LocalBatchedPrepareFinalize, LocalPrepareFinalize
from moe_fsm.quantize.weights import dequantize_weights, quantize_experts

FORMATS = {
    "standard": (LocalPrepareFinalize, TorchExperts),
    "batched": (LocalBatchedPrepareFinalize, TorchBatchedExperts),
}
SCHEMES = [QuantScheme.unquantized(), QuantScheme.fp8("block", "group"), QuantScheme.fp8("tensor", "tensor"),
           QuantScheme.fp8("channel", "token", True), QuantScheme.nvfp4()]
# Tolerance vs the float64 reference on the dequantized weights (see tests/kernels/test_torch_experts.py).
REFERENCE_TOL = {"unquantized": 1e-5, "fp8": 0.1, "nvfp4": 0.3}


@pytest.fixture(autouse=True)
def single_thread():
    """Tiny GEMMs gain nothing from threads, and on a busy 2-core machine OpenMP spinning makes them 100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def seed_for(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def layer_for(scheme: QuantScheme = QuantScheme.unquantized(), **overrides) -> MoELayer:
    shape = dict(num_experts=6, top_k=2, hidden_size=160, intermediate_size=96, dtype="float32")
    return MoELayer(quant=scheme, **{**shape, **overrides})


def kernel_for(layer: MoELayer, fmt: str = "standard") -> ModularKernel:
    pf_cls, experts_cls = FORMATS[fmt]
    return ModularKernel(pf_cls(), experts_cls(layer), layer)


@dataclass
class Call:
    layer: MoELayer
    hidden: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    scales: ExpertScales
    w1_float: torch.Tensor = field(repr=False)
    w2_float: torch.Tensor = field(repr=False)

    def args(self) -> tuple:
        return self.hidden, self.w1, self.w2, self.topk_weights, self.topk_ids

    def reference(self, topk_weights: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None) -> torch.Tensor:
        return moe_reference(
            self.hidden, self.w1_float, self.w2_float,
            self.topk_weights if topk_weights is None else topk_weights,
            self.topk_ids if topk_ids is None else topk_ids,
            activation=self.layer.activation.value, swiglu_limit=self.layer.swiglu_limit,
            apply_router_weight_on_input=self.layer.router_weight_on_input,
        )


def make_call(layer: MoELayer, num_tokens: int, seed: int, *, experts_used: int | None = None) -> Call:
    """Random call; ``experts_used`` routes every token to the first few experts only (the rest get none)."""
    gen = torch.Generator().manual_seed(seed)
    e, k, n, dtype = layer.num_experts, layer.hidden_size, layer.intermediate_size, getattr(torch, layer.dtype)
    hidden = torch.randn(num_tokens, k, generator=gen).to(dtype)
    w1 = (torch.randn(e, 2 * n, k, generator=gen) / k**0.5).to(dtype)
    w2 = (torch.randn(e, k, n, generator=gen) / n**0.5).to(dtype)
    pool = experts_used or e
    ids = torch.argsort(torch.rand(num_tokens, pool, generator=gen), dim=1)[:, : layer.top_k]
    weights = torch.softmax(torch.randn(num_tokens, layer.top_k, generator=gen), dim=1)
    sample = hidden if num_tokens else torch.randn(4, k, generator=gen).to(dtype)
    w1q, w2q, scales = quantize_experts(w1, w2, layer, sample)
    w1f, w2f = dequantize_weights(w1q, w2q, scales, layer.quant, torch.float64)
    return Call(layer, hidden, w1q, w2q, weights, ids.to(torch.int64), scales, w1f, w2f)


def rel_fro(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.to(torch.float64) - ref).norm() / ref.norm().clamp(min=1e-30))
