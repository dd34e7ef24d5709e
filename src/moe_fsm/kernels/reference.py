"""The float64 reference every kernel is checked against.

Plain per-(token, slot) math in float64 on dense float weights: slow, obviously
right, and independent of how any kernel groups tokens.
"""

from __future__ import annotations

import torch

from moe_fsm.kernels.activations import apply_activation


def moe_reference(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    swiglu_limit: float | None = None,
    apply_router_weight_on_input: bool = False,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_j g[t,j] * (w2[e] @ act(w1[e] @ x[t] + b1[e]) + b2[e]), e = topk_ids[t,j], in float64.

    ``w1`` [E, 2N, K] and ``w2`` [E, K, N] are dense float (dequantize quantized weights
    first); the biases ``w1_bias`` [E, 2N] and ``w2_bias`` [E, K] are optional. With
    ``apply_router_weight_on_input`` the weight scales the input instead (top-k 1).
    Returns float64 [M, K].
    """
    x = hidden_states.to(torch.float64)
    g = topk_weights.to(torch.float64)
    ids = topk_ids.long()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        weight = g[token, slot].unsqueeze(1)
        xin = x[token] * weight if apply_router_weight_on_input else x[token]
        h = xin @ w1[e].to(torch.float64).T
        if w1_bias is not None:
            h = h + w1_bias[e].to(torch.float64)
        y = apply_activation(activation, h, swiglu_limit) @ w2[e].to(torch.float64).T
        if w2_bias is not None:
            y = y + w2_bias[e].to(torch.float64)
        out.index_add_(0, token, y if apply_router_weight_on_input else y * weight)
    return out
