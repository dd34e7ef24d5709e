"""MXFP4's one-multiply fast dequantization (``MX_WINDOW``), checked on the CPU.

``_mx_nibbles_window_bf16`` (``kernels/triton_wq/_kernels.py``) is inline PTX, which neither the CPU nor Triton's
interpreter runs; ``tests/gpu/test_triton_wq.py`` compares the layer's output with the plain path's on a GPU. Here
the shipped instruction string itself is replayed, instruction by instruction (each bf16 multiply rounded to the
nearest bf16 of the exact product, subnormals kept, as ``mul.bf16x2`` does), for every byte pair and every E8M0
exponent: inside the window the result must be the e2m1 values times 2^(e - 127) times 2^-16 exactly, and the
window must be no wider than that holds. The build-time decision (``mx_scales_in_window``, the experts' cache)
needs torch only.
"""

from __future__ import annotations

import re

import pytest
import torch

from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.kernels.triton_wq.fused import MX_WINDOW_HIGH, MX_WINDOW_LOW, mx_scales_in_window
from moe_fsm.modular.interfaces import ExpertScales

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)
MASK32 = 0xFFFFFFFF


def _bf16_lanes(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two bf16 lanes of 32-bit words (int64 tensors), as float64."""
    def lane(bits):
        return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16).to(torch.float64)
    return lane(word & 0xFFFF), lane((word >> 16) & 0xFFFF)


def _bf16_word(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """float64 lanes (each exactly a bf16 or rounded to one, ties to even) -> 32-bit words."""
    def bits(v):
        return v.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    return bits(low) | (bits(high) << 16)


def _prmt(a: torch.Tensor, b: torch.Tensor, selector: int) -> torch.Tensor:
    """``prmt.b32`` in its default mode: byte i of the result is byte (selector nibble i & 7) of {b, a}, or that
    byte's sign replicated when the nibble's bit 3 is set."""
    source = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = torch.zeros_like(a)
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = source[nibble & 7]
        if nibble & 8:
            byte = torch.where(byte >= 0x80, 0xFF, 0)
        out |= byte << (8 * i)
    return out


def _replay(ptx: str, operands: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run the inline-PTX body ``ptx`` on int64 tensors holding 32-bit values (``$n`` operands and scratch)."""
    regs = dict(operands)

    def value(token: str) -> torch.Tensor | int:
        return int(token, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", token) else regs[token]

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        v = [value(s) for s in src]
        if op == "cvt.u32.u16":
            r = v[0] & 0xFFFF
        elif op == "prmt.b32":
            r = _prmt(v[0], torch.as_tensor(v[1]).expand_as(v[0]) if isinstance(v[1], int) else v[1], v[2])
        elif op == "shl.b32":
            r = (v[0] << v[1]) & MASK32
        elif op == "shr.b32":
            r = v[0] >> v[1]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "mov.b32":
            r = torch.as_tensor(v[0]).expand_as(next(iter(operands.values())))
        elif op == "mul.bf16x2":
            (a0, a1), (b0, b1) = _bf16_lanes(v[0]), _bf16_lanes(v[1])
            r = _bf16_word(a0 * b0, a1 * b1)  # the exact product (<= 16 significant bits) rounded once
        else:
            raise AssertionError(f"the replay does not know {op!r}")
        regs[dst] = r
    return regs


def _window_multiplier(e: torch.Tensor, shift: int) -> torch.Tensor:
    """``_e8m0_bf16_window``: bf16 with exponent field min(e + 127 - 1 - shift, 254), as float64."""
    field = torch.clamp(e + 127 - 1 - shift, max=254)
    return (field << 7).to(torch.int16).view(torch.bfloat16).to(torch.float64)


def _decoded(e: torch.Tensor):
    """Every byte pair (bytes b and 255 - b) decoded with exponents e (both lanes): (low, high, expected low, expected
    high) as float64, expected = e2m1 value x 2^(e - 127) x 2^-shift."""
    kernels = pytest.importorskip("moe_fsm.kernels.triton_wq._kernels")  # the PTX strings are built where Triton is
    shift = int(kernels.MX_WINDOW_SHIFT.value)
    byte = torch.arange(256, dtype=torch.int64)
    b = byte[:, None].expand(256, e.numel())
    e2 = e[None, :].expand(256, e.numel())
    pair = b | ((255 - b) << 8)
    mult = _bf16_word(_window_multiplier(e2, shift), _window_multiplier(e2, shift))
    regs = _replay(kernels.MX_NIBBLES_WINDOW_PTX.value, {"$2": pair, "$3": mult, "$4": mult})
    scale = torch.pow(2.0, (e2 - 127 - shift).to(torch.float64))
    lo0, lo1 = _bf16_lanes(regs["$0"])
    hi0, hi1 = _bf16_lanes(regs["$1"])
    want = [E2M1[b & 15] * scale, E2M1[(255 - b) & 15] * scale, E2M1[b >> 4] * scale, E2M1[(255 - b) >> 4] * scale]
    return [lo0, lo1, hi0, hi1], want


def test_window_decode_is_exact_for_every_byte_and_every_exponent_in_the_window():
    e = torch.arange(MX_WINDOW_LOW, MX_WINDOW_HIGH + 1, dtype=torch.int64)
    got, want = _decoded(e)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
        assert torch.equal(torch.signbit(g), torch.signbit(w))  # -0 stays -0, as the two-multiply path gives it


def test_the_window_is_where_the_one_multiply_holds():
    """Just above the window the multiplier leaves bf16's range; far below it the smallest weights turn subnormal
    and lose bits (exact down to 18; 40 is kept so that the fp32 products stay normal too)."""
    got, want = _decoded(torch.tensor([MX_WINDOW_HIGH + 1], dtype=torch.int64))
    assert not all(torch.equal(g, w) for g, w in zip(got, want))
    got, want = _decoded(torch.tensor([18, 30], dtype=torch.int64))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    got, want = _decoded(torch.tensor([10], dtype=torch.int64))
    assert not all(torch.equal(g, w) for g, w in zip(got, want))


def test_scales_in_window_is_decided_on_every_tensor():
    inside = torch.full((2, 4, 3), 127, dtype=torch.uint8)
    assert mx_scales_in_window(inside, inside)
    for bad in (MX_WINDOW_LOW - 1, MX_WINDOW_HIGH + 1, 255):
        other = inside.clone()
        other[1, 2, 0] = bad
        assert not mx_scales_in_window(inside, other)
    edges = inside.clone()
    edges[0, 0, 0], edges[0, 0, 1] = MX_WINDOW_LOW, MX_WINDOW_HIGH
    assert mx_scales_in_window(edges, inside)


def test_mxfp4_experts_decide_the_window_once_per_scale_tensor(monkeypatch):
    from moe_fsm.experts import triton_wq_experts
    from moe_fsm.experts.triton_wq_experts import TritonMxfp4Experts, TritonWna16Experts

    calls = []
    real = triton_wq_experts.mx_scales_in_window
    monkeypatch.setattr(triton_wq_experts, "mx_scales_in_window", lambda *s: calls.append(1) or real(*s))
    layer = MoELayer(quant=QuantScheme.mxfp4(), dtype="bfloat16", bias=True, activation="swigluoai",
                     swiglu_limit=7.0, num_experts=2, top_k=1, hidden_size=64, intermediate_size=64)
    experts = TritonMxfp4Experts(layer)
    s1 = torch.full((2, 128, 2), 120, dtype=torch.uint8)
    s2 = torch.full((2, 64, 2), 130, dtype=torch.uint8)
    scales = ExpertScales(w1_scale=s1, w2_scale=s2)
    assert experts.mx_scale_window(scales) and experts.mx_scale_window(scales)
    assert len(calls) == 1
    s2[0, 0, 0] = 200  # an in-place change is a new version of the tensor: decided again, and out of the window
    assert not experts.mx_scale_window(scales)
    assert len(calls) == 2
    int4 = MoELayer(quant=QuantScheme.int_wna16(4, 32), dtype="bfloat16", num_experts=2, top_k=1, hidden_size=64,
                    intermediate_size=64)
    assert not TritonWna16Experts(int4).mx_scale_window(scales)
