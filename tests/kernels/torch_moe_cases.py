"""Random MoE cases and an independent float64 emulation of the quantized kernels.

The emulation restates the survey's quantization formulas (it does not call
moe_fsm's quantizers), routes every (token, slot) pair densely, and re-quantizes
the intermediate between the GEMMs, which the float64 reference (moe_reference,
unquantized activations) cannot do. GEMMs and activations run in float64; the
quantization steps take float32 inputs and form scales and scaled values in
float32, because that is the arithmetic the kernels define: with bf16 data,
``x * (g / s)`` lands exactly on an e2m1 midpoint in float32 where float64 would
fall just below it, and the kernel's tie rule is what counts.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch

from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import NVFP4_STATIC, Granularity, QuantFamily, QuantScheme
from moe_fsm.kernels.activations import apply_activation
from moe_fsm.modular.interfaces import ExpertScales
from moe_fsm.quantize.weights import dequantize_weights, quantize_experts

FP8_MAX = 448.0
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)

ALL_FP8 = [
    QuantScheme.fp8(w, a, s)
    for w in ("tensor", "channel", "block")
    for a, s in (("tensor", True), ("tensor", False), ("token", True), ("token", False), ("group", False))
]
NVFP4_WEIGHT_ONLY = QuantScheme(QuantFamily.NVFP4, NVFP4_STATIC, None)


@pytest.fixture(autouse=True)
def single_thread():
    """Tiny GEMMs gain nothing from threads, and on a busy 2-core machine OpenMP spinning makes them 100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def seed_for(*parts: object) -> int:
    """A per-case seed: every case draws different data, reproducibly."""
    return zlib.crc32(repr(parts).encode())


@dataclass
class Case:
    layer: MoELayer
    hidden: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    scales: ExpertScales
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    w1_float: torch.Tensor  # float64 view of the weights the kernel holds
    w2_float: torch.Tensor


def random_routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token; softmax weights, or spread over [0.2, 1.5] for top-1 (softmax would give 1)."""
    ids = torch.argsort(torch.rand(num_tokens, num_experts, generator=gen), dim=1)[:, :top_k]
    if top_k == 1:
        weights = 0.2 + 1.3 * torch.rand(num_tokens, 1, generator=gen)
    else:
        weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=1)
    return weights.to(torch.float32), ids.to(torch.int32)


def make_case(layer: MoELayer, num_tokens: int, seed: int) -> Case:
    """Random inputs; static activation scales calibrated on what the experts will see (this batch)."""
    gen = torch.Generator().manual_seed(seed)
    e, k, n, dtype = layer.num_experts, layer.hidden_size, layer.intermediate_size, getattr(torch, layer.dtype)
    hidden = torch.randn(num_tokens, k, generator=gen).to(dtype)
    w1 = (torch.randn(e, 2 * n, k, generator=gen) / k**0.5).to(dtype)
    w2 = (torch.randn(e, k, n, generator=gen) / n**0.5).to(dtype)
    topk_weights, topk_ids = random_routing(num_tokens, e, layer.top_k, gen)
    sample = hidden * topk_weights.to(dtype) if layer.router_weight_on_input else hidden
    w1q, w2q, scales = quantize_experts(w1, w2, layer, sample if num_tokens else torch.randn(4, k, generator=gen))
    w1f, w2f = dequantize_weights(w1q, w2q, scales, layer.quant, torch.float64)
    return Case(layer, hidden, w1q, w2q, scales, topk_weights, topk_ids, w1f, w2f)


# Float64 restatement of the activation quantizers --------------------------------


def _fp8_qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x, scale = x.to(torch.float32), scale.to(torch.float32)
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.to(torch.float64) * scale.to(torch.float64)


def _dynamic(amax: torch.Tensor) -> torch.Tensor:
    return amax.to(torch.float32).clamp(min=1e-10) / FP8_MAX


def fp8_qdq(x: torch.Tensor, granularity: Granularity, static: Optional[torch.Tensor]) -> torch.Tensor:
    if static is not None:
        return _fp8_qdq(x, static.reshape(-1, 1) if static.numel() > 1 else static.reshape(()))
    if granularity is Granularity.TENSOR:
        return _fp8_qdq(x, _dynamic(x.abs().max() if x.numel() else torch.zeros((), dtype=x.dtype)))
    if granularity is Granularity.TOKEN:
        return _fp8_qdq(x, _dynamic(x.abs().amax(dim=-1, keepdim=True)))
    out = torch.empty_like(x)
    for start in range(0, x.shape[-1], 128):
        chunk = x[:, start : start + 128]
        out[:, start : start + 128] = _fp8_qdq(chunk, _dynamic(chunk.abs().amax(dim=-1, keepdim=True)))
    return out


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest grid value; on an exact tie, the one with an even index (round half to even)."""
    distance = (x.abs().unsqueeze(-1) - E2M1_GRID).abs()
    odd_penalty = (torch.arange(8) % 2).to(torch.float64) * 1e-12
    return E2M1_GRID[torch.argmin(distance + odd_penalty, dim=-1)] * torch.sign(x)


def nvfp4_qdq(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    g = global_scale.to(torch.float32).reshape(())
    blocks = x.to(torch.float32).reshape(x.shape[0], -1, 16)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    s = (g * (amax * (1 / 6))).clamp(max=448).to(torch.float8_e4m3fn).to(torch.float32)
    ratio = torch.where(s == 0, torch.zeros_like(s), g / s)
    q = _round_e2m1((blocks * ratio).clamp(-6, 6).to(torch.float64))
    return (q * (s.to(torch.float64) / g.to(torch.float64))).reshape(x.shape)


def activation_qdq(scheme: QuantScheme, scales: ExpertScales, stage: int) -> Callable[[torch.Tensor], torch.Tensor]:
    key = scheme.activation
    if key is None:
        return lambda x: x
    if scheme.family is QuantFamily.NVFP4:
        g = (scales.a1_global_scale, scales.a2_global_scale)[stage].amin()
        return lambda x: nvfp4_qdq(x, g)
    static = (scales.a1_scale, scales.a2_scale)[stage] if key.static else None
    return lambda x: fp8_qdq(x, key.granularity, static)


def emulate(case: Case, *, topk_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 [M, K]: the quantized kernel's arithmetic, with activation QDQ where the kernels quantize."""
    layer = case.layer
    ids = (case.topk_ids if topk_ids is None else topk_ids).long()
    weights = case.topk_weights.to(torch.float64)
    x = case.hidden.to(torch.float64)
    if layer.router_weight_on_input:
        x = x * weights.to(x.dtype).reshape(-1, 1)
    x = activation_qdq(layer.quant, case.scales, 0)(x)
    valid = ids >= 0
    safe = ids.clamp(min=0)
    h = torch.einsum("mk,mjnk->mjn", x, case.w1_float[safe])
    inter = apply_activation(layer.activation.value, h, layer.swiglu_limit) * valid.unsqueeze(-1)
    flat = inter[valid]
    flat = activation_qdq(layer.quant, case.scales, 1)(flat)
    inter = torch.zeros_like(inter)
    inter[valid] = flat
    y = torch.einsum("mjn,mjkn->mjk", inter, case.w2_float[safe])
    if not layer.router_weight_on_input:
        y = y * weights.unsqueeze(-1)
    return (y * valid.unsqueeze(-1)).sum(dim=1)


def rel_fro(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius), the whole-layer error."""
    return float((out.to(torch.float64) - ref).norm() / ref.norm().clamp(min=1e-30))


def rel_median(out: torch.Tensor, ref: torch.Tensor) -> float:
    """median |out - ref| / max |ref|: what a typical element is off by."""
    return float((out.to(torch.float64) - ref).abs().median() / ref.abs().max().clamp(min=1e-30))
