"""Prefill of the weight-quantized MoE on the bf16 Hopper kernels: dequantize, then the Hopper-grade GEMMs.

At hundreds of tokens and more the layer is compute-bound, and the swap-AB kernel of ``_kernels.py``
dequantizes every weight tile again for each row block of pairs (eight times an expert at 8192 tokens on
gpt-oss-20b) in pointer-load tiles without the copy engine. This path instead writes the weights of the
experts the batch hits into a 16-bit scratch with one memory-bound pass (``wq_dequant_kernel``, one w1 then
one w2: the scratch holds one of them at a time) and runs both GEMMs on moe-fsm's bf16 Hopper kernels
(``kernels.triton_moe.hopper``: TMA, wgmma, persistent), the tile the bf16 experts take on this shape
(their tuned table, else the TMA prefill tile). It pays where the GEMMs' time is large against writing
and reading the 16-bit weights once, i.e. at many rows per expert (``docs/perf/weight_quantized.md``).

What the bf16 kernels do not fuse is folded around them, with the numerics of the swap-AB kernel:

* w1's bias: the input gets more columns (two ones, then zeros up to a multiple of 64: ``bias_columns``) and
  each w1 row the bias, split into a 16-bit head and tail, in the same columns (``BIAS_COLUMNS``), so it is
  added in the fp32 accumulator before the activation;
* NVFP4's per-expert global scale: w1's as the kernels' per-tensor weight scale on the accumulators
  (``W_SCALE`` 1), w2's by the epilogue pass below; e2m1 times its e4m3 block scale is exact in bf16;
* INT scales and zero points: ``(code - zero) * scale`` in fp32, rounded once to bf16 (the swap-AB
  kernel's rounding where a K tile spans several groups);
* w2's bias, router weight and the top-k sum: ``wq_splitk_sum_kernel`` over the unweighted per-pair
  outputs (one slice), as after a split-K w2;
* activation order: the scratch holds the columns in their original order (stored column j is written to
  column ``perm[e, j]``), so the input is read as it is;
* interleaved gate/up rows: de-interleaved into the stacked order the bf16 kernels read.

The scratch comes from the caching allocator each call (the same block comes back at the next call of the
same size): max(E x 2N x K, E x K x N) 16-bit values, 1.0 GB on gpt-oss-20b and 4.3 GB on gpt-oss-120b.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_fsm.kernels.triton_moe._runtime import device_name
from moe_fsm.kernels.triton_moe.align import align_tokens
from moe_fsm.kernels.triton_moe.config import MoEConfig, get_config, tma_prefill_config
from moe_fsm.kernels.triton_moe.hopper import hopper_w1, hopper_w2, tma_kernels_available

# Rows of the dequantized scratch and of the input keep a whole number of 64 columns (128 bytes) with a bias folded
# in: K = 2888 (K + 8) ran gpt-oss-20b's TMA GEMMs 3.3x slower than the bf16 experts' K = 2880 (H200)
BIAS_ALIGN = 64
DEQUANT_TILE = (16, 128, 4)  # rows, stored bytes and warps of a wq_dequant_kernel program


def bias_columns(k: int) -> int:
    """Columns added to K to carry w1's bias (head and tail, then zeros): to the next multiple of 64, at least 2."""
    return -(-(k + 2) // BIAS_ALIGN) * BIAS_ALIGN - k


def scratch_bytes(num_experts: int, n: int, k: int, bias: bool, element_size: int = 2) -> int:
    """The 16-bit weight scratch of one call (w1's, bias columns included, or w2's, whichever is larger)."""
    k_in = k + (bias_columns(k) if bias else 0)
    return num_experts * max(2 * n * k_in, k * n) * element_size


def usable(hidden: torch.Tensor, n: int, k: int) -> bool:
    """Whether this call can take the path: a Hopper-or-later GPU with Triton's tensor descriptors, and K, N
    whose 16-bit rows are 16-byte aligned (the copy engine's rule, as ``hopper.hopper_usable`` checks it)."""
    return (hidden.device.type == "cuda" and tma_kernels_available(hidden.device.index or 0)
            and k % 8 == 0 and n % 8 == 0)


def bf16_config(hidden: torch.Tensor, num_experts: int, n: int, k: int, top_k: int) -> MoEConfig:
    """The tile moe-fsm's 16-bit experts take on this shape, where it is a Hopper one; else the TMA prefill tile."""
    dtype = str(hidden.dtype).removeprefix("torch.")
    config = get_config(device_name(hidden.device), num_experts, n, k, top_k, hidden.shape[0], dtype, None)
    if not config.hopper or config.gluon:
        config = tma_prefill_config(64, flatten=n <= 1536)
    return config


def _hit_experts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 [E + 1]: 1 where some pair names the expert (ids outside [0, E), other ranks' slots, land in E)."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    hit = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_ids.device)
    return hit.index_fill_(0, ids, 1)


def _dequantize(kern, w, scale, zero, perm, bias, hit, out, *, rows: int, cols: int, group: int, kind: int,
                zero_code: int, split: bool, deinterleave: bool, tile: Optional[tuple[int, int, int]] = None
                ) -> torch.Tensor:
    """``out`` [E, rows, cols (+ ``bias_columns(cols)`` with a bias)] = the dequantized weight of the hit experts;
    ``tile`` (rows, bytes, warps; default ``DEQUANT_TILE``) is the benchmark's to vary."""
    experts, _, row_bytes = w.shape
    block_r, block_b, warps = tile or DEQUANT_TILE
    scale = scale.view(torch.uint8) if scale.dtype == torch.float8_e4m3fn else scale
    dummy = scale
    z = zero if zero is not None else dummy
    p = perm if perm is not None else dummy
    b = bias if bias is not None else dummy
    grid = (-(-row_bytes // block_b), -(-rows // block_r), experts)
    kern.wq_dequant_kernel[grid](
        w, scale, z, p, b, hit, out, rows, cols, row_bytes, out.shape[-1] - cols, w.stride(0), w.stride(1),
        scale.stride(0), scale.stride(1), z.stride(0), z.stride(1) if z.dim() > 1 else 0, p.stride(0), b.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_R=block_r, BLOCK_B=block_b, GROUP=group, KIND=kind, HAS_ZP=zero is not None, ZERO=zero_code,
        SPLIT=split, FAST=out.dtype == torch.bfloat16 and kind != 2, HAS_PERM=perm is not None,
        DEINTERLEAVE=deinterleave, BIAS_COLUMNS=bias is not None, num_warps=warps,
    )
    return out


def prefill_experts(
    kern, hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, out: torch.Tensor, *, n: int, groups: tuple[int, int], kind: int, zero_code: int,
    scales: tuple[torch.Tensor, torch.Tensor], zero_points: tuple[Optional[torch.Tensor], Optional[torch.Tensor]],
    perms: tuple[Optional[torch.Tensor], Optional[torch.Tensor]],
    global_scales: tuple[Optional[torch.Tensor], Optional[torch.Tensor]],
    biases: tuple[Optional[torch.Tensor], Optional[torch.Tensor]], activation: str, swiglu_limit: Optional[float],
    interleaved: bool, split: bool,
) -> torch.Tensor:
    """The layer through the dequantized scratch and the bf16 Hopper GEMMs (arguments checked by the caller)."""
    num_tokens, k = hidden.shape
    experts, top_k = w1.shape[0], topk_ids.shape[1]
    config = bf16_config(hidden, experts, n, k, top_k)
    routing = align_tokens(topk_ids, experts, config.block_m)
    hit = _hit_experts(topk_ids, experts)
    w1_bias, w2_bias = biases
    k_in = k + (bias_columns(k) if w1_bias is not None else 0)
    scratch = torch.empty(scratch_bytes(experts, n, k, w1_bias is not None, 1), dtype=hidden.dtype,
                          device=hidden.device)
    w1_dq = _dequantize(kern, w1, scales[0], zero_points[0], perms[0], w1_bias, hit,
                        scratch[: experts * 2 * n * k_in].view(experts, 2 * n, k_in), rows=2 * n, cols=k,
                        group=groups[0], kind=kind, zero_code=zero_code, split=split, deinterleave=interleaved)
    a = hidden
    if w1_bias is not None:  # ones where the w1 rows hold their bias (head, tail), zeros beside them
        a = torch.nn.functional.pad(hidden, (0, k_in - k))
        a[:, k : k + 2] = 1.0
    w1_scale_info = (0, None, (0, 0, 0))
    if global_scales[0] is not None:
        w1_scale_info = (1, global_scales[0], (1, 0, 0))
    inter, _ = hopper_w1(
        a, None, 0, w1_dq, w1_scale_info, routing, out_mode=0, inter_dtype=hidden.dtype, out_static_scale=None,
        zero_fill=False, activation=activation, swiglu_limit=swiglu_limit, row_weights=None, config=config.w1,
        gather_input=config.gather_input,
    )
    # w1's GEMM has read the scratch (same stream): w2 takes its place
    w2_dq = _dequantize(kern, w2, scales[1], zero_points[1], perms[1], None, hit,
                        scratch[: experts * k * n].view(experts, k, n), rows=k, cols=n, group=groups[1], kind=kind,
                        zero_code=zero_code, split=split, deinterleave=False)
    per_pair = torch.empty(routing.num_pairs, k, dtype=hidden.dtype, device=hidden.device)
    hopper_w2(inter, None, 0, w2_dq, (0, None, (0, 0, 0)), routing, per_pair, 0, row_weights=None,
              config=config.w2)
    block = min(1024, max(16, 1 << (k - 1).bit_length()))
    dummy = topk_weights
    kern.wq_splitk_sum_kernel[(num_tokens, -(-k // block))](
        per_pair, topk_ids.contiguous().reshape(-1), topk_weights.contiguous().reshape(-1),
        global_scales[1] if global_scales[1] is not None else dummy, w2_bias if w2_bias is not None else dummy, out,
        k, experts, 1, 0, w2_bias.stride(0) if w2_bias is not None else 0, out.stride(0),
        TOP_K=top_k, BLOCK=block, KIND=kind, HAS_BIAS=w2_bias is not None, num_warps=4,
    )
    return out
