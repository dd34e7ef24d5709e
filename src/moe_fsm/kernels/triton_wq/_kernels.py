"""Triton kernels of the weight-quantized fused MoE (imported only where Triton is).

Two grouped GEMMs over the expert-sorted (token, slot) pairs of the alignment step:

* ``wq_w1_kernel``: ``act(x @ W1[e]^T + b1[e])`` for one [BLOCK_M, BLOCK_N] tile of
  the intermediate. The gate and up rows of the tile's columns are dequantized
  and multiplied in the same K loop (two accumulators), so the gated activation
  (SwiGLU-OAI with its clamp included) runs in the epilogue and only N columns
  are written. Gate/up rows are read stacked ([gate; up], moe-fsm's layout) or
  interleaved (gate 2n, up 2n+1, gpt-oss checkpoints) from the same kernel.
* ``wq_w2_kernel``: ``(h @ W2[e]^T + b2[e]) * router_weight`` per pair.

Weights stay quantized in memory and are dequantized tile by tile inside the K
loop, right before the tensor-core dot (16-bit operands, fp32 accumulation):

* MXFP4: e2m1 nibbles (two per byte, even element low) times ``2 ** (s - 127)``,
  one E8M0 exponent per 32 elements;
* INT4 / INT8: ``(code - zero) * scale`` with one scale per ``group`` elements,
  ``zero`` the checkpoint's zero point or the symmetric bias (8 / 128).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Globals a @triton.jit function reads must be constexpr.
KIND_MXFP4, KIND_INT4, KIND_INT8 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
ACT_SILU, ACT_GELU, ACT_SWIGLUOAI = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
SWIGLUOAI_ALPHA = tl.constexpr(1.702)


@triton.jit
def _dequant_tile(
    w_ptr, s_ptr, z_ptr, expert, rows, offs_k, mask,
    stride_we, stride_wr, stride_se, stride_sr, stride_ze, stride_zr, group,
    KIND: tl.constexpr, HAS_ZP: tl.constexpr, ZERO: tl.constexpr,
):
    """Weight tile [BLOCK_K, BLOCK_N] (K along rows) of expert ``expert``'s ``rows``, in fp32."""
    k_col = offs_k[:, None]
    if KIND == KIND_INT8:
        codes = tl.load(w_ptr + expert * stride_we + rows[None, :] * stride_wr + k_col, mask=mask, other=0).to(tl.int32)
    else:
        byte = tl.load(w_ptr + expert * stride_we + rows[None, :] * stride_wr + k_col // 2, mask=mask, other=0).to(tl.int32)
        codes = (byte >> ((k_col % 2) * 4)) & 0xF
    scale = tl.load(s_ptr + expert * stride_se + rows[None, :] * stride_sr + k_col // group, mask=mask, other=0)
    if KIND == KIND_MXFP4:
        magnitude_code = codes & 7
        exponent = magnitude_code >> 1
        half = (magnitude_code & 1).to(tl.float32) * 0.5
        magnitude = tl.where(exponent == 0, half, (1.0 + half) * tl.exp2((exponent - 1).to(tl.float32)))
        value = tl.where((codes & 8) != 0, -magnitude, magnitude)
        return value * tl.exp2(scale.to(tl.float32) - 127.0)
    if HAS_ZP:
        zero = tl.load(z_ptr + expert * stride_ze + rows[None, :] * stride_zr + k_col // group, mask=mask, other=0).to(tl.float32)
    else:
        zero = ZERO
    return (codes.to(tl.float32) - zero) * scale.to(tl.float32)


@triton.jit(do_not_specialize=["N", "K", "num_pairs"])
def wq_w1_kernel(
    a_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    N, K, num_pairs, top_k, group, limit,
    stride_am, stride_we, stride_wr, stride_se, stride_sr, stride_ze, stride_zr, stride_be, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    KIND: tl.constexpr, HAS_ZP: tl.constexpr, ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pair < num_pairs
    token = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if INTERLEAVED:
        gate_rows = 2 * offs_n
        up_rows = gate_rows + 1
    else:
        gate_rows = offs_n
        up_rows = offs_n + N
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = ki * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + token[:, None] * stride_am + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_gate = _dequant_tile(w_ptr, s_ptr, z_ptr, expert, gate_rows, offs_k, w_mask, stride_we, stride_wr,
                               stride_se, stride_sr, stride_ze, stride_zr, group, KIND, HAS_ZP, ZERO)
        w_up = _dequant_tile(w_ptr, s_ptr, z_ptr, expert, up_rows, offs_k, w_mask, stride_we, stride_wr,
                             stride_se, stride_sr, stride_ze, stride_zr, group, KIND, HAS_ZP, ZERO)
        acc_gate = tl.dot(a, w_gate.to(a.dtype), acc_gate)
        acc_up = tl.dot(a, w_up.to(a.dtype), acc_up)
    if HAS_BIAS:
        acc_gate += tl.load(b_ptr + expert * stride_be + gate_rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_ptr + expert * stride_be + up_rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_LIMIT:
        acc_gate = tl.minimum(acc_gate, limit)
        acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
    if ACT == ACT_SWIGLUOAI:
        h = (acc_up + 1.0) * (acc_gate * tl.sigmoid(SWIGLUOAI_ALPHA * acc_gate))
    elif ACT == ACT_GELU:
        h = 0.5 * acc_gate * (1.0 + tl.erf(acc_gate * 0.7071067811865476)) * acc_up
    else:
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out_rows = pair.to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * stride_om + offs_n[None, :], h.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["N", "K", "num_pairs"])
def wq_w2_kernel(
    a_ptr, w_ptr, s_ptr, z_ptr, b_ptr, topk_weights_ptr, out_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    N, K, num_pairs, group,
    stride_am, stride_we, stride_wr, stride_se, stride_sr, stride_ze, stride_zr, stride_be, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    KIND: tl.constexpr, HAS_ZP: tl.constexpr, ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """out[pair, :K] = (h[pair] @ W2[e]^T + b2[e]) * topk_weight[pair]; the GEMM's reduction runs over N."""
    pid = tl.program_id(0)
    num_k_out = tl.cdiv(K, BLOCK_N)
    pid_m = pid // num_k_out
    pid_n = pid % num_k_out
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pair < num_pairs
    rows_in = pair.to(tl.int64)
    offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = offs_out < K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ni in range(0, tl.cdiv(N, BLOCK_K)):
        offs_red = ni * BLOCK_K + tl.arange(0, BLOCK_K)
        red_ok = offs_red < N
        a = tl.load(a_ptr + rows_in[:, None] * stride_am + offs_red[None, :], mask=row_ok[:, None] & red_ok[None, :], other=0.0)
        w = _dequant_tile(w_ptr, s_ptr, z_ptr, expert, offs_out, offs_red, red_ok[:, None] & out_ok[None, :], stride_we,
                          stride_wr, stride_se, stride_sr, stride_ze, stride_zr, group, KIND, HAS_ZP, ZERO)
        acc = tl.dot(a, w.to(a.dtype), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + offs_out, mask=out_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(topk_weights_ptr + rows_in, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(out_ptr + rows_in[:, None] * stride_om + offs_out[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & out_ok[None, :])
