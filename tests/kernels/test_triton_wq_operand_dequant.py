"""The operand-layout MXFP4 dequantization of the weight-quantized kernel (``WqConfig.operand_dequant``) on the CPU.

The kernel path (``_kernels._mx_operand_tile``) builds a K tile's 64 columns from the 32 bytes of one SPLIT chunk:
column j reads byte j % 32 shifted right by ``fused._nibble_shifts``'s entry j, and one inline-PTX asm
(``MX_LOW_NIBBLE_PTX``) decodes the low nibble of each byte to its e2m1 value in bf16. Neither the CPU nor Triton's
interpreter runs inline PTX, so here the asm string itself is executed by a small interpreter of the instructions it
uses, for every pair of bytes and both shifts, against the e2m1 table; the shift table against ``relayout_nibbles``'
layout; and the config's checks. ``tests/gpu/test_triton_wq.py::test_many_pair_tiles_match_reference`` runs the
path on a GPU against float64.
"""

from __future__ import annotations

import re

import pytest
import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.kernels.triton_wq.fused import WqConfig, _nibble_shifts, relayout_nibbles

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e2m1(code: torch.Tensor) -> torch.Tensor:
    magnitude = torch.tensor(E2M1, dtype=torch.float64)[code & 7]
    return torch.where((code & 8) != 0, -magnitude, magnitude)


def _bf16_mul_lanes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mul.bf16x2``: each 16-bit lane's product rounded to the nearest bf16 (ties to even)."""
    out = torch.zeros_like(a)
    for shift in (0, 16):
        x = ((a >> shift) & 0xFFFF).to(torch.int16).view(torch.bfloat16).to(torch.float32)
        y = ((b >> shift) & 0xFFFF).to(torch.int16).view(torch.bfloat16).to(torch.float32)
        bits = (x * y).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
        out |= bits << shift
    return out


def _run_ptx(ptx: str, operands: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Execute the inline-PTX body on int64 tensors of 32-bit values (``$n`` operands in ``operands``); only the
    instructions the MXFP4 decode uses are known, anything else fails the test."""
    regs = dict(operands)

    def value(token: str) -> torch.Tensor | int:
        token = token.strip()
        return int(token, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", token) else regs[token]

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, _, args = line.partition(" ")
        dst, *src = [a.strip() for a in args.split(",")]
        v = [value(s) for s in src]
        if op == "mov.b32":
            result = torch.as_tensor(v[0], dtype=torch.int64) + torch.zeros_like(next(iter(operands.values())))
        elif op == "cvt.u32.u16":
            result = v[0] & 0xFFFF
        elif op == "prmt.b32":
            assert v[1] == 0, "the decode permutes with a zero second operand"
            result = torch.zeros_like(v[0])
            for i in range(4):
                sel = (v[2] >> (4 * i)) & 0xF
                assert sel & 8 == 0, "no sign-replicating selectors"
                byte = (v[0] >> (8 * sel)) & 0xFF if sel < 4 else torch.zeros_like(v[0])
                result |= byte << (8 * i)
        elif op == "shl.b32":
            result = (v[0] << v[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            result = v[0] >> v[1]
        elif op == "and.b32":
            result = v[0] & v[1]
        elif op == "or.b32":
            result = v[0] | v[1]
        elif op == "mul.bf16x2":
            result = _bf16_mul_lanes(v[0], torch.as_tensor(v[1]) + torch.zeros_like(v[0]))
        else:
            raise AssertionError(f"unknown PTX instruction {op!r}")
        regs[dst] = result
    return regs


@pytest.mark.parametrize("shift", [0, 4])
def test_low_nibble_asm_decodes_every_byte_pair(shift):
    """Every pair of bytes, shifted as the kernel shifts them (low nibbles: 0, high: 4), decodes to the e2m1 values
    of the nibbles it selects, exactly, the other nibble's bits ignored."""
    kernels = pytest.importorskip("moe_fsm.kernels.triton_wq._kernels")
    pairs = torch.arange(1 << 16, dtype=torch.int64)
    b0, b1 = pairs & 0xFF, pairs >> 8
    shifted = (b0 >> shift) | ((b1 >> shift) << 8)  # the u8 ``b >> shift`` of both bytes, packed as the asm takes them
    regs = _run_ptx(kernels.MX_LOW_NIBBLE_PTX.value, {"$1": shifted})
    out = regs["$0"]
    lanes = [((out >> s) & 0xFFFF).to(torch.int16).view(torch.bfloat16).to(torch.float64) for s in (0, 16)]
    assert torch.equal(lanes[0], _e2m1((b0 >> shift) & 15))
    assert torch.equal(lanes[1], _e2m1((b1 >> shift) & 15))


def test_nibble_shift_table_reads_the_split_layout():
    """Column j of a SPLIT chunk is the nibble ``byte[j % 32] >> shift[j]`` selects: the table the kernel loads
    matches ``relayout_nibbles``' layout (low nibble column j, high nibble column j + 32)."""
    gen = torch.Generator().manual_seed(45)
    codes = torch.randint(0, 16, (3, 5, 128), generator=gen, dtype=torch.uint8)  # two chunks a row
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # checkpoint order: column 2j low, 2j + 1 high
    split = relayout_nibbles(packed)
    shifts = _nibble_shifts(torch.device("cpu"))
    cols = torch.arange(64)
    for chunk in range(2):
        got = (split[..., chunk * 32 + cols % 32] >> shifts[cols]) & 15
        assert torch.equal(got, codes[..., chunk * 64 + cols])


def test_operand_dequant_config_checks_and_table_form():
    """block_k 64 for both GEMMs, else one clear error; the flags stay out of a table until set and read back."""
    with pytest.raises(KernelInputError, match="operand_dequant takes block_k 64"):
        WqConfig(128, 128, 128, 8, 3, operand_dequant=True).check()
    with pytest.raises(KernelInputError, match="operand_dequant takes block_k 64"):
        WqConfig(128, 128, 64, 8, 3, w2_block_k=128, operand_dequant=True).check()
    WqConfig(128, 128, 64, 8, 3, chain_acc=True, operand_dequant=True).check()
    plain = WqConfig(128, 128, 64, 8, 3)
    assert "chain_acc" not in plain.to_json() and "operand_dequant" not in plain.to_json()
    tile = WqConfig(128, 128, 64, 8, 3, group_m=8, chain_acc=True, operand_dequant=True)
    assert WqConfig.from_json(tile.to_json()) == tile
