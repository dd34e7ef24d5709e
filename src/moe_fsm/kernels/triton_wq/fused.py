"""Host side of the weight-quantized Triton MoE: checks, buffers and the two launches.

``fused_wq_experts`` is the whole layer for tokens as rows: align the (token,
slot) pairs by expert, run the w1 GEMM with bias and gated activation fused, run
the w2 GEMM with bias and the router weight fused, and sum over top-k. No device
value is read on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.inputs.quant import MX_FP4, QuantFamily, QuantScheme
from moe_fsm.kernels.triton_moe._runtime import require_device

ACTIVATIONS = {"silu": 0, "gelu": 1, "swigluoai": 2}
KINDS = {"mxfp4": 0, "int4": 1, "int8": 2}
COMPUTE_DTYPES = (torch.bfloat16, torch.float16)
MX_GROUP = 32
BLOCK_N = 64
BLOCK_K = 64


@dataclass(frozen=True)
class WeightQuant:
    """How the weights are stored: ``kind`` mxfp4 | int4 | int8, ``group`` columns per scale (-1: a whole row),
    ``zero_point`` whether asymmetric zero points come with the scales."""

    kind: str
    group: int
    zero_point: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise KernelInputError(f"weight kind {self.kind!r} is not one of {list(KINDS)}")
        if self.kind == "mxfp4" and (self.group != MX_GROUP or self.zero_point):
            raise KernelInputError("MXFP4 weights have one E8M0 scale per 32 elements and no zero points")
        if self.group != -1 and self.group < 1:
            raise KernelInputError(f"group must be positive or -1 (per row), got {self.group}")

    @classmethod
    def for_scheme(cls, scheme: QuantScheme) -> "WeightQuant":
        """The layout of a scheme these kernels run: MXFP4 with 16-bit activations, or INT4/INT8 WNA16."""
        if scheme.family is QuantFamily.MXFP4 and scheme.weight.dtype == MX_FP4 and scheme.activation is None:
            return cls("mxfp4", MX_GROUP)
        if scheme.family is QuantFamily.INT_WNA16 and not scheme.act_order:
            return cls(f"int{scheme.weight_bits}", scheme.group_size, scheme.zero_point)
        raise KernelInputError(
            "the weight-quantized Triton MoE runs MXFP4 weights with 16-bit activations and INT4/INT8 weight-only "
            f"layers without activation ordering; got {scheme.describe()}"
        )

    @property
    def packing(self) -> int:
        return 1 if self.kind == "int8" else 2

    def columns_per_scale(self, row_length: int) -> int:
        return row_length if self.group == -1 else self.group


@functools.lru_cache(maxsize=None)
def _kernels():
    from moe_fsm.kernels.triton_wq import _kernels as k

    return k


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Pairs sorted by expert and padded to block_m (the Triton MoE's alignment step)."""
    from moe_fsm.kernels.triton_moe.align import align_tokens

    return align_tokens(topk_ids, num_experts, block_m)


def _check_weight(name: str, w: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], quant: WeightQuant,
                  experts: int, rows: int, cols: int) -> int:
    """Shapes and dtypes of one quantized weight [E, rows, cols]; returns its columns per scale."""
    if w.dtype != torch.uint8 or tuple(w.shape) != (experts, rows, cols // quant.packing):
        raise KernelInputError(f"{name} must be uint8 [{experts}, {rows}, {cols // quant.packing}] ({quant.kind}); "
                               f"got {w.dtype} {list(w.shape)}")
    group = quant.columns_per_scale(cols)
    if cols % group:
        raise KernelInputError(f"{name}: {cols} columns are not a multiple of the scale group {group}")
    expected = (experts, rows, cols // group)
    if tuple(scale.shape) != expected:
        raise KernelInputError(f"{name}_scale must be {list(expected)}; got {list(scale.shape)}")
    if quant.kind == "mxfp4" and scale.dtype != torch.uint8:
        raise KernelInputError(f"{name}_scale holds E8M0 exponents as uint8; got {scale.dtype}")
    if quant.zero_point and (zero is None or tuple(zero.shape) != expected or zero.dtype != torch.uint8):
        got = "none" if zero is None else f"{zero.dtype} {list(zero.shape)}"
        raise KernelInputError(f"{name}_zero_point must be uint8 {list(expected)}; got {got}")
    for t in (w, scale, zero):
        if t is not None and not t.is_contiguous():
            raise KernelInputError(f"{name} and its scales must be contiguous")
    return group


def _check_bias(name: str, bias: Optional[torch.Tensor], experts: int, rows: int) -> None:
    if bias is not None and (tuple(bias.shape) != (experts, rows) or not bias.is_contiguous()):
        raise KernelInputError(f"{name} must be a contiguous [{experts}, {rows}]; got {list(bias.shape)}")


def default_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """16 rows while experts see few tokens each (decode), 64 once they see many."""
    return 16 if num_tokens * top_k <= 4 * num_experts else 64


def fused_wq_experts(
    hidden: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    quant: WeightQuant,
    w1_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w1_zero_point: Optional[torch.Tensor] = None,
    w2_zero_point: Optional[torch.Tensor] = None,
    w1_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    activation: str = "silu",
    swiglu_limit: Optional[float] = None,
    interleaved: bool = False,
    block_m: Optional[int] = None,
) -> torch.Tensor:
    """``sum_j g[t,j] * (W2[e] act(W1[e] x[t] + b1[e]) + b2[e])`` -> [M, K] in ``hidden``'s dtype.

    ``w1`` [E, 2N, K/p] and ``w2`` [E, K, N/p] hold codes (p = 2 for 4-bit), rows of
    w1 stacked gate-then-up, or interleaved (gate 2n, up 2n+1) with ``interleaved``.
    """
    require_device(hidden, w1, w2, topk_ids)
    if hidden.dim() != 2 or hidden.dtype not in COMPUTE_DTYPES or not hidden.is_contiguous():
        raise KernelInputError(f"hidden must be a contiguous bfloat16/float16 [M, K]; got {hidden.dtype} {list(hidden.shape)}")
    if activation not in ACTIVATIONS:
        raise KernelInputError(f"activation {activation!r} is not one of {list(ACTIVATIONS)}")
    num_tokens, k = hidden.shape
    experts, two_n = w1.shape[0], w1.shape[1]
    n = two_n // 2
    g1 = _check_weight("w1", w1, w1_scale, w1_zero_point, quant, experts, 2 * n, k)
    g2 = _check_weight("w2", w2, w2_scale, w2_zero_point, quant, experts, k, n)
    _check_bias("w1_bias", w1_bias, experts, 2 * n)
    _check_bias("w2_bias", w2_bias, experts, k)
    if (w1_bias is None) != (w2_bias is None):
        raise KernelInputError("give both biases (w1_bias and w2_bias) or neither")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise KernelInputError(f"topk_ids and topk_weights must both be [M={num_tokens}, top_k]; got "
                               f"{list(topk_ids.shape)} and {list(topk_weights.shape)}")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.empty_like(hidden)
    if num_pairs == 0:
        return out
    block_m = block_m or default_block_m(num_tokens, top_k, experts)
    aligned = _align(topk_ids, experts, block_m)
    kern = _kernels()
    kind, zero = KINDS[quant.kind], (8 if quant.kind == "int4" else 128)
    has_zp, has_bias = quant.zero_point, w1_bias is not None
    dummy = w1_scale  # stands in for absent zero points / biases (never read: the constexpr flags are off)

    intermediate = torch.empty((num_pairs, n), dtype=hidden.dtype, device=hidden.device)
    z1 = w1_zero_point if has_zp else dummy
    b1 = w1_bias if has_bias else dummy
    grid1 = (aligned.num_row_blocks * -(-n // BLOCK_N),)
    kern.wq_w1_kernel[grid1](
        hidden, w1, w1_scale, z1, b1, intermediate,
        aligned.sorted_ids, aligned.block_expert, aligned.num_padded,
        n, k, num_pairs, top_k, g1, float(swiglu_limit or 0.0),
        hidden.stride(0), w1.stride(0), w1.stride(1), w1_scale.stride(0), w1_scale.stride(1),
        z1.stride(0), z1.stride(1), b1.stride(0), intermediate.stride(0),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, KIND=kind, HAS_ZP=has_zp, ZERO=zero, HAS_BIAS=has_bias,
        ACT=ACTIVATIONS[activation], HAS_LIMIT=swiglu_limit is not None, INTERLEAVED=interleaved,
        num_warps=4, num_stages=2,
    )

    per_pair = torch.zeros((num_pairs, k), dtype=hidden.dtype, device=hidden.device)
    z2 = w2_zero_point if has_zp else dummy
    b2 = w2_bias if has_bias else dummy
    grid2 = (aligned.num_row_blocks * -(-k // BLOCK_N),)
    kern.wq_w2_kernel[grid2](
        intermediate, w2, w2_scale, z2, b2, topk_weights.contiguous().reshape(-1), per_pair,
        aligned.sorted_ids, aligned.block_expert, aligned.num_padded,
        n, k, num_pairs, g2,
        intermediate.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        z2.stride(0), z2.stride(1), b2.stride(0), per_pair.stride(0),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, KIND=kind, HAS_ZP=has_zp, ZERO=zero, HAS_BIAS=has_bias,
        num_warps=4, num_stages=2,
    )
    torch.sum(per_pair.view(num_tokens, top_k, k), dim=1, out=out)
    return out
