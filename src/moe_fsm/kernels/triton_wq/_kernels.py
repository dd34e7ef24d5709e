"""Triton kernel of the weight-quantized fused MoE (imported only where Triton is).

One grouped GEMM, ``wq_gemm_kernel``, serves both halves of the layer over the
(token, slot) pairs of the alignment step (or one pair per row block at one token):

* w1 (``GATED``): ``act(W1[e] x + b1[e])`` for a tile of the intermediate; the gate
  and up rows of the tile's columns are dequantized and multiplied in the same K loop
  (two accumulators), so the gated activation (SwiGLU-OAI with its clamp included)
  runs in the epilogue and only N columns are written. Gate/up rows are read stacked
  ([gate; up], moe-fsm's layout) or interleaved (gate 2n, up 2n+1, gpt-oss).
* w2: ``(W2[e] h + b2[e]) * router_weight`` per pair.

Swap-AB: the weights are the MMA's M side (``BLOCK_N`` weight rows) and the tokens
its N side (``BLOCK_M`` pairs), so a decode batch of a few tokens still fills the
tensor-core tile with weight rows; the dequantized tile goes straight from registers
into the dot as its A operand.

Weights stay quantized in memory and are dequantized in registers inside the K loop:

* 4-bit codes are packed two per byte. With ``SPLIT`` (the layout ``relayout_nibbles``
  makes once at build time) each 64-column chunk's byte j holds column j in its low
  nibble and column j + 32 in its high one, so the low nibbles of a tile are one
  contiguous half of every chunk and the high nibbles the other: two dots, no
  interleaving shuffle. A reduction length that is not a multiple of 64 (a
  tensor-parallel shard: N = 1440) is padded with zero bytes to the next one, so
  a row's bytes run past ``KRED / 2``: weight bytes are masked at the row's stored
  length (``stride_wr``, rows being contiguous), the activations at ``KRED`` (zeros
  meet the pad columns), scales and zero points at ``KRED``'s groups. Without it
  (checkpoint order: column 2j low, 2j + 1 high) the nibbles are interleaved back
  with ``tl.interleave``.
* ``FAST`` (bf16 activations, 4-bit weights): the nibbles become bf16 in inline PTX,
  two per 32-bit instruction: MXFP4 e2m1 bits are moved into bf16's sign, exponent
  and mantissa fields and multiplied by 2**126 and by the E8M0 scale (``mul.bf16x2``,
  exact: powers of two; in the SPLIT layout the scale made bf16 once per group,
  ``_e8m0_bf16``); INT4 codes are or-ed into the bf16 magic number 128 and 128 + the
  zero (136 symmetric; with zero points, AWQ or compressed-tensors asymmetric, 128 + the
  zero point made bf16 once per group) subtracted (``sub.bf16x2``, exact), and where
  scales come per run of columns (SPLIT, group 32 / 64 or a tile wider than the group)
  multiplied by their fp16 scale split into two bf16 parts, rounded once as the fp32
  product is (``_int4_nibbles_scaled_bf16``). The SPLIT layout's decode PTX takes two
  bytes a call (a thread's pair in the dot's register layout). Otherwise (fp16
  activations, INT8, zero points scaled per weight outside the SPLIT runs) plain Triton
  arithmetic in fp32.
* Activation order (``HAS_PERM``, GPTQ ``desc_act``): the build sorted each expert's columns
  by their group (``sort_act_order``), so groups are contiguous as above, and stored column
  j multiplies activation column ``perm[e, j]``: the activation tile is gathered through
  the expert's permutation.
* NVFP4 weight-only (``KIND_NVFP4``, as Marlin runs it on Hopper): e2m1 nibbles like MXFP4's,
  an e4m3 scale per 16 columns (read as bytes and decoded in registers) and a global scale per
  expert, applied once to the fp32 accumulators. With ``FAST`` in the SPLIT layout each e4m3
  scale becomes bf16 s x 2^118 once per group (``_e4m3_bf16_scaled``) and one ``mul.bf16x2``
  per two weights gives value x s x 2^-8, exact (2 + 4 significant bits, a normal bf16), the
  fp32 sums scaled back by 2^8 (``_nv_nibbles_bf16``); in checkpoint order through the MXFP4
  PTX at scale 1, times the e4m3 scale in bf16 (exact as well).
* INT group scales: when a K tile lies inside one scale group (``BLOCK_K <= GROUP``)
  the tile's product with the exact integer codes is scaled once per (row, pair) on
  the fp32 partial sum instead of per weight element (fewer operations, and no bf16
  rounding of ``code * scale``); otherwise (and for MXFP4's groups of 32) each weight
  is scaled, the scale tile loaded once per group and broadcast (in the SPLIT layout per run of
  min(GROUP, 32) columns of each half, ``_split_run_groups``: group 32 is one scale per half-chunk).
  Scale and zero-point tiles are loaded one K tile ahead (``_tile_scales``).
* Split-K (``SPLIT_K``, few tokens): one token hits top_k experts, so the row blocks times the weight-row
  tiles can be fewer programs than the SMs need to keep enough loads in flight (gpt-oss-120b at one token:
  4 x 45 per GEMM on 132 SMs). A second grid axis splits the reduction into slices; each program writes
  its raw fp32 partial sums to a workspace and ``wq_splitk_act_kernel`` (w1: global scale, bias, gated
  activation) or ``wq_splitk_sum_kernel`` (w2: global scale, bias, router weight and the top-k sum, which
  replaces ``topk_sum``) adds the slices in order (deterministic) and runs the epilogue.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Globals a @triton.jit function reads must be constexpr.
KIND_MXFP4, KIND_INT4, KIND_INT8, KIND_NVFP4 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
ACT_SILU, ACT_GELU, ACT_SWIGLUOAI = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
SWIGLUOAI_ALPHA = tl.constexpr(1.702)
SPLIT_CHUNK = tl.constexpr(64)  # columns per chunk of the SPLIT nibble layout
HALF_CHUNK = tl.constexpr(32)
# The fast NVFP4 path's bf16 weights are value x scale x 2^-8 (``_nv_nibbles_bf16``); the fp32 sums get the 2^8 back.
NVFP4_FAST_SUM_SCALE = tl.constexpr(256.0)

# The inline-PTX decoders below share their instruction sequences: each asm string is assembled once, at import, from
# these builders and handed to ``tl.inline_asm_elementwise`` as a constexpr global. Registers: ``t0``/``t1`` the
# input bytes spread one per 16-bit half, ``a`` the bf16 pair being built, ``c`` (``p``) scratch.
E2M1_BF16_BIAS = "0x7e807e80"  # bf16 2^126 twice: e2m1 bits moved into bf16's fields are the value times 2^-126
INT4_MAGIC = "0x43004300"  # bf16 128 twice: a 4-bit code or-ed into its mantissa gives 128 + code


def _ptx_block(registers: str, lines: list[str]) -> str:
    """One inline-PTX body: a scope declaring the .b32 scratch ``registers`` around the instruction ``lines``."""
    return "{\n" + "\n".join(f"    {line}" for line in [f".reg .b32 {registers};", *lines]) + "\n}"


def _ptx_byte_pairs(first: str, second: str, src: str) -> list[str]:
    """Bytes 0, 1 of ``src`` into the low bytes of ``first``'s two 16-bit halves, bytes 2, 3 into ``second``'s: one
    value per bf16 lane of a ``.bf16x2`` instruction (four bytes a call)."""
    return [f"prmt.b32 {first}, {src}, 0, 0x5140;", f"prmt.b32 {second}, {src}, 0, 0x7362;"]


def _ptx_two_bytes(src: str) -> list[str]:
    """The two bytes of the 16-bit operand ``src`` into the low bytes of ``t0``'s halves (two bytes a call)."""
    return [f"cvt.u32.u16 t0, {src};", "prmt.b32 t0, t0, 0, 0x5140;"]


def _ptx_e8m0_pairs(first: str, second: str, src: str) -> list[str]:
    """The four E8M0 exponent bytes of ``src`` as bf16 2^(e - 127) pairs in ``first`` (bytes 0, 1) and ``second``
    (bytes 2, 3): each exponent shifted into its lane's bf16 exponent field."""
    return [f"prmt.b32 {first}, {src}, 0, 0x5140;", f"shl.b32 {first}, {first}, 7;",
            f"prmt.b32 {second}, {src}, 0, 0x7362;", f"shl.b32 {second}, {second}, 7;"]


def _ptx_bf16_fields(src: str, magnitude_shift: int, magnitude_mask: str, sign_shift: int) -> list[str]:
    """``a`` = the small float in each 16-bit half of ``src`` with its magnitude bits shifted into bf16's exponent and
    mantissa fields (kept by ``magnitude_mask``) and its sign bit into bf16's: the value times a power of two."""
    return [f"shl.b32 a, {src}, {magnitude_shift};", f"and.b32 a, a, {magnitude_mask};",
            f"shl.b32 c, {src}, {sign_shift};", "and.b32 c, c, 0x80008000;", "or.b32 a, a, c;"]


def _ptx_e2m1_fields(src: str, high: bool) -> list[str]:
    """``a`` = the e2m1 code in the low (or ``high``) nibble of each byte lane of ``src`` as bf16 value x 2^-126."""
    return _ptx_bf16_fields(src, 2 if high else 6, "0x01c001c0", 8 if high else 12)


def _ptx_product(out: str, factors: tuple[str, ...]) -> list[str]:
    """``out`` = ``a`` times each of ``factors`` in turn (``mul.bf16x2``; ``a`` holds the partial products)."""
    return [f"mul.bf16x2 a, a, {f};" for f in factors[:-1]] + [f"mul.bf16x2 {out}, a, {factors[-1]};"]


def _ptx_mx_value(out: str, src: str, high: bool, scale: str) -> list[str]:
    """``out`` = the e2m1 values of one nibble of ``src``'s lanes times the bf16 power-of-two ``scale`` (exact): the
    fields times ``bias`` (the block's register holding ``E2M1_BF16_BIAS``), then times the scale."""
    return _ptx_e2m1_fields(src, high) + _ptx_product(out, ("bias", scale))


def _ptx_int4_minus_zero(out: str, high: bool, zero: str) -> list[str]:
    """``out`` = bf16 code - zero point of the low (or ``high``) nibble of ``t0``'s lanes: the code or-ed into
    ``magic`` (the block's register holding ``INT4_MAGIC``) is 128 + code, minus ``zero`` (bf16 128 + zero point):
    integers of 128-143, so the difference is exact."""
    code = ["shr.b32 a, t0, 4;", "and.b32 a, a, 0x000f000f;"] if high else ["and.b32 a, t0, 0x000f000f;"]
    return code + ["or.b32 a, a, magic;", f"sub.bf16x2 {out}, a, {zero};"]


def _ptx_int4_scaled(out: str, high: bool, zero: str, scale_hi: str, scale_lo: str) -> list[str]:
    """``out`` = (code - zero point) x (``scale_hi`` + ``scale_lo``) rounded once: ``c x lo`` (exact) plus ``c x hi``
    in one fused ``fma.rn.bf16x2``."""
    return _ptx_int4_minus_zero("c", high, zero) + [f"mul.bf16x2 p, c, {scale_lo};",
                                                     f"fma.rn.bf16x2 {out}, c, {scale_hi}, p;"]


MX_NIBBLES_PTX = tl.constexpr(_ptx_block("t0, t1, l0, l1, h0, h1, a, c, bias", [
    f"mov.b32 bias, {E2M1_BF16_BIAS};", *_ptx_byte_pairs("t0", "t1", "$4"),
    *_ptx_e8m0_pairs("l0", "l1", "$5"), *_ptx_e8m0_pairs("h0", "h1", "$6"),
    *_ptx_mx_value("$0", "t0", False, "l0"), *_ptx_mx_value("$1", "t1", False, "l1"),
    *_ptx_mx_value("$2", "t0", True, "h0"), *_ptx_mx_value("$3", "t1", True, "h1")]))
MX_NIBBLES_SCALED_PTX = tl.constexpr(_ptx_block("t0, a, c, bias", [
    f"mov.b32 bias, {E2M1_BF16_BIAS};", *_ptx_two_bytes("$2"),
    *_ptx_mx_value("$0", "t0", False, "$3"), *_ptx_mx_value("$1", "t0", True, "$4")]))
NV_NIBBLES_PTX = tl.constexpr(_ptx_block("t0, a, c", [
    *_ptx_two_bytes("$2"),
    *_ptx_e2m1_fields("t0", False), *_ptx_product("$0", ("$3",)),
    *_ptx_e2m1_fields("t0", True), *_ptx_product("$1", ("$4",))]))
E4M3_BF16_SCALED_PTX = tl.constexpr(_ptx_block("t0, t1, a, c, k1, k2", [
    "mov.b32 k1, 0x7f007f00;", "mov.b32 k2, 0x77007700;", *_ptx_byte_pairs("t0", "t1", "$2"),
    *_ptx_bf16_fields("t0", 4, "0x07f007f0", 8), *_ptx_product("$0", ("k1", "k2")),
    *_ptx_bf16_fields("t1", 4, "0x07f007f0", 8), *_ptx_product("$1", ("k1", "k2"))]))
INT4_NIBBLES_PTX = tl.constexpr(_ptx_block("t0, a, magic", [
    f"mov.b32 magic, {INT4_MAGIC};", *_ptx_two_bytes("$2"),
    *_ptx_int4_minus_zero("$0", False, "$3"), *_ptx_int4_minus_zero("$1", True, "$4")]))
INT4_NIBBLES_SCALED_PTX = tl.constexpr(_ptx_block("t0, a, c, p, magic", [
    f"mov.b32 magic, {INT4_MAGIC};", *_ptx_two_bytes("$2"),
    *_ptx_int4_scaled("$0", False, "$3", "$5", "$6"), *_ptx_int4_scaled("$1", True, "$4", "$7", "$8")]))


@triton.jit
def _mx_nibbles_bf16(b, s_lo, s_hi):
    """(low, high) nibbles of the bytes ``b`` as MXFP4 values times 2**(s - 127) in bf16 (inline PTX, exact):
    the low nibbles scaled by the E8M0 exponents ``s_lo``, the high ones by ``s_hi`` (both shaped like ``b``)."""
    return tl.inline_asm_elementwise(
        MX_NIBBLES_PTX,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[b, s_lo, s_hi],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _int4_nibbles_bf16(b, zero_lo, zero_hi):
    """(low, high) nibbles of the bytes ``b`` as bf16 ``code - zero point`` (exact; inline PTX): the code or-ed into
    bf16 128's mantissa is 128 + code, and ``sub.bf16x2`` takes ``zero_lo`` / ``zero_hi`` (bf16 128 + zero point,
    ``_int4_zero_bf16``; 136 for symmetric weights) from it: integers of 128-143, so the difference is exact. Two
    bytes a call (``pack=2``): in the dot's register layout a thread holds its weight bytes in pairs, one 16-bit
    shared-memory load each, so a pair goes in as loaded (four a call made the compiler join two loads with byte
    permutes). The zero operands shaped like ``b``."""
    return tl.inline_asm_elementwise(
        INT4_NIBBLES_PTX,
        constraints="=r,=r,h,r,r",
        args=[b, zero_lo, zero_hi],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _int4_nibbles_scaled_bf16(b, zero_lo, zero_hi, s_lo_hi, s_lo_lo, s_hi_hi, s_hi_lo):
    """(low, high) nibbles of the bytes ``b`` as bf16 ``(code - zero point) x scale``, rounded once (inline PTX):
    ``c = code - zero point`` as in ``_int4_nibbles_bf16`` (exact, |c| <= 15: 4 significant bits), the fp16 scale
    of each split into bf16 parts (``_fp16_scale_split``: hi + lo, exactly); ``c x lo`` is exact in bf16 (4 x 2
    significant bits) and one fused ``fma.rn.bf16x2`` adds ``c x hi`` to it, so the result is the fp32 product
    rounded to bf16, bit for bit what the plain path computes, in 3 instructions per 2 weights instead of 6
    (unpack to fp32, 2 multiplies, repack). All operands shaped like ``b``; two bytes a call as in
    ``_int4_nibbles_bf16``."""
    return tl.inline_asm_elementwise(
        INT4_NIBBLES_SCALED_PTX,
        constraints="=r,=r,h,r,r,r,r,r,r",
        args=[b, zero_lo, zero_hi, s_lo_hi, s_lo_lo, s_hi_hi, s_hi_lo],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _int4_zero_bf16(z):
    """INT4 zero points (uint8, 0..15 as every INT4 format stores them) -> bf16 128 + z, exact: z moved into
    bf16 128's mantissa field, the value ``_int4_nibbles_bf16`` subtracts from 128 + code."""
    return (z.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)


@triton.jit
def _int4_zero_operands(b, z_a, z_b, BLOCK_N: tl.constexpr, RUN: tl.constexpr, HAS_ZP: tl.constexpr,
                        ZERO: tl.constexpr, SCALE_ACC: tl.constexpr):
    """The (low, high) nibbles' zero operands of ``_int4_nibbles_bf16``, shaped like the bytes ``b``: bf16 128 +
    the symmetric zero (a constant), or the zero points ``_tile_scales`` loaded (z_a, z_b), made bf16 once per
    group and broadcast as the scales are: one per row with ``SCALE_ACC``, else per run of RUN columns of each
    SPLIT half (the only other layout whose zero points take the PTX: ``_tile_dot``)."""
    HALF: tl.constexpr = b.shape[1]
    if not HAS_ZP:
        zero_lo = tl.full(b.shape, 128.0 + ZERO, tl.bfloat16)
        zero_hi = zero_lo
    elif SCALE_ACC:
        zero_lo = tl.broadcast_to(_int4_zero_bf16(z_a)[:, None], b.shape)
        zero_hi = zero_lo
    else:
        zero_lo = _bcast(_int4_zero_bf16(z_a), BLOCK_N, HALF, RUN)
        zero_hi = _bcast(_int4_zero_bf16(z_b), BLOCK_N, HALF, RUN)
    return zero_lo, zero_hi


@triton.jit
def _fp16_scale_split(s):
    """fp16 scales -> (hi, lo) in bf16 with hi + lo == s exactly: hi is s rounded to bf16's 8 significant bits, lo
    the remainder (at most half of hi's last place and a multiple of s's fp16 ulp: at most 2 significant bits,
    exact in bf16; checked for every fp16 value in ``tests/kernels/test_triton_wq_decode_rounding.py``)."""
    s32 = s.to(tl.float32)
    hi = s32.to(tl.bfloat16)
    return hi, (s32 - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _e4m3_bf16_scaled(bits):
    """float8 e4m3fn bytes (uint8) -> bf16 ``s x 2^118``, exact (inline PTX): the 7 magnitude
    bits moved into bf16's exponent and mantissa fields give s x 2^-120 (subnormals included), and two exact
    power-of-two multiplies (2^127, 2^111) take it to s x 2^118, below bf16's 2^128 for every finite scale (<= 448)."""
    return tl.inline_asm_elementwise(
        E4M3_BF16_SCALED_PTX,
        constraints="=r,=r,r",
        args=[bits],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _nv_nibbles_bf16(b, s_lo, s_hi):
    """(low, high) nibbles of the bytes ``b`` as NVFP4 values times their scales times 2^-8 in bf16 (inline PTX,
    exact): the e2m1 bits moved into bf16's fields are the value times 2^-126, and one ``mul.bf16x2`` by the scale
    as ``_e4m3_bf16_scaled`` gives it (s x 2^118) leaves value x s x 2^-8, a normal bf16 of at most 6 significant
    bits. ``s_lo`` / ``s_hi`` (bf16) shaped like ``b``; the kernel multiplies the fp32 sums by 2^8. Two bytes a
    call as in ``_int4_nibbles_bf16``."""
    return tl.inline_asm_elementwise(
        NV_NIBBLES_PTX,
        constraints="=r,=r,h,r,r",
        args=[b, s_lo, s_hi],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _e8m0_bf16(e):
    """E8M0 exponents (uint8) -> bf16 2^(e - 127): the exponent moved into bf16's exponent field (as the MXFP4 PTX
    does per weight; e = 0 gives 0, e = 255 infinity, as there)."""
    return (e.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)


@triton.jit
def _mx_nibbles_scaled_bf16(b, s_lo, s_hi):
    """(low, high) nibbles of the bytes ``b`` as MXFP4 values times bf16 scales ``s_lo`` / ``s_hi`` (powers of two
    from ``_e8m0_bf16``, shaped like ``b``; inline PTX, exact): ``_mx_nibbles_bf16`` with the scales already bf16,
    so no per-weight byte shuffling of the exponents. Two bytes a call as in ``_int4_nibbles_bf16``."""
    return tl.inline_asm_elementwise(
        MX_NIBBLES_SCALED_PTX,
        constraints="=r,=r,h,r,r",
        args=[b, s_lo, s_hi],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _mx_value(codes):
    """e2m1 codes (int32, 0..15) -> fp32 values (plain Triton arithmetic)."""
    magnitude_code = codes & 7
    exponent = magnitude_code >> 1
    half = (magnitude_code & 1).to(tl.float32) * 0.5
    magnitude = tl.where(exponent == 0, half, (1.0 + half) * tl.exp2((exponent - 1).to(tl.float32)))
    return tl.where((codes & 8) != 0, -magnitude, magnitude)


@triton.jit
def _e4m3_value(bits):
    """float8 e4m3fn bytes (uint8) -> fp32 values (plain Triton arithmetic; no NaN in scales)."""
    b = bits.to(tl.int32)
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    magnitude = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((b & 128) != 0, -magnitude, magnitude)


@triton.jit
def _bcast(t, BLOCK_N: tl.constexpr, COLS: tl.constexpr, GROUP: tl.constexpr):
    """[BLOCK_N, COLS // GROUP] -> [BLOCK_N, COLS], each value repeated over its GROUP columns."""
    return tl.reshape(tl.broadcast_to(t[:, :, None], (BLOCK_N, COLS // GROUP, GROUP)), (BLOCK_N, COLS))


@triton.jit
def _group_scale(v, s, BLOCK_N: tl.constexpr, COLS: tl.constexpr, GROUP: tl.constexpr):
    """v [BLOCK_N, COLS] times s [BLOCK_N, COLS // GROUP] broadcast over each group of GROUP columns."""
    v3 = tl.reshape(v, (BLOCK_N, COLS // GROUP, GROUP))
    return tl.reshape(v3 * s[:, :, None], (BLOCK_N, COLS))


@triton.jit
def _split_run_groups(k0, HALF: tl.constexpr, GROUP: tl.constexpr, RUN: tl.constexpr):
    """Scale groups of the runs of RUN columns of a SPLIT tile's low and high halves (RUN divides 32, and
    GROUP divides RUN or is a multiple of it): low run t holds columns k0 + (t // (32 / RUN)) * 64 +
    (t % (32 / RUN)) * RUN onwards, its high twin the same plus 32."""
    PER_HALF_CHUNK: tl.constexpr = HALF_CHUNK // RUN
    t = tl.arange(0, HALF // RUN)
    col_lo = k0 + (t // PER_HALF_CHUNK) * SPLIT_CHUNK + (t % PER_HALF_CHUNK) * RUN
    return col_lo // GROUP, (col_lo + HALF_CHUNK) // GROUP


@triton.jit
def _load_groups(ptr, row, g, KRED, GROUP: tl.constexpr, EVEN_K: tl.constexpr, other):
    """ptr[row[:, None] + g[None, :]] for group indices g [G] of rows row [BLOCK_N] (masked past the row's end)."""
    if EVEN_K:
        return tl.load(ptr + row[:, None] + g[None, :])
    return tl.load(ptr + row[:, None] + g[None, :], mask=(g < tl.cdiv(KRED, GROUP))[None, :], other=other)


@triton.jit
def _columns(perm_base, k, KRED, EVEN_K: tl.constexpr, HAS_PERM: tl.constexpr):
    """The activation columns that stored columns ``k`` multiply: themselves, or perm[k] (activation order)."""
    if not HAS_PERM:
        return k
    if EVEN_K:
        return tl.load(perm_base + k)
    return tl.load(perm_base + k, mask=k < KRED, other=0)


@triton.jit
def _tile_scales(s_ptr, z_ptr, s_row, z_row, ki, KRED,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, KIND: tl.constexpr,
                 HAS_ZP: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, SCALE_ACC: tl.constexpr,
                 SCALED_DOT: tl.constexpr):
    """The raw scale and zero-point tiles of K tile ``ki`` for ``_tile_dot``: (s_a, s_b, z_a, z_b), the low and high
    halves' (SPLIT 4-bit) or the whole tile's in s_a / z_a, a constant where a format has none.

    The kernel loads them one K tile ahead and carries them through the loop: a scale tile is too narrow for the
    pipeliner's asynchronous copies (one 8-16-bit value per thread), so loaded where it is used each K step waited
    for its global-memory latency. Nothing here may use the loaded values (that would wait for them); decoding
    (e4m3, E8M0, the fp16 split) happens in ``_tile_dot``."""
    k0 = ki * BLOCK_K
    none = tl.zeros((1,), dtype=tl.int8)
    s_b = none
    z_a = none
    z_b = none
    if SCALE_ACC:
        s_a = tl.load(s_ptr + s_row + k0 // GROUP)
        if HAS_ZP:
            z_a = tl.load(z_ptr + z_row + k0 // GROUP)
    elif KIND == KIND_INT8 or not SPLIT or SCALED_DOT:
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        other = 127 if KIND == KIND_MXFP4 else 0
        s_a = _load_groups(s_ptr, s_row, g, KRED, GROUP, EVEN_K, other)
        if HAS_ZP:
            z_a = _load_groups(z_ptr, z_row, g, KRED, GROUP, EVEN_K, 0)
    else:
        HALF: tl.constexpr = BLOCK_K // 2
        if KIND == KIND_MXFP4:
            # the low nibbles' 32-column groups are the tile's even scale groups, the high ones' the odd
            g_lo = k0 // GROUP + 2 * tl.arange(0, HALF // GROUP)
            g_hi = g_lo + 1
        elif KIND == KIND_NVFP4:
            # a chunk's low half holds its first HALF_CHUNK // GROUP groups, the high half the next ones
            PER_HALF: tl.constexpr = HALF_CHUNK // GROUP
            t = tl.arange(0, HALF // GROUP)
            g_lo = k0 // GROUP + (t // PER_HALF) * (2 * PER_HALF) + t % PER_HALF
            g_hi = g_lo + PER_HALF
        elif 32 % GROUP == 0 or GROUP % 32 == 0:
            # INT4: one value per run of min(GROUP, 32) columns of a half (a 32-column half-chunk holds whole
            # groups or lies inside one), broadcast in _tile_dot: [BLOCK_N, HALF // RUN] loads, not one per weight
            RUN: tl.constexpr = GROUP if GROUP < 32 else 32
            g_lo, g_hi = _split_run_groups(k0, HALF, GROUP, RUN)
        else:  # INT4 groups that split a half-chunk unevenly: one value per weight
            idx = tl.arange(0, HALF)
            k_lo = k0 + (idx // HALF_CHUNK) * SPLIT_CHUNK + idx % HALF_CHUNK
            g_lo = k_lo // GROUP
            g_hi = (k_lo + HALF_CHUNK) // GROUP
        other = 127 if KIND == KIND_MXFP4 else 0
        s_a = _load_groups(s_ptr, s_row, g_lo, KRED, GROUP, EVEN_K, other)
        s_b = _load_groups(s_ptr, s_row, g_hi, KRED, GROUP, EVEN_K, other)
        if HAS_ZP:
            z_a = _load_groups(z_ptr, z_row, g_lo, KRED, GROUP, EVEN_K, 0)
            z_b = _load_groups(z_ptr, z_row, g_hi, KRED, GROUP, EVEN_K, 0)
    return s_a, s_b, z_a, z_b


@triton.jit
def _tile_dot(acc, w_ptr, w_row, x_lo, x_hi, ki, KRED, ROW_BYTES, s_a, s_b, z_a, z_b,
              BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
              KIND: tl.constexpr, HAS_ZP: tl.constexpr, ZERO: tl.constexpr, SPLIT: tl.constexpr,
              FAST: tl.constexpr, EVEN_K: tl.constexpr, SCALE_ACC: tl.constexpr, SCALED_DOT: tl.constexpr,
              CHAIN_ACC: tl.constexpr = False):
    """acc [BLOCK_N, BLOCK_M] += W[rows, K tile ki] @ X^T[K tile ki, pairs], weights dequantized in registers.

    w_row: [BLOCK_N] int64 element offsets of the tile's weight rows in w; ROW_BYTES: the stored length of a 4-bit
    row in bytes (KRED / 2, or more with SPLIT's pad). x_lo, x_hi: the activation tiles, [BLOCK_K // 2, BLOCK_M]
    each (SPLIT 4-bit: the columns of the low / high nibbles), or x_lo the whole [BLOCK_K, BLOCK_M] tile.
    s_a, s_b, z_a, z_b: the tile's scales and zero points as ``_tile_scales`` loaded them.
    """
    # Each K tile's dots start from zero and are added to the running sums after them. Chaining the dots onto the
    # loop-carried accumulator made ptxas serialize every wgmma (C7515, "non wgmma instructions defining accumulator
    # registers ... between start and end of the pipeline stage": a wait after each 64 x 16 x 16 step, 16 a K tile
    # of w1), for every path that scales each weight (MXFP4, NVFP4, INT4 in runs); a fresh product keeps the tile's
    # wgmmas in flight together, as the one-scale-a-tile path (SCALE_ACC) always did. CHAIN_ACC (many-pair tiles,
    # WqConfig.chain_acc) chains them after all: there the fresh product is a second BLOCK_N x BLOCK_M fp32 register
    # set (sm_90, MXFP4 w1 128 x 128 x 64 with 8 warps: Triton 3.6 17.0 -> 12.8 SASS a weight byte chained, wgmma
    # waits 4 -> 2 of 8; Triton 3.9 spilled 216 bytes unchained), and chained 8-warp tiles keep their wgmmas in flight
    if CHAIN_ACC and not SCALE_ACC:
        part = acc
    else:
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if SCALE_ACC:
        # the tile lies in one scale group: scale the fp32 product of the exact codes once per (row, pair)
        s_tile = s_a.to(tl.float32)
    if KIND == KIND_INT8:
        offs_k = ki * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:
            codes = tl.load(w_ptr + w_row[:, None] + offs_k[None, :])
        else:
            codes = tl.load(w_ptr + w_row[:, None] + offs_k[None, :], mask=(offs_k < KRED)[None, :], other=0)
        v = codes.to(tl.int32).to(tl.float32)
        if HAS_ZP:
            if SCALE_ACC:
                v = v - z_a.to(tl.float32)[:, None]
            else:
                v = v - _bcast(z_a.to(tl.float32), BLOCK_N, BLOCK_K, GROUP)
        else:
            v = v - ZERO
        if not SCALE_ACC:
            v = _group_scale(v, s_a.to(tl.float32), BLOCK_N, BLOCK_K, GROUP)
        part = tl.dot(v.to(x_lo.dtype), x_lo, part)
    else:
        HALF: tl.constexpr = BLOCK_K // 2
        offs_b = ki * HALF + tl.arange(0, HALF)  # the tile's bytes
        if EVEN_K:
            b = tl.load(w_ptr + w_row[:, None] + offs_b[None, :])
        else:
            b = tl.load(w_ptr + w_row[:, None] + offs_b[None, :], mask=(offs_b < ROW_BYTES)[None, :], other=0)
        # SPLIT INT4 scales of whole runs (a 32-column half-chunk holds whole groups or lies in one)
        RUNS: tl.constexpr = SPLIT and (32 % GROUP == 0 or GROUP % 32 == 0)
        RUN: tl.constexpr = GROUP if GROUP < 32 else 32
        if KIND == KIND_MXFP4 and SCALED_DOT:
            # checkpoint nibble order, Triton's own MXFP4 upcast (tl.dot_scaled: e2m1 -> bf16, times the E8M0 scale)
            part = tl.dot_scaled(b, s_a, "e2m1", x_lo, None, "bf16", part, fast_math=True)
        elif KIND == KIND_MXFP4:
            if SPLIT:
                if FAST:
                    # each E8M0 exponent made bf16 2^(e - 127) once per group, not per weight inside the PTX
                    lo, hi = _mx_nibbles_scaled_bf16(b, _bcast(_e8m0_bf16(s_a), BLOCK_N, HALF, GROUP),
                                                     _bcast(_e8m0_bf16(s_b), BLOCK_N, HALF, GROUP))
                else:
                    bi = b.to(tl.int32)
                    lo = _group_scale(_mx_value(bi & 15), tl.exp2(s_a.to(tl.float32) - 127.0), BLOCK_N, HALF, GROUP)
                    hi = _group_scale(_mx_value(bi >> 4), tl.exp2(s_b.to(tl.float32) - 127.0), BLOCK_N, HALF, GROUP)
            else:
                if FAST:
                    # columns 2j (low) and 2j + 1 (high) share byte j's group: 16 bytes per group
                    s_bytes = _bcast(s_a, BLOCK_N, HALF, GROUP // 2)
                    lo, hi = _mx_nibbles_bf16(b, s_bytes, s_bytes)
                    w = tl.interleave(lo, hi)
                else:
                    bi = b.to(tl.int32)
                    w = tl.interleave(_mx_value(bi & 15), _mx_value(bi >> 4))
                    w = _group_scale(w, tl.exp2(s_a.to(tl.float32) - 127.0), BLOCK_N, BLOCK_K, GROUP)
        elif KIND == KIND_NVFP4:
            if SPLIT and FAST:
                # e2m1 x (e4m3 scale x 2^118) in one bf16 multiply, exact; the kernel undoes the 2^-8 on the fp32 sums
                lo, hi = _nv_nibbles_bf16(b, _bcast(_e4m3_bf16_scaled(s_a), BLOCK_N, HALF, GROUP),
                                          _bcast(_e4m3_bf16_scaled(s_b), BLOCK_N, HALF, GROUP))
            elif SPLIT:
                bi = b.to(tl.int32)
                lo = _mx_value(bi & 15) * _bcast(_e4m3_value(s_a), BLOCK_N, HALF, GROUP)
                hi = _mx_value(bi >> 4) * _bcast(_e4m3_value(s_b), BLOCK_N, HALF, GROUP)
            else:
                if FAST:
                    unit = tl.full(b.shape, 127, tl.uint8)  # E8M0 2^0: the e2m1 values themselves, in bf16
                    lo, hi = _mx_nibbles_bf16(b, unit, unit)
                else:
                    bi = b.to(tl.int32)
                    lo = _mx_value(bi & 15)
                    hi = _mx_value(bi >> 4)
                sb = _bcast(_e4m3_value(s_a), BLOCK_N, HALF, GROUP // 2)
                w = tl.interleave(lo * sb.to(lo.dtype), hi * sb.to(hi.dtype))
        elif FAST and RUNS and not SCALE_ACC:
            # INT4 code - zero point times its fp16 scale, rounded once to bf16 as the fp32 product would be
            s_lo_hi, s_lo_lo = _fp16_scale_split(s_a)
            s_hi_hi, s_hi_lo = _fp16_scale_split(s_b)
            zero_lo, zero_hi = _int4_zero_operands(b, z_a, z_b, BLOCK_N, RUN, HAS_ZP, ZERO, SCALE_ACC)
            lo, hi = _int4_nibbles_scaled_bf16(b, zero_lo, zero_hi, _bcast(s_lo_hi, BLOCK_N, HALF, RUN),
                                               _bcast(s_lo_lo, BLOCK_N, HALF, RUN), _bcast(s_hi_hi, BLOCK_N, HALF, RUN),
                                               _bcast(s_hi_lo, BLOCK_N, HALF, RUN))
        else:  # INT4
            if FAST and (not HAS_ZP or SCALE_ACC):
                # zero points scaled per weight in fp32 below (checkpoint order, uneven SPLIT groups) stay on the
                # plain path: through the PTX and back to fp32 compiled to more instructions (sm_90, 16 x 64 x 128
                # w1 in checkpoint order, g32: 14.0 -> 17.2 per weight byte)
                zero_lo, zero_hi = _int4_zero_operands(b, z_a, z_b, BLOCK_N, RUN, HAS_ZP, ZERO, SCALE_ACC)
                lo, hi = _int4_nibbles_bf16(b, zero_lo, zero_hi)
            else:
                bi = b.to(tl.int32)
                lo = (bi & 15).to(tl.float32)
                hi = (bi >> 4).to(tl.float32)
                if HAS_ZP:
                    if SCALE_ACC:
                        z = z_a.to(tl.float32)[:, None]
                        lo = lo - z
                        hi = hi - z
                    elif RUNS:
                        lo = lo - _bcast(z_a.to(tl.float32), BLOCK_N, HALF, RUN)
                        hi = hi - _bcast(z_b.to(tl.float32), BLOCK_N, HALF, RUN)
                    elif SPLIT:
                        lo = lo - z_a.to(tl.float32)
                        hi = hi - z_b.to(tl.float32)
                    else:
                        zb = _bcast(z_a.to(tl.float32), BLOCK_N, HALF, GROUP // 2)
                        lo = lo - zb
                        hi = hi - zb
                else:
                    lo = lo - ZERO
                    hi = hi - ZERO
            if not SCALE_ACC:
                if RUNS:
                    lo = _group_scale(lo.to(tl.float32), s_a.to(tl.float32), BLOCK_N, HALF, RUN)
                    hi = _group_scale(hi.to(tl.float32), s_b.to(tl.float32), BLOCK_N, HALF, RUN)
                elif SPLIT:
                    lo = lo.to(tl.float32) * s_a.to(tl.float32)
                    hi = hi.to(tl.float32) * s_b.to(tl.float32)
                else:
                    sb = _bcast(s_a.to(tl.float32), BLOCK_N, HALF, GROUP // 2)
                    lo = lo.to(tl.float32) * sb
                    hi = hi.to(tl.float32) * sb
            if not SPLIT:
                w = tl.interleave(lo, hi)
        if KIND == KIND_MXFP4 and SCALED_DOT:
            pass
        elif SPLIT:
            part = tl.dot(lo.to(x_lo.dtype), x_lo, part)
            part = tl.dot(hi.to(x_hi.dtype), x_hi, part)
        else:
            part = tl.dot(w.to(x_lo.dtype), x_lo, part)
    if SCALE_ACC:
        return acc + part * s_tile[:, None]
    if CHAIN_ACC:
        return part
    return acc + part


@triton.jit
def _gated_activation(gate, up, limit, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr):
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    if ACT == ACT_SWIGLUOAI:
        return (up + 1.0) * (gate * tl.sigmoid(gate * SWIGLUOAI_ALPHA))
    if ACT == ACT_GELU:
        return 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    return gate * tl.sigmoid(gate) * up


# Counts that change with the batch or the expert layout are not specialized on (no recompile when they do).
@triton.jit(do_not_specialize=["num_pairs", "num_experts", "num_row_blocks", "k_tiles_per_split", "stride_os"])
def wq_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, rw_ptr, out_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr, perm_ptr, gs_ptr,
    R_OUT, KRED, num_pairs, num_experts, num_row_blocks, x_row_div, limit,
    stride_xm, stride_we, stride_wr, stride_se, stride_sr, stride_ze, stride_zr, stride_be, stride_om, stride_pe,
    k_tiles_per_split, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GROUP: tl.constexpr, KIND: tl.constexpr, HAS_ZP: tl.constexpr, ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, INTERLEAVED: tl.constexpr,
    ROUTER_WEIGHT: tl.constexpr, PAIR_BLOCKS: tl.constexpr, SPLIT: tl.constexpr, FAST: tl.constexpr,
    EVEN_K: tl.constexpr, SCALE_ACC: tl.constexpr, SCALED_DOT: tl.constexpr = False, HAS_PERM: tl.constexpr = False,
    SPLIT_K: tl.constexpr = False, CHAIN_ACC: tl.constexpr = False,
):
    """out[pair, r] for the weight rows r of one BLOCK_N tile and the pairs of one BLOCK_M row block.

    GATED (w1): R_OUT = N, rows r (gate) and r + N (up) (2r, 2r + 1 with INTERLEAVED), activation fused.
    Otherwise (w2): R_OUT = K, the pair's router weight fused (ROUTER_WEIGHT).
    HAS_PERM: stored column j reads activation column perm[expert, j] (activation order).
    KIND_NVFP4: gs_ptr holds each expert's fp32 global scale, applied to the accumulators.
    SPLIT_K (few tokens: split-K): program_id(1) is the slice of the reduction, ``k_tiles_per_split`` K tiles
    from slice * k_tiles_per_split; out_ptr is an fp32 workspace [slices, pairs, R_OUT (x2 GATED)] (slice
    stride ``stride_os``, pair stride ``stride_om``) that takes the raw partial sums (gate in columns
    [0, R_OUT), up in [R_OUT, 2 R_OUT)); ``wq_splitk_act_kernel`` / ``wq_splitk_sum_kernel`` add the slices
    and run the epilogue.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(R_OUT, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_row_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_size
    pid_n = (pid % num_in_group) // group_size

    offs_m = tl.arange(0, BLOCK_M)
    if PAIR_BLOCKS:
        # one block per (token, slot) pair, its expert read straight from topk_ids
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if (expert < 0) | (expert >= num_experts):
            return
        pair = tl.where(offs_m == 0, pid_m, num_pairs)
    else:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + offs_m)
    pair_ok = pair < num_pairs
    x_row_off = (pair // x_row_div).to(tl.int64) * stride_xm

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < R_OUT
    rows = tl.minimum(offs_n, R_OUT - 1).to(tl.int64)  # rows past the end read the last row; never stored
    if GATED:
        if INTERLEAVED:
            rows_a = 2 * rows
            rows_b = rows_a + 1
        else:
            rows_a = rows
            rows_b = rows + R_OUT
    else:
        rows_a = rows
    perm_base = perm_ptr + expert * stride_pe
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    z_base = z_ptr + expert * stride_ze

    acc_a = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if GATED:
        acc_b = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if SPLIT_K:
        k_first = tl.program_id(1) * k_tiles_per_split
        k_last = tl.minimum(k_first + k_tiles_per_split, tl.cdiv(KRED, BLOCK_K))
    else:
        k_first = 0
        k_last = tl.cdiv(KRED, BLOCK_K)
    # scales and zero points travel one K tile ahead of the weights (``_tile_scales``)
    sa_a, sb_a, za_a, zb_a = _tile_scales(s_base, z_base, rows_a * stride_sr, rows_a * stride_zr, k_first, KRED,
                                          BLOCK_N, BLOCK_K, GROUP, KIND, HAS_ZP, SPLIT, EVEN_K, SCALE_ACC, SCALED_DOT)
    if GATED:
        sa_b, sb_b, za_b, zb_b = _tile_scales(s_base, z_base, rows_b * stride_sr, rows_b * stride_zr, k_first, KRED,
                                              BLOCK_N, BLOCK_K, GROUP, KIND, HAS_ZP, SPLIT, EVEN_K, SCALE_ACC,
                                              SCALED_DOT)
    for ki in range(k_first, k_last):
        k0 = ki * BLOCK_K
        k_next = tl.minimum(ki + 1, k_last - 1)  # the last tile reloads its own (never used)
        next_a = _tile_scales(s_base, z_base, rows_a * stride_sr, rows_a * stride_zr, k_next, KRED, BLOCK_N,
                              BLOCK_K, GROUP, KIND, HAS_ZP, SPLIT, EVEN_K, SCALE_ACC, SCALED_DOT)
        if GATED:
            next_b = _tile_scales(s_base, z_base, rows_b * stride_sr, rows_b * stride_zr, k_next, KRED, BLOCK_N,
                                  BLOCK_K, GROUP, KIND, HAS_ZP, SPLIT, EVEN_K, SCALE_ACC, SCALED_DOT)
        if SPLIT and KIND != KIND_INT8:
            idx = tl.arange(0, BLOCK_K // 2)
            k_lo = k0 + (idx // HALF_CHUNK) * SPLIT_CHUNK + idx % HALF_CHUNK
            k_hi = k_lo + HALF_CHUNK
            c_lo = _columns(perm_base, k_lo, KRED, EVEN_K, HAS_PERM)
            c_hi = _columns(perm_base, k_hi, KRED, EVEN_K, HAS_PERM)
            if EVEN_K:
                x_lo = tl.load(x_ptr + x_row_off[None, :] + c_lo[:, None], mask=pair_ok[None, :], other=0.0)
                x_hi = tl.load(x_ptr + x_row_off[None, :] + c_hi[:, None], mask=pair_ok[None, :], other=0.0)
            else:
                x_lo = tl.load(x_ptr + x_row_off[None, :] + c_lo[:, None], mask=pair_ok[None, :] & (k_lo < KRED)[:, None], other=0.0)
                x_hi = tl.load(x_ptr + x_row_off[None, :] + c_hi[:, None], mask=pair_ok[None, :] & (k_hi < KRED)[:, None], other=0.0)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            cols = _columns(perm_base, offs_k, KRED, EVEN_K, HAS_PERM)
            if EVEN_K:
                x_lo = tl.load(x_ptr + x_row_off[None, :] + cols[:, None], mask=pair_ok[None, :], other=0.0)
            else:
                x_lo = tl.load(x_ptr + x_row_off[None, :] + cols[:, None], mask=pair_ok[None, :] & (offs_k < KRED)[:, None], other=0.0)
            x_hi = x_lo
        acc_a = _tile_dot(acc_a, w_base, rows_a * stride_wr, x_lo, x_hi, ki, KRED, stride_wr, sa_a, sb_a, za_a, zb_a,
                          BLOCK_N, BLOCK_M, BLOCK_K, GROUP, KIND, HAS_ZP, ZERO, SPLIT, FAST, EVEN_K, SCALE_ACC,
                          SCALED_DOT, CHAIN_ACC)
        sa_a, sb_a, za_a, zb_a = next_a
        if GATED:
            acc_b = _tile_dot(acc_b, w_base, rows_b * stride_wr, x_lo, x_hi, ki, KRED, stride_wr, sa_b, sb_b, za_b,
                              zb_b, BLOCK_N, BLOCK_M, BLOCK_K, GROUP, KIND, HAS_ZP, ZERO, SPLIT, FAST, EVEN_K,
                              SCALE_ACC, SCALED_DOT, CHAIN_ACC)
            sa_b, sb_b, za_b, zb_b = next_b
    if KIND == KIND_NVFP4 and SPLIT and FAST:
        acc_a = acc_a * NVFP4_FAST_SUM_SCALE
        if GATED:
            acc_b = acc_b * NVFP4_FAST_SUM_SCALE

    if SPLIT_K:  # raw fp32 partial sums of this slice; the reduction kernel runs the epilogue
        ws_rows = out_ptr + tl.program_id(1).to(tl.int64) * stride_os + pair.to(tl.int64)[None, :] * stride_om
        ws_mask = pair_ok[None, :] & n_ok[:, None]
        tl.store(ws_rows + offs_n[:, None], acc_a, mask=ws_mask)
        if GATED:
            tl.store(ws_rows + R_OUT + offs_n[:, None], acc_b, mask=ws_mask)
        return
    if KIND == KIND_NVFP4:
        global_scale = tl.load(gs_ptr + expert)
        acc_a = acc_a * global_scale
        if GATED:
            acc_b = acc_b * global_scale
    if HAS_BIAS:
        acc_a += tl.load(b_ptr + expert * stride_be + rows_a).to(tl.float32)[:, None]
        if GATED:
            acc_b += tl.load(b_ptr + expert * stride_be + rows_b).to(tl.float32)[:, None]
    if GATED:
        h = _gated_activation(acc_a, acc_b, limit, ACT, HAS_LIMIT)
    else:
        h = acc_a
        if ROUTER_WEIGHT:
            h = h * tl.load(rw_ptr + pair, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
    out_rows = pair.to(tl.int64) * stride_om
    tl.store(out_ptr + out_rows[None, :] + offs_n[:, None], h.to(out_ptr.dtype.element_ty),
             mask=pair_ok[None, :] & n_ok[:, None])


@triton.jit
def _slice_sum(row, offs, mask, splits, stride_ws, MAX_SPLITS: tl.constexpr):
    """The split-K slices of one workspace row added in order (deterministic): unrolled to MAX_SPLITS (>= splits,
    the rest masked off), so every slice's load is issued before the first add waits (a runtime loop over the
    slices waited a global-memory latency per slice)."""
    total = tl.zeros(offs.shape, dtype=tl.float32)
    slice_index = tl.zeros(offs.shape, dtype=tl.int32)
    for s in tl.static_range(MAX_SPLITS):
        total += tl.load(row + s * stride_ws + offs, mask=mask & (slice_index + s < splits), other=0.0)
    return total


@triton.jit
def wq_splitk_act_kernel(ws_ptr, ids_ptr, gs_ptr, b_ptr, out_ptr, N, num_experts, splits, stride_ws, stride_be,
                         stride_om, limit, BLOCK: tl.constexpr, KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
                         ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, INTERLEAVED: tl.constexpr,
                         MAX_SPLITS: tl.constexpr = 1):
    """w1's split-K epilogue: out[pair, n] = act(gs * sum_s gate + b1, gs * sum_s up + b1) for one pair (program 0)
    and BLOCK columns (program 1), the ``splits`` (<= MAX_SPLITS) slices added in order (deterministic). Pairs of
    no local expert are left unwritten, as the unsplit kernel leaves them."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    row = ws_ptr + pair.to(tl.int64) * (2 * N)
    gate = _slice_sum(row, offs, ok, splits, stride_ws, MAX_SPLITS)
    up = _slice_sum(row + N, offs, ok, splits, stride_ws, MAX_SPLITS)
    if KIND == KIND_NVFP4:
        global_scale = tl.load(gs_ptr + expert)
        gate = gate * global_scale
        up = up * global_scale
    if HAS_BIAS:
        if INTERLEAVED:
            rows_gate = 2 * offs
            rows_up = rows_gate + 1
        else:
            rows_gate = offs
            rows_up = offs + N
        gate += tl.load(b_ptr + expert * stride_be + rows_gate, mask=ok, other=0.0).to(tl.float32)
        up += tl.load(b_ptr + expert * stride_be + rows_up, mask=ok, other=0.0).to(tl.float32)
    h = _gated_activation(gate, up, limit, ACT, HAS_LIMIT)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs, h.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def wq_splitk_sum_kernel(ws_ptr, ids_ptr, rw_ptr, gs_ptr, b_ptr, out_ptr, K, num_experts, splits, stride_ws,
                         stride_be, stride_om, TOP_K: tl.constexpr, BLOCK: tl.constexpr, KIND: tl.constexpr,
                         HAS_BIAS: tl.constexpr, MAX_SPLITS: tl.constexpr = 1):
    """w2's split-K epilogue and the top-k sum in one pass: out[t, c] = sum over the slots j of token t (program 0)
    whose expert is local of g[t, j] * (gs * sum_s partial + b2[c]), for BLOCK columns c (program 1), the ``splits``
    (<= MAX_SPLITS) slices added in order. Slots of no local expert are masked, not branched around, so the loads
    of all slots and slices are issued together (a branch per slot waited a memory latency per slot and slice)."""
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < K
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        local = (expert >= 0) & (expert < num_experts)
        expert = tl.where(local, expert, 0)
        cols_ok = tl.where(local, ok, False)
        acc = _slice_sum(ws_ptr + pair.to(tl.int64) * K, offs, cols_ok, splits, stride_ws, MAX_SPLITS)
        if KIND == KIND_NVFP4:
            acc = acc * tl.load(gs_ptr + expert)
        if HAS_BIAS:
            acc += tl.load(b_ptr + expert * stride_be + offs, mask=cols_ok, other=0.0).to(tl.float32)
        total += tl.where(local, acc * tl.load(rw_ptr + pair).to(tl.float32), 0.0)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequant_values(codes, cols, rows, s_base, z_base, stride_sr, stride_zr, C, GROUP: tl.constexpr,
                    KIND: tl.constexpr, HAS_ZP: tl.constexpr, ZERO: tl.constexpr):
    """codes (int32) of columns ``cols`` [B] of rows ``rows`` [R] -> fp32 weights, one scale (and zero point)
    gathered per weight: any layout and group (checkpoint nibble order, INT8, channel groups of odd length)."""
    g = (tl.minimum(cols, C - 1) // GROUP)[None, :]
    s = tl.load(s_base + rows[:, None] * stride_sr + g)
    if KIND == KIND_MXFP4:
        return _mx_value(codes) * tl.exp2(s.to(tl.float32) - 127.0)
    if KIND == KIND_NVFP4:
        return _mx_value(codes) * _e4m3_value(s)
    if HAS_ZP:
        zero = tl.load(z_base + rows[:, None] * stride_zr + g).to(tl.float32)
    else:
        zero = ZERO
    return (codes.to(tl.float32) - zero) * s.to(tl.float32)


@triton.jit
def _split_values(b, k0, rows, s_base, z_base, stride_sr, stride_zr, C, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                  GROUP: tl.constexpr, KIND: tl.constexpr, HAS_ZP: tl.constexpr, ZERO: tl.constexpr,
                  FAST: tl.constexpr):
    """(low, high) nibble values of a SPLIT tile of bytes ``b`` [BLOCK_R, BLOCK_B] starting at column k0, where
    a 32-column half-chunk holds whole scale groups or lies in one: one scale (zero point) load per run of
    min(GROUP, 32) columns, broadcast; with ``FAST`` (bf16) the nibbles decoded by the GEMM's inline PTX."""
    RUN: tl.constexpr = GROUP if GROUP < 32 else 32
    g_lo, g_hi = _split_run_groups(k0, BLOCK_B, GROUP, RUN)
    s_row = rows * stride_sr
    if KIND == KIND_MXFP4:
        s_lo = _load_groups(s_base, s_row, g_lo, C, GROUP, False, 127)
        s_hi = _load_groups(s_base, s_row, g_hi, C, GROUP, False, 127)
        if FAST:
            lo, hi = _mx_nibbles_bf16(b, _bcast(s_lo, BLOCK_R, BLOCK_B, RUN), _bcast(s_hi, BLOCK_R, BLOCK_B, RUN))
        else:
            bi = b.to(tl.int32)
            lo = _group_scale(_mx_value(bi & 15), tl.exp2(s_lo.to(tl.float32) - 127.0), BLOCK_R, BLOCK_B, RUN)
            hi = _group_scale(_mx_value(bi >> 4), tl.exp2(s_hi.to(tl.float32) - 127.0), BLOCK_R, BLOCK_B, RUN)
    elif KIND == KIND_NVFP4:
        s_lo = _e4m3_value(_load_groups(s_base, s_row, g_lo, C, GROUP, False, 0))
        s_hi = _e4m3_value(_load_groups(s_base, s_row, g_hi, C, GROUP, False, 0))
        if FAST:  # e2m1 times its e4m3 scale is exact in bf16 (2 + 4 significant bits)
            unit = tl.full(b.shape, 127, tl.uint8)
            lo, hi = _mx_nibbles_bf16(b, unit, unit)
            lo = lo * _bcast(s_lo.to(lo.dtype), BLOCK_R, BLOCK_B, RUN)
            hi = hi * _bcast(s_hi.to(hi.dtype), BLOCK_R, BLOCK_B, RUN)
        else:
            bi = b.to(tl.int32)
            lo = _group_scale(_mx_value(bi & 15), s_lo, BLOCK_R, BLOCK_B, RUN)
            hi = _group_scale(_mx_value(bi >> 4), s_hi, BLOCK_R, BLOCK_B, RUN)
    else:
        s_lo = _load_groups(s_base, s_row, g_lo, C, GROUP, False, 0).to(tl.float32)
        s_hi = _load_groups(s_base, s_row, g_hi, C, GROUP, False, 0).to(tl.float32)
        if FAST and not HAS_ZP:
            symmetric = tl.full(b.shape, 128.0 + ZERO, tl.bfloat16)
            lo, hi = _int4_nibbles_bf16(b, symmetric, symmetric)
            lo = lo.to(tl.float32)
            hi = hi.to(tl.float32)
        else:
            bi = b.to(tl.int32)
            lo = (bi & 15).to(tl.float32)
            hi = (bi >> 4).to(tl.float32)
            if HAS_ZP:
                z_row = rows * stride_zr
                lo = lo - _bcast(_load_groups(z_base, z_row, g_lo, C, GROUP, False, 0).to(tl.float32),
                                 BLOCK_R, BLOCK_B, RUN)
                hi = hi - _bcast(_load_groups(z_base, z_row, g_hi, C, GROUP, False, 0).to(tl.float32),
                                 BLOCK_R, BLOCK_B, RUN)
            else:
                lo = lo - ZERO
                hi = hi - ZERO
        lo = _group_scale(lo, s_lo, BLOCK_R, BLOCK_B, RUN)
        hi = _group_scale(hi, s_hi, BLOCK_R, BLOCK_B, RUN)
    return lo, hi


@triton.jit
def _store_dequant(out_base, perm_base, values, cols, dst_rows, row_ok, stride_or, C, HAS_PERM: tl.constexpr):
    """values [R, B] of columns ``cols`` into their rows of the 16-bit scratch (columns through ``perm``: the
    activation order's original columns); columns past C (the SPLIT layout's pad) are dropped."""
    col_ok = cols < C
    if HAS_PERM:
        cols = tl.load(perm_base + cols, mask=col_ok, other=0)
    ptrs = out_base + dst_rows[:, None] * stride_or + cols[None, :]
    tl.store(ptrs, values.to(out_base.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def wq_dequant_kernel(
    w_ptr, s_ptr, z_ptr, perm_ptr, b_ptr, hit_ptr, out_ptr,
    R, C, ROW_BYTES, PAD_COLS, stride_we, stride_wr, stride_se, stride_sr, stride_ze, stride_zr, stride_pe, stride_be,
    stride_oe, stride_or,
    BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, GROUP: tl.constexpr, KIND: tl.constexpr, HAS_ZP: tl.constexpr,
    ZERO: tl.constexpr, SPLIT: tl.constexpr, FAST: tl.constexpr, HAS_PERM: tl.constexpr, DEINTERLEAVE: tl.constexpr,
    BIAS_COLUMNS: tl.constexpr,
):
    """One expert's quantized weight [R, C] (program 2) dequantized into a 16-bit scratch [E, R, C (+ PAD_COLS)], a
    tile of BLOCK_R rows (program 1) by BLOCK_B stored bytes (program 0) a program: the prefill path's memory-bound
    pass before the bf16 Hopper GEMMs (``prefill.py``). Experts no pair hits (``hit[e] == 0``) are skipped.

    ``DEINTERLEAVE`` (w1 stored gate 2n, up 2n + 1): row r goes to r // 2 (+ R / 2 for up), the stacked order
    the bf16 kernels read. ``BIAS_COLUMNS``: the tile of the first byte block also writes columns C .. C +
    PAD_COLS - 1 (at most 64) of its rows: the row's bias split into a 16-bit head and tail (C, C + 1; the input
    carries ones there) and zeros, so the bias enters the fp32 accumulator with about 16 significant bits.
    """
    expert = tl.program_id(2).to(tl.int64)
    if tl.load(hit_ptr + expert) == 0:
        return
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    rows = tl.minimum(rows, R - 1)
    if DEINTERLEAVE:
        dst_rows = rows // 2 + (rows % 2) * (R // 2)
    else:
        dst_rows = rows
    offs_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    b = tl.load(w_ptr + expert * stride_we + rows[:, None] * stride_wr + offs_b[None, :],
                mask=row_ok[:, None] & (offs_b < ROW_BYTES)[None, :], other=0)
    s_base = s_ptr + expert * stride_se
    z_base = z_ptr + expert * stride_ze
    out_base = out_ptr + expert * stride_oe
    perm_base = perm_ptr + expert * stride_pe
    if KIND == KIND_INT8:
        v = _dequant_values(b.to(tl.int32), offs_b, rows, s_base, z_base, stride_sr, stride_zr, C, GROUP, KIND,
                            HAS_ZP, ZERO)
        _store_dequant(out_base, perm_base, v, offs_b, dst_rows, row_ok, stride_or, C, HAS_PERM)
    else:
        if SPLIT:  # byte j of a 64-column chunk: columns j (low nibble) and j + 32 (high)
            c_lo = (offs_b // HALF_CHUNK) * SPLIT_CHUNK + offs_b % HALF_CHUNK
            c_hi = c_lo + HALF_CHUNK
        else:  # checkpoint order: columns 2j (low) and 2j + 1 (high)
            c_lo = 2 * offs_b
            c_hi = c_lo + 1
        if SPLIT and (32 % GROUP == 0 or GROUP % 32 == 0):
            k0 = tl.program_id(0) * (2 * BLOCK_B)
            lo, hi = _split_values(b, k0, rows, s_base, z_base, stride_sr, stride_zr, C, BLOCK_R, BLOCK_B, GROUP, KIND,
                                   HAS_ZP, ZERO, FAST)
        else:
            bi = b.to(tl.int32)
            lo = _dequant_values(bi & 15, c_lo, rows, s_base, z_base, stride_sr, stride_zr, C, GROUP, KIND, HAS_ZP, ZERO)
            hi = _dequant_values(bi >> 4, c_hi, rows, s_base, z_base, stride_sr, stride_zr, C, GROUP, KIND, HAS_ZP, ZERO)
        _store_dequant(out_base, perm_base, lo, c_lo, dst_rows, row_ok, stride_or, C, HAS_PERM)
        _store_dequant(out_base, perm_base, hi, c_hi, dst_rows, row_ok, stride_or, C, HAS_PERM)
    if BIAS_COLUMNS:
        if tl.program_id(0) == 0:
            bias = tl.load(b_ptr + expert * stride_be + rows).to(tl.float32)
            head = bias.to(out_ptr.dtype.element_ty)
            tail = (bias - head.to(tl.float32)).to(out_ptr.dtype.element_ty)
            pad = tl.arange(0, 64)[None, :]
            v = tl.where(pad == 0, head[:, None], tl.where(pad == 1, tail[:, None], 0.0))
            tl.store(out_base + dst_rows[:, None] * stride_or + C + pad, v.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & (pad < PAD_COLS))
