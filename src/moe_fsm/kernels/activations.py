"""Gated activations on the first GEMM's output [.., 2N] -> [.., N].

w1 stacks the gate rows before the up rows, so the gate is the first half of
the last dimension and the up projection the second half, for every activation.
"""

from __future__ import annotations

import torch

SWIGLUOAI_ALPHA = 1.702


def _clamp(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SwiGLU clamp: gate capped above, up clipped both ways (gpt-oss, DeepSeek-V4 style)."""
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(min=-limit, max=limit)


def silu_and_mul(h: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    gate, up = _clamp(gate, up, limit)
    return torch.nn.functional.silu(gate) * up


def gelu_and_mul(h: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    gate, up = _clamp(gate, up, limit)
    return torch.nn.functional.gelu(gate) * up


def swigluoai_and_mul(h: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """gpt-oss SwiGLU: (up + 1) * gate * sigmoid(alpha * gate), after the clamp."""
    gate, up = h.chunk(2, dim=-1)
    gate, up = _clamp(gate, up, limit)
    return (up + 1) * (gate * torch.sigmoid(SWIGLUOAI_ALPHA * gate))


ACTIVATIONS = {
    "silu": silu_and_mul,
    "gelu": gelu_and_mul,
    "swigluoai": swigluoai_and_mul,
}

# the ACTIVATION constexpr every Triton experts kernel branches on (triton_moe, its Hopper kernels, triton_wq)
TRITON_ACTIVATION_CODES = {"silu": 0, "gelu": 1, "swigluoai": 2}


def apply_activation(name: str, h: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    try:
        fn = ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not one of {sorted(ACTIVATIONS)}") from None
    return fn(h, limit)
