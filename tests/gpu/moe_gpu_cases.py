"""Shapes, random inputs and references for the GPU experts tests.

The three model shapes of the issue hold up to 22.5 GB of bf16 weights
(DeepSeek-V3), so weights are cached one set at a time and the float64 reference
runs on the experts a batch actually hits, renumbered, rather than on a float64
copy of all of them. FP8 weight sets are drawn directly in their quantized form
(random e4m3 values and random positive scales): a valid checkpoint for the
kernels without a float copy of 256 experts to quantize from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe_fsm.kernels import fp8
from moe_fsm.kernels.activations import apply_activation
from moe_fsm.kernels.reference import moe_reference

BLOCK = 128


@dataclass(frozen=True)
class Shape:
    name: str
    num_experts: int
    hidden: int  # K
    intermediate: int  # N
    top_k: int


QWEN3_30B = Shape("qwen3-30b-a3b", 128, 2048, 768, 8)
MIXTRAL_8X7B = Shape("mixtral-8x7b", 8, 4096, 14336, 2)
DEEPSEEK_V3 = Shape("deepseek-v3", 256, 7168, 2048, 8)

_cache: dict = {}


def _cached(key, make):
    """One weight set on the device at a time: the DeepSeek-V3 sets alone take 11-22 GB."""
    if key not in _cache:
        _cache.clear()
        torch.cuda.empty_cache()
        _cache[key] = make()
    return _cache[key]


def float_weights(shape: Shape, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w1 ~ N(0, 1/K), w2 ~ N(0, 1/N): unit-scale activations through both GEMMs."""

    def make():
        gen = torch.Generator(device="cuda").manual_seed(seed)
        e, k, n = shape.num_experts, shape.hidden, shape.intermediate
        w1 = torch.randn(e, 2 * n, k, device="cuda", dtype=dtype, generator=gen).mul_(k**-0.5)
        w2 = torch.randn(e, k, n, device="cuda", dtype=dtype, generator=gen).mul_(n**-0.5)
        return w1, w2

    return _cached(("float", shape, dtype, seed), make)


def _random_fp8(rows_shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    # e4m3 values spread over several binades, like a quantized checkpoint's
    return torch.randn(rows_shape, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(100).clamp_(-448, 448).to(fp8.FP8_DTYPE)


def block_fp8_weights(shape: Shape, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1q, w2q, w1_scale, w2_scale) with 128x128 block scales, dequantizing to about N(0, 1/K) / N(0, 1/N)."""

    def make():
        gen = torch.Generator(device="cuda").manual_seed(seed)
        e, k, n = shape.num_experts, shape.hidden, shape.intermediate
        w1q = _random_fp8((e, 2 * n, k), gen)
        w2q = _random_fp8((e, k, n), gen)
        s1 = (0.5 + torch.rand(e, -(-2 * n // BLOCK), -(-k // BLOCK), device="cuda", generator=gen)) * (k**-0.5 / 100)
        s2 = (0.5 + torch.rand(e, -(-k // BLOCK), -(-n // BLOCK), device="cuda", generator=gen)) * (n**-0.5 / 100)
        return w1q, w2q, s1, s2

    return _cached(("block", shape, seed), make)


def routing(num_tokens: int, num_experts: int, top_k: int, seed: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random experts per token (as a top-k router picks) and softmax-like positive weights."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, device=device, generator=gen)
    weights, ids = scores.topk(top_k, dim=1)
    return (weights / weights.sum(1, keepdim=True)).to(torch.float32), ids.to(torch.int32)


def hidden_states(num_tokens: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(num_tokens, k, device="cuda", dtype=dtype, generator=gen)


def _compact(topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hit experts, ids renumbered into them; -1 kept for dropped slots)."""
    ids = topk_ids.long()
    hit = torch.unique(ids[ids >= 0])
    compact = torch.where(ids >= 0, torch.searchsorted(hit, ids.clamp(min=0)), -1)
    return hit, compact


def reference(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    dequantize=None,
    **kwargs,
) -> torch.Tensor:
    """moe_reference (float64) on the experts hit; slots with id -1 contribute nothing.

    ``dequantize(hit) -> (w1 [H, 2N, K], w2 [H, K, N])`` gives float weights of the hit
    experts for quantized sets; otherwise ``w1[hit]``/``w2[hit]`` are used as they are.
    """
    hit, compact = _compact(topk_ids)
    d1, d2 = dequantize(hit) if dequantize is not None else (w1[hit], w2[hit])
    kept = compact >= 0
    ids = torch.where(kept, compact, 0)
    weights = torch.where(kept, topk_weights.to(torch.float64), 0.0)
    return moe_reference(hidden, d1, d2, weights, ids, **kwargs)


def dequantize_block(w1q, w2q, s1, s2):
    return lambda hit: (
        fp8.dequantize_weight_block(w1q[hit], s1[hit], torch.float32),
        fp8.dequantize_weight_block(w2q[hit], s2[hit], torch.float32),
    )


def quantize_rowwise(w1: torch.Tensor, w2: torch.Tensor, granularity: str):
    """(w1q, w2q, s1, s2, dequantize) for per-tensor or per-channel FP8 weights from float ones."""
    quant, deq = {
        "tensor": (fp8.quantize_weight_per_tensor, fp8.dequantize_weight_per_tensor),
        "channel": (fp8.quantize_weight_per_channel, fp8.dequantize_weight_per_channel),
    }[granularity]
    w1q, s1 = quant(w1)
    w2q, s2 = quant(w2)
    return w1q, w2q, s1, s2, lambda hit: (deq(w1q[hit], s1[hit], torch.float32), deq(w2q[hit], s2[hit], torch.float32))


def emulate_fp8(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    granularity: str,
    a1_scale: Optional[torch.Tensor] = None,
    a2_scale: Optional[torch.Tensor] = None,
    dequantize,
    activation: str = "silu",
) -> torch.Tensor:
    """The w8a8 layer with both activation quantizations done in torch, the GEMMs in float64.

    It differs from the kernels only by accumulation order and the odd value that lands
    across an e4m3 rounding boundary, so it checks scale indexing tightly where the
    float64 reference, with unquantized activations, can only bound the FP8 error.
    Per-tensor dynamic scales of the intermediate cover the rows this batch computes.
    """
    quantizers = {
        "group": lambda x, s: fp8.quantize_per_group(x),
        "token": fp8.quantize_per_token,
        "tensor": fp8.quantize_per_tensor,
    }

    def qdq(x: torch.Tensor, static: Optional[torch.Tensor]) -> torch.Tensor:
        q, scale = quantizers[granularity](x.to(torch.float32), static)
        return fp8.dequantize_activation(q, scale, torch.float64)

    hit, compact = _compact(topk_ids)
    d1, d2 = dequantize(hit)
    x = qdq(hidden, a1_scale)
    token, slot = (compact >= 0).nonzero(as_tuple=True)
    experts = compact[token, slot]
    inter = torch.empty(token.numel(), d2.shape[2], dtype=torch.float64, device=hidden.device)
    for e in torch.unique(experts).tolist():
        rows = (experts == e).nonzero(as_tuple=True)[0]
        inter[rows] = apply_activation(activation, x[token[rows]] @ d1[e].to(torch.float64).T)
    inter = qdq(inter, a2_scale)
    out = torch.zeros(hidden.shape[0], d2.shape[1], dtype=torch.float64, device=hidden.device)
    for e in torch.unique(experts).tolist():
        rows = (experts == e).nonzero(as_tuple=True)[0]
        y = inter[rows] @ d2[e].to(torch.float64).T
        out.index_add_(0, token[rows], y * topk_weights[token[rows], slot[rows]].to(torch.float64)[:, None])
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||; NaN anywhere in ``out`` fails (NaN never compares below a bound)."""
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out.to(torch.float64) - ref).norm() / ref.norm()).item()


def poison_allocator(num_bytes: int = 1 << 30) -> None:
    """Leave NaN-filled blocks in torch's caching allocator, so unwritten workspace reads as NaN."""
    filler = torch.full((num_bytes // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del filler
