"""The MoE layer through torch's grouped GEMMs (``torch._grouped_mm`` / ``torch._scaled_grouped_mm``).

Pairs are sorted by expert on the device (a stable sort, per-expert counts by
scatter-add and their prefix sum as the group offsets: no host sync), the token
rows are gathered in that order, two grouped GEMMs run with torch's gated
activation between them, and the rows are weighted, put back in (token, slot)
order and summed over top-k. It is a baseline built only from torch operators:
several launches and a permuted copy of the activations per call, where the
Triton kernels fuse those steps.

FP8 here is row-wise only, which is what ``torch._scaled_grouped_mm`` takes: one
fp32 scale per activation row and one per weight output channel. Per-tensor
scales are broadcast to that form (the same numbers); 128x128 block weights and
1x128 group activations are not expressible and are ineligible.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_fsm.errors import BackendUnavailableError, KernelInputError
from moe_fsm.kernels import fp8
from moe_fsm.kernels.activations import apply_activation


def _require(op: str) -> None:
    if not hasattr(torch, op):
        raise BackendUnavailableError(f"torch.{op} is missing from torch {torch.__version__} (needs torch >= 2.8)")


def _rowwise_weight_scale(scale: Optional[torch.Tensor], num_experts: int, rows: int, name: str) -> torch.Tensor:
    """Per-tensor [E] or per-channel [E, rows] scales as the [E, rows] fp32 layout the op takes."""
    if scale is None:
        raise KernelInputError(f"FP8 weights need {name}")
    s = scale.to(torch.float32)
    if s.numel() == num_experts:
        return s.reshape(num_experts, 1).expand(num_experts, rows).contiguous()
    if s.numel() == num_experts * rows:
        return s.reshape(num_experts, rows).contiguous()
    raise KernelInputError(f"{name} must be per-tensor [E={num_experts}] or per-channel [E, {rows}]; got {list(scale.shape)}")


def _rowwise_activation(
    x: torch.Tensor, granularity: str, static: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 rows and one fp32 scale per row ([rows]) from a per-tensor or per-token quantizer."""
    if granularity == "tensor":
        q, scale = fp8.quantize_per_tensor(x, static)
        return q, scale.to(torch.float32).expand(x.shape[0]).contiguous()
    q, scale = fp8.quantize_per_token(x, static)
    return q, scale.to(torch.float32).reshape(x.shape[0])


def grouped_mm_moe(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    swiglu_limit: Optional[float] = None,
    apply_router_weight_on_input: bool = False,
    fp8_activation: Optional[str] = None,
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    a1_scale: Optional[torch.Tensor] = None,
    a2_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The MoE layer ``[M, K]`` (same function as ``moe_reference``) through grouped GEMMs.

    bf16: ``hidden``, ``w1`` [E, 2N, K], ``w2`` [E, K, N] in bfloat16. FP8: weights in
    float8_e4m3fn with per-tensor/per-channel scales, ``fp8_activation`` "tensor" or "token",
    optional static ``a1_scale``/``a2_scale``; ``hidden`` stays bf16 and is quantized here.
    Slots with ids outside [0, E) contribute nothing.
    """
    quantized = fp8_activation is not None
    _require("_scaled_grouped_mm" if quantized else "_grouped_mm")
    if hidden.dtype != torch.bfloat16:
        raise KernelInputError(f"the grouped-GEMM experts take bfloat16 hidden states; got {hidden.dtype}")
    want = fp8.FP8_DTYPE if quantized else torch.bfloat16
    if w1.dtype != want or w2.dtype != want:
        raise KernelInputError(f"w1/w2 must be {want} here; got {w1.dtype} and {w2.dtype}")
    if fp8_activation not in (None, "tensor", "token"):
        raise KernelInputError(f"fp8_activation {fp8_activation!r} is not one of None, 'tensor', 'token'")
    num_tokens, k_dim = hidden.shape
    num_experts, two_n, _ = w1.shape
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).long()
    local = (flat_ids >= 0) & (flat_ids < num_experts)
    key = torch.where(local, flat_ids, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=hidden.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offsets = torch.cumsum(counts[:num_experts], 0, dtype=torch.int32)
    sorted_local = local[order]
    weight = torch.where(local, topk_weights.reshape(-1).to(torch.float32), 0.0)[order]
    tokens = order // top_k

    if quantized:
        xq, xs = _rowwise_activation(hidden, fp8_activation, a1_scale)
        h = torch._scaled_grouped_mm(
            xq[tokens], w1.transpose(1, 2), xs[tokens],
            _rowwise_weight_scale(w1_scale, num_experts, two_n, "w1_scale"),
            offs=offsets, out_dtype=torch.bfloat16,
        )
    else:
        h = torch._grouped_mm(hidden[tokens], w1.transpose(1, 2), offs=offsets)
    if apply_router_weight_on_input:
        h = h * weight[:, None].to(h.dtype)
    inter = apply_activation(activation, h, swiglu_limit)
    if quantized:
        if fp8_activation == "tensor" and a2_scale is None:
            # a dynamic per-tensor scale must not see the uncomputed rows of other ranks' slots
            inter = torch.where(sorted_local[:, None], inter, torch.zeros((), dtype=inter.dtype, device=inter.device))
        iq, iscale = _rowwise_activation(inter, fp8_activation, a2_scale)
        y = torch._scaled_grouped_mm(
            iq, w2.transpose(1, 2), iscale,
            _rowwise_weight_scale(w2_scale, num_experts, k_dim, "w2_scale"),
            offs=offsets, out_dtype=torch.bfloat16,
        )
    else:
        y = torch._grouped_mm(inter, w2.transpose(1, 2), offs=offsets)
    # rows past the last offset (slots of other ranks) were never computed: zero them, do not scale them
    scaled = y.to(torch.float32) if apply_router_weight_on_input else y.to(torch.float32) * weight[:, None]
    scaled = torch.where(sorted_local[:, None], scaled, 0.0)
    per_slot = torch.empty_like(scaled).index_copy_(0, order, scaled)
    return per_slot.view(num_tokens, top_k, k_dim).sum(dim=1).to(hidden.dtype)
