"""Host side of the weight-quantized Triton MoE: checks, configs, the build-time re-layout and the launches.

``fused_wq_experts`` is the whole layer for tokens as rows: align the (token,
slot) pairs by expert (one token: no alignment, one row block per pair), run the
w1 GEMM with bias and gated activation fused, run the w2 GEMM with bias and the
router weight fused, and sum over top-k. No device value is read on the host.

``relayout_nibbles`` is the one-time weight re-layout (``SPLIT``, see ``_kernels``):
a permutation of the 4-bit codes inside each 64-column chunk, exact, done once per
weight tensor by the experts class; rows whose length is not a multiple of 64 (any
K or N that is a multiple of 16, as tensor-parallel shards are) are padded with zero
bytes to the next multiple first, and the kernels mask the pad. ``sort_act_order`` is
the other one-time re-layout, for activation-ordered checkpoints (GPTQ ``desc_act``):
each expert's columns sorted by their group, so groups are contiguous, and the
permutation the kernels gather the activations through. ``WqConfig`` is the tile of one call; the
tuned tables (``tables.py``: the user's, written by ``moe-fsm tune``, over the shipped ``configs/wq_<device>.json``)
are keyed by layer shape and token count, with ``default_wq_config`` elsewhere.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, replace
from importlib import resources
from typing import Optional

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.inputs.quant import MX_FP4, QuantFamily, QuantScheme
from moe_fsm.kernels.activations import TRITON_ACTIVATION_CODES as ACTIVATIONS
from moe_fsm.kernels.triton_moe._runtime import require_device
from moe_fsm.kernels.triton_wq import prefill
from moe_fsm.kernels.triton_wq.tables import user_table

KINDS = {"mxfp4": 0, "int4": 1, "int8": 2, "nvfp4": 3}
COMPUTE_DTYPES = (torch.bfloat16, torch.float16)
MX_GROUP = 32
NVFP4_GROUP = 16
SPLIT_CHUNK = 64


@dataclass(frozen=True)
class WeightQuant:
    """How the weights are stored: ``kind`` mxfp4 | nvfp4 | int4 | int8, ``group`` columns per scale (-1: a whole row),
    ``zero_point`` whether asymmetric zero points come with the scales, ``act_order`` whether a g_idx names each
    column's group (activation-ordered checkpoints)."""

    kind: str
    group: int
    zero_point: bool = False
    act_order: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise KernelInputError(f"weight kind {self.kind!r} is not one of {list(KINDS)}")
        if self.kind == "mxfp4" and (self.group != MX_GROUP or self.zero_point):
            raise KernelInputError("MXFP4 weights have one E8M0 scale per 32 elements and no zero points")
        if self.kind == "nvfp4" and (self.group != NVFP4_GROUP or self.zero_point):
            raise KernelInputError("NVFP4 weights have one e4m3 scale per 16 elements, a global scale and no zero points")
        if self.group != -1 and self.group < 1:
            raise KernelInputError(f"group must be positive or -1 (per row), got {self.group}")
        if self.act_order and (self.kind in ("mxfp4", "nvfp4") or self.group == -1):
            raise KernelInputError("activation order (g_idx) applies to INT weights with group scales")

    @classmethod
    def for_scheme(cls, scheme: QuantScheme) -> "WeightQuant":
        """The layout of a scheme these kernels run: MXFP4 or NVFP4 with 16-bit activations, or INT4/INT8 WNA16."""
        if scheme.family is QuantFamily.MXFP4 and scheme.weight.dtype == MX_FP4 and scheme.activation is None:
            return cls("mxfp4", MX_GROUP)
        if scheme.family is QuantFamily.NVFP4 and scheme.activation is None:
            return cls("nvfp4", NVFP4_GROUP)
        if scheme.family is QuantFamily.INT_WNA16:
            group = scheme.group_size
            return cls(f"int{scheme.weight_bits}", group, scheme.zero_point, scheme.act_order and group != -1)
        raise KernelInputError(
            "the weight-quantized Triton MoE runs MXFP4 and NVFP4 weights with 16-bit activations and INT4/INT8 "
            f"weight-only layers; got {scheme.describe()}"
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
                  experts: int, rows: int, cols: int, split: bool) -> int:
    """Shapes and dtypes of one quantized weight [E, rows, cols]; returns its columns per scale."""
    stored = (split_columns(cols) if split else cols) // quant.packing
    if w.dtype != torch.uint8 or tuple(w.shape) != (experts, rows, stored):
        layout = " in the SPLIT layout (rows padded to whole 64-column chunks)" if split else ""
        raise KernelInputError(f"{name} must be uint8 [{experts}, {rows}, {stored}] ({quant.kind}){layout}; "
                               f"got {w.dtype} {list(w.shape)}")
    group = quant.columns_per_scale(cols)
    if cols % group:
        raise KernelInputError(f"{name}: {cols} columns are not a multiple of the scale group {group}")
    expected = (experts, rows, cols // group)
    if tuple(scale.shape) != expected:
        raise KernelInputError(f"{name}_scale must be {list(expected)}; got {list(scale.shape)}")
    if quant.kind == "mxfp4" and scale.dtype != torch.uint8:
        raise KernelInputError(f"{name}_scale holds E8M0 exponents as uint8; got {scale.dtype}")
    if quant.kind == "nvfp4" and scale.dtype != torch.float8_e4m3fn:
        raise KernelInputError(f"{name}_scale holds NVFP4 block scales as float8_e4m3fn; got {scale.dtype}")
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


def split_columns(cols: int) -> int:
    """Columns a row holds in the SPLIT layout: ``cols`` rounded up to whole 64-column chunks."""
    return -(-cols // SPLIT_CHUNK) * SPLIT_CHUNK


def relayout_nibbles(w: torch.Tensor) -> torch.Tensor:
    """Packed 4-bit codes [..., C/2] (column 2j low nibble, 2j + 1 high) -> the SPLIT layout of ``_kernels``.

    Byte j of each 64-column chunk holds column j in its low nibble and column j + 32 in its high one.
    Rows are first padded with zero bytes to ``split_columns(C)`` columns (C = 1440 -> 1472), so the
    result is [..., split_columns(C) / 2]; otherwise exact (a permutation of codes).
    """
    if w.dtype != torch.uint8:
        raise KernelInputError(f"the nibble re-layout takes packed 4-bit codes as uint8; got {w.dtype} {list(w.shape)}")
    cols = split_columns(w.shape[-1] * 2)
    w = torch.nn.functional.pad(w, (0, cols // 2 - w.shape[-1]))
    codes = torch.stack((w & 15, w >> 4), dim=-1).reshape(*w.shape[:-1], cols // SPLIT_CHUNK, 2, SPLIT_CHUNK // 2)
    return (codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(w.shape).contiguous()


def undo_relayout_nibbles(w: torch.Tensor, cols: Optional[int] = None) -> torch.Tensor:
    """The inverse of ``relayout_nibbles``: checkpoint order, cut to ``cols`` columns (default: all, pad included)."""
    stored = w.shape[-1] * 2
    chunks = w.reshape(*w.shape[:-1], stored // SPLIT_CHUNK, SPLIT_CHUNK // 2)
    codes = torch.stack((chunks & 15, chunks >> 4), dim=-2).reshape(*w.shape[:-1], stored)
    pairs = codes[..., : stored if cols is None else cols].reshape(*w.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def sort_act_order(w: torch.Tensor, g_idx: torch.Tensor, quant: WeightQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [E, R, C/p] of an activation-ordered weight and its g_idx [E, C] -> (codes with each expert's columns
    sorted by group, the permutation int32 [E, C]: sorted column j is column perm[e, j]).

    Every group must hold ``quant.group`` columns (GPTQ's do), so the sorted groups are the plain contiguous ones
    the kernels read; the scales and zero points are already in group order and stay as they are.
    """
    experts, cols = w.shape[0], w.shape[-1] * quant.packing
    if tuple(g_idx.shape) != (experts, cols) or g_idx.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(f"g_idx must be int32 [{experts}, {cols}]; got {g_idx.dtype} {list(g_idx.shape)}")
    groups = cols // quant.group
    counts = torch.zeros(experts, groups + 1, dtype=torch.int64, device=g_idx.device)
    counts.scatter_add_(1, g_idx.long().clamp(0, groups), torch.ones_like(g_idx, dtype=torch.int64))
    if bool((counts[:, :groups] != quant.group).any()):  # out-of-range groups land in the extra bin
        raise KernelInputError(f"g_idx must give each of the {groups} groups exactly {quant.group} columns, as "
                               "activation-ordered (desc_act) checkpoints do")
    perm = torch.argsort(g_idx.long(), dim=-1, stable=True)
    codes = torch.stack((w & 15, w >> 4), dim=-1).reshape(*w.shape[:-1], cols) if quant.packing == 2 else w
    codes = torch.gather(codes, -1, perm.unsqueeze(1).expand(codes.shape))
    if quant.packing == 2:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes.contiguous(), perm.to(torch.int32).contiguous()


def can_split(quant: "WeightQuant") -> bool:
    """Whether the weights can take the SPLIT layout: 4-bit codes (any even row length, padded to 64 columns)."""
    return quant.kind != "int8"


FLAGS = ("hopper_bf16", "chain_acc")  # WqConfig's on/off fields (the rest are tile sizes and counts)


@dataclass(frozen=True)
class WqConfig:
    """Tile of one weight-quantized MoE call: rows per block (shared by both GEMMs) and each GEMM's tile.

    ``block_n`` weight rows (the MMA's M side, swap-AB) by ``block_m`` (token, slot) pairs, ``block_k`` of the
    reduction per step. ``split_k`` / ``w2_split_k`` (default: ``split_k``): slices of w1's / w2's reduction run
    by separate programs (split-K, for few tokens, where the row blocks times the weight-row tiles are too few
    programs to keep the SMs' loads in flight), their fp32 partial sums added by a second pass that runs the
    epilogue; 1 is the one-pass kernel. ``hopper_bf16`` (prefill): the hit experts' weights dequantized into a
    16-bit scratch and both GEMMs run on the bf16 Hopper kernels with the bf16 experts' tile (``prefill.py``);
    the tile fields above are then unused. Where the call cannot take that path (no TMA, K or N not a multiple
    of 8) the tile fields run the swap-AB kernel. ``chain_acc``: each K tile's dots accumulate straight into the
    running sums instead of into a fresh product added after them (``_tile_dot``): for 8-warp many-pair tiles, where
    the fresh product is a second fp32 register set (fewer instructions a weight byte chained, and no wgmma waits
    added; at 4-warp tiles chaining serializes the wgmmas).
    """

    block_m: int
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 1
    w2_block_n: Optional[int] = None
    w2_block_k: Optional[int] = None
    w2_num_warps: Optional[int] = None
    w2_num_stages: Optional[int] = None
    split_k: int = 1
    w2_split_k: Optional[int] = None
    hopper_bf16: bool = False
    chain_acc: bool = False

    def to_json(self) -> dict:
        # the flags stay out of a table until set, so older tables read back unchanged
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}

    @classmethod
    def from_json(cls, data: dict) -> "WqConfig":
        try:
            return cls(**{k: bool(v) if k in FLAGS else int(v) for k, v in data.items()})
        except (TypeError, ValueError) as exc:
            raise KernelInputError(f"bad weight-quantized MoE config {data!r}: {exc}") from None

    def gemm(self, which: str) -> tuple[int, int, int, int]:
        """(block_n, block_k, num_warps, num_stages) of the w1 or w2 GEMM."""
        if which == "w2":
            return (self.w2_block_n or self.block_n, self.w2_block_k or self.block_k,
                    self.w2_num_warps or self.num_warps, self.w2_num_stages or self.num_stages)
        return self.block_n, self.block_k, self.num_warps, self.num_stages

    def splits(self, which: str) -> int:
        """K slices of the w1 or w2 GEMM (split-K; 1: one pass)."""
        return (self.w2_split_k or self.split_k) if which == "w2" else self.split_k

    def check(self) -> None:
        for name, value in asdict(self).items():
            if name in FLAGS:
                continue
            if value is not None and (value < 1 or (name.startswith(("block", "w2_block")) and value & (value - 1))):
                raise KernelInputError(f"WqConfig.{name} must be a positive power of two; got {value}")
        if self.block_m < 16 or min(self.gemm("w1")[0], self.gemm("w2")[0]) < 16:
            raise KernelInputError("WqConfig: block_m and block_n must be at least 16 (tensor-core tiles)")


# Split-K splits a decode GEMM whose programs are fewer than this many per SM, until they are at least that many.
# Measured on an H200 (132 SMs; docs/perf/weight_quantized.md, "Decode: wgmma serialization, the split rule"): one
# token's w1 at 1.35-1.42 programs an SM (gpt-oss-120b, Qwen3-235B-A22B) ran 1.11-1.17x faster in 2 slices, while
# 3.2-3.8 programs an SM (Mixtral's w1, Qwen3-235B-A22B's w2) lost time in any split and Mixtral's w2 at 0.91 gained
# 1.29x at 3; the rule it replaces (up to 4 an SM) split gpt-oss-120b 3/3 and ran slower than one pass there.
PROGRAMS_PER_SM = 2.5
MIN_K_TILES_PER_SLICE = 4  # a slice keeps the pipeline's stages full
MAX_SPLIT_K = 16
FALLBACK_SM_COUNT = 132  # an H100/H200 SXM, for configs chosen off a CUDA device (the interpreter)


def decode_split_k(pairs: int, num_experts: int, row_tiles: int, k_tiles: int, sm_count: int) -> int:
    """K slices that give a decode GEMM at least ``PROGRAMS_PER_SM`` programs per SM of the device
    (``sm_count``): the row blocks (the experts the pairs are expected to hit, one block each) times the weight-row
    tiles, split along K while each slice keeps ``MIN_K_TILES_PER_SLICE`` K tiles; one pass from that many on."""
    experts_hit = num_experts * (1.0 - (1.0 - 1.0 / max(num_experts, 1)) ** pairs)
    programs = max(experts_hit, 1.0) * row_tiles
    wanted = math.ceil(PROGRAMS_PER_SM * sm_count / programs)
    return max(1, min(wanted, k_tiles // MIN_K_TILES_PER_SLICE, MAX_SPLIT_K))


# The bf16 Hopper path (``prefill.py``) writes and reads the hit experts' 16-bit weights once a call, about the
# time of a bf16 GEMM over 100-200 rows an expert at the copy rate; at 2.0-2.3x the swap-AB kernel's TFLOP/s it
# pays from there on. Measured on an H200 (docs/perf/weight_quantized.md): faster than the swap-AB kernel at 256
# rows and more (1.44-1.94x), even at 128 (1.04x, Qwen3-30B-A3B at 2048 tokens), slower at 64 (0.39-0.76x). An
# H100 copies 30% slower against much the same matmul rate, so its break-even lies higher (not measured there):
# 256 keeps the measured losses out.
PREFILL_ROWS_PER_EXPERT = 256


# MXFP4's swap-AB tiles from 33 pairs an expert, each K tile's dots chained onto the running sums (``chain_acc``),
# measured on an H200 (docs/perf/weight_quantized.md, "The dequantization inside the GEMM at 512-8192 tokens"):
# 64 pairs by 128 weight rows with 8 warps 1.045x the 64 x 64 4-warp tile on gpt-oss-20b at 512 tokens and 1.08x
# on gpt-oss-120b at 2048 (INT4 g128, whose K tiles are scaled once and so not chained, 0.90x: the other formats
# keep the 4-warp tile); from 97 pairs 128 x 128 x 128 chained 1.15x the unchained 128 x 128 x 64 at 128 pairs an
# expert (gpt-oss-20b at 1024 tokens), 1.16x at 256 and 1.23x at 1024 (where the bf16 Hopper path runs instead).
# Not measured on an H100.
MXFP4_MID_TILE = WqConfig(64, 128, 64, 8, 3, chain_acc=True)
MXFP4_MANY_PAIR_TILE = WqConfig(128, 128, 128, 8, 3, group_m=8, chain_acc=True)
# The untuned tiles at 33-96 and from 97 pairs an expert, by format (``WeightQuant.kind``) where a format's own
# measurement moved them (above); the others take ``MID_TILE`` and ``MANY_PAIR_TILE``.
MID_TILE = WqConfig(64, 64, 128, 4, 3)
MANY_PAIR_TILE = WqConfig(128, 128, 64, 8, 3, group_m=8)
MID_TILE_BY_KIND: dict[str, WqConfig] = {"mxfp4": MXFP4_MID_TILE}
MANY_PAIR_TILE_BY_KIND: dict[str, WqConfig] = {"mxfp4": MXFP4_MANY_PAIR_TILE}
# Weight rows of the decode tile (up to 16 pairs an expert) by stored format (``WeightQuant``, matched whole), where
# the format's own measurement moved them from 64; the tile's K slices follow its rows (``decode_tile``). INT4 with
# zero points in groups of 128 (AWQ): 128 rows 1.08-1.27x the 64-row tile at 8, 32 and 64 tokens on the three shapes
# left out of the choice (Qwen3-30B-A3B, Mixtral-8x7B, Qwen3-235B-A22B TP4; 0.06-16 pairs an expert), 0.99-1.22x at
# one token, on an H200 (docs/perf/weight_quantized.md, "The zero-point decode tile"; compiled for sm_90 its w1 loop
# takes 6.60 thread-instructions a weight byte, not 9.61, and keeps the dequantized tile out of shared memory). Not
# taken where measured slower: zero points in groups of 32 (Kimi-K2-like EP8, 0.74-0.92x) and symmetric INT4 g32 /
# g128 (0.81-0.99x on the same shapes but one point, 1.06x).
# Other formats (g64, channel-wise, INT8 zero points, activation order) were not timed and keep 64.
DECODE_ROWS_BY_FORMAT: dict[WeightQuant, int] = {WeightQuant("int4", 128, zero_point=True): 128}
DECODE_ROWS_DEFAULT = 64  # every other format's decode tile rows


def decode_tile(num_tokens: int, top_k: int, num_experts: int, n: Optional[int], k: Optional[int],
                sm_count: int = FALLBACK_SM_COUNT, block_n: int = DECODE_ROWS_DEFAULT) -> WqConfig:
    """The decode tile (up to 16 pairs an expert): 16 pairs by ``block_n`` weight rows, split along K by
    ``decode_split_k`` for its own row tiles where the layer's shape (``n``, ``k``) is given."""
    # 3 stages: 1.01-1.08x faster than 4 at 1 and 8 tokens on an H200 (MXFP4 gpt-oss-120b 1.07-1.08x, INT4 g128
    # Mixtral and Qwen3-235B-A22B 1.01-1.03x; docs/perf/weight_quantized.md)
    tile = WqConfig(16, block_n, 128, 4, 3)
    if n is None or k is None:
        return tile
    pairs = num_tokens * top_k
    w1 = decode_split_k(pairs, num_experts, -(-n // tile.block_n), -(-k // tile.block_k), sm_count)
    w2 = decode_split_k(pairs, num_experts, -(-k // tile.block_n), -(-n // tile.block_k), sm_count)
    return replace(tile, split_k=w1, w2_split_k=w2)


def default_wq_config(num_tokens: int, top_k: int, num_experts: int, n: Optional[int] = None,
                      k: Optional[int] = None, sm_count: int = FALLBACK_SM_COUNT,
                      kind: Optional[str] = None, *, quant: Optional[WeightQuant] = None) -> WqConfig:
    """Untuned shapes: row blocks sized to the pairs an expert sees on average; small tiles for decode, split
    along K (``decode_split_k``) where the layer's shape (``n``, ``k``) gives too few programs for the SMs; from
    ``PREFILL_ROWS_PER_EXPERT`` pairs an expert (and 256 tokens) the bf16 Hopper path (``hopper_bf16``), its
    swap-AB tile kept for calls that cannot take it. ``kind`` (``WeightQuant.kind``) picks the format's own tiles
    from 33 pairs an expert where it has them (``MID_TILE_BY_KIND``, ``MANY_PAIR_TILE_BY_KIND``); ``quant``, the
    whole stored format, the decode tile's weight rows where it has its own (``DECODE_ROWS_BY_FORMAT``)."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    many_pair = MANY_PAIR_TILE_BY_KIND.get(kind, MANY_PAIR_TILE)
    if per_expert >= PREFILL_ROWS_PER_EXPERT and num_tokens >= 256:
        return replace(many_pair, hopper_bf16=True)
    if per_expert <= 16:
        rows = DECODE_ROWS_BY_FORMAT.get(quant, DECODE_ROWS_DEFAULT)
        return decode_tile(num_tokens, top_k, num_experts, n, k, sm_count, block_n=rows)
    if per_expert <= 32:
        return WqConfig(32, 64, 128, 4, 4)
    if per_expert <= 96:
        # 64 pairs by 64 weight rows, 4 warps: the fastest of the five mid-count candidates at 64 pairs an expert on
        # the H100 (gpt-oss-20b at 512 tokens 1.23x, gpt-oss-120b at 2048 1.22x the 64 x 128 8-warp tile it
        # replaces) and on an H200, gpt-oss-20b at 512 and gpt-oss-120b at 2048 (docs/perf/weight_quantized.md,
        # "MXFP4 dequantization in one multiply, the mid-count tile"); MXFP4 its chained tile (above)
        return MID_TILE_BY_KIND.get(kind, MID_TILE)
    return many_pair


def table_key(quant: WeightQuant, num_experts: int, n: int, k: int, top_k: int, scaled_dot: bool = False) -> str:
    key = f"{quant.kind},g={quant.group},zp={int(quant.zero_point)},E={num_experts},N={n},K={k},top_k={top_k}"
    return key + (",scaled_dot" if scaled_dot else "")


@functools.lru_cache(maxsize=None)
def _shipped_table(device: str) -> dict:
    name = "wq_" + device.replace(" ", "_") + ".json"
    try:
        text = resources.files("moe_fsm.kernels.triton_wq").joinpath("configs", name).read_text()
    except (FileNotFoundError, ModuleNotFoundError, OSError):
        return {}
    return json.loads(text)


def get_wq_config(device: str, quant: WeightQuant, num_experts: int, n: int, k: int, top_k: int,
                  num_tokens: int, scaled_dot: bool = False, sm_count: int = FALLBACK_SM_COUNT) -> WqConfig:
    """The tuned config of the nearest token count (log scale) for this shape and device, else the default.
    The user's table (``tables.py``: what ``moe-fsm tune`` wrote) over the shipped one, count by count."""
    key = table_key(quant, num_experts, n, k, top_k, scaled_dot)
    entries = {**_shipped_table(device).get(key, {}), **user_table(device).get(key, {})}
    if not entries:
        return default_wq_config(num_tokens, top_k, num_experts, n, k, sm_count, quant.kind, quant=quant)
    tuned = min(entries, key=lambda t: abs(math.log(int(t)) - math.log(max(num_tokens, 1))))
    return WqConfig.from_json(entries[tuned])


def _scale_acc(quant: WeightQuant, group: int, cols: int, block_k: int) -> bool:
    return quant.kind in ("int4", "int8") and (group == cols or group % block_k == 0)


def _check_tile(quant: WeightQuant, group: int, cols: int, block_k: int, split: bool) -> None:
    if quant.kind in ("int4", "int8") and not _scale_acc(quant, group, cols, block_k) and block_k % group:
        raise KernelInputError(f"block_k {block_k} must divide or be a multiple of the scale group {group}")
    if quant.kind in ("mxfp4", "nvfp4") and block_k < 2 * MX_GROUP:
        raise KernelInputError(f"{quant.kind.upper()} tiles need block_k >= {2 * MX_GROUP}; got {block_k}")
    if split and block_k % SPLIT_CHUNK:
        raise KernelInputError(f"the SPLIT layout needs block_k a multiple of {SPLIT_CHUNK}; got {block_k}")


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
    w1_perm: Optional[torch.Tensor] = None,
    w2_perm: Optional[torch.Tensor] = None,
    w1_global_scale: Optional[torch.Tensor] = None,
    w2_global_scale: Optional[torch.Tensor] = None,
    w1_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    activation: str = "silu",
    swiglu_limit: Optional[float] = None,
    interleaved: bool = False,
    split: bool = False,
    fast: bool = True,
    scaled_dot: bool = False,
    config: Optional[WqConfig] = None,
    block_m: Optional[int] = None,
) -> torch.Tensor:
    """``sum_j g[t,j] * (W2[e] act(W1[e] x[t] + b1[e]) + b2[e])`` -> [M, K] in ``hidden``'s dtype.

    ``w1`` [E, 2N, K/p] and ``w2`` [E, K, N/p] hold codes (p = 2 for 4-bit), rows of
    w1 stacked gate-then-up, or interleaved (gate 2n, up 2n+1) with ``interleaved``;
    with ``split`` both are in the layout of ``relayout_nibbles`` (rows padded to 64-column chunks).
    ``w1_perm`` [E, K] / ``w2_perm`` [E, N] (int32, activation order, from ``sort_act_order``): stored column j of
    expert e multiplies activation column perm[e, j]. NVFP4 weights come with their per-expert fp32 global
    scales ``w1_global_scale`` / ``w2_global_scale`` [E] (the dequantization multipliers). ``fast`` (default)
    dequantizes 4-bit codes with inline PTX where the activations are bf16. ``scaled_dot`` (MXFP4 in
    checkpoint nibble order, bf16 activations) hands the upcast and the E8M0 scales to Triton's ``tl.dot_scaled``.
    """
    require_device(hidden, w1, w2, topk_ids)
    if hidden.dim() != 2 or hidden.dtype not in COMPUTE_DTYPES or not hidden.is_contiguous():
        raise KernelInputError(f"hidden must be a contiguous bfloat16/float16 [M, K]; got {hidden.dtype} {list(hidden.shape)}")
    if activation not in ACTIVATIONS:
        raise KernelInputError(f"activation {activation!r} is not one of {list(ACTIVATIONS)}")
    num_tokens, k = hidden.shape
    if split and not can_split(quant):
        raise KernelInputError("the SPLIT nibble layout holds 4-bit weights; INT8 codes are read as stored")
    experts, two_n = w1.shape[0], w1.shape[1]
    n = two_n // 2
    g1 = _check_weight("w1", w1, w1_scale, w1_zero_point, quant, experts, 2 * n, k, split)
    g2 = _check_weight("w2", w2, w2_scale, w2_zero_point, quant, experts, k, n, split)
    if (w1_perm is not None, w2_perm is not None) != (quant.act_order, quant.act_order):
        raise KernelInputError("activation-ordered weights come sorted by group with both w1_perm and w2_perm "
                               "(sort_act_order); other weights with neither")
    for name, gs in (("w1_global_scale", w1_global_scale), ("w2_global_scale", w2_global_scale)):
        if (gs is not None) != (quant.kind == "nvfp4"):
            raise KernelInputError(f"{name} comes with NVFP4 weights (one fp32 per expert) and with no others")
        if gs is not None and (gs.dtype != torch.float32 or tuple(gs.shape) != (experts,) or not gs.is_contiguous()):
            raise KernelInputError(f"{name} must be a contiguous float32 [{experts}]; got {gs.dtype} {list(gs.shape)}")
    for name, perm, cols in (("w1_perm", w1_perm, k), ("w2_perm", w2_perm, n)):
        if perm is not None and (perm.dtype != torch.int32 or tuple(perm.shape) != (experts, cols) or not perm.is_contiguous()):
            raise KernelInputError(f"{name} must be a contiguous int32 [{experts}, {cols}]; got {perm.dtype} {list(perm.shape)}")
    _check_bias("w1_bias", w1_bias, experts, 2 * n)
    _check_bias("w2_bias", w2_bias, experts, k)
    if (w1_bias is None) != (w2_bias is None):
        raise KernelInputError("give both biases (w1_bias and w2_bias) or neither")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise KernelInputError(f"topk_ids and topk_weights must both be [M={num_tokens}, top_k]; got "
                               f"{list(topk_ids.shape)} and {list(topk_weights.shape)}")
    if scaled_dot and (quant.kind != "mxfp4" or split or hidden.dtype != torch.bfloat16):
        raise KernelInputError("scaled_dot runs MXFP4 weights in checkpoint nibble order (no SPLIT) with bfloat16 "
                               f"activations; got {quant.kind}, split={split}, {hidden.dtype}")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.empty_like(hidden)
    if num_pairs == 0:
        return out
    if config is None:
        from moe_fsm.kernels.triton_moe._runtime import device_name

        config = get_wq_config(device_name(hidden.device), quant, experts, n, k, top_k, num_tokens, scaled_dot,
                               _sm_count(hidden.device))
    if block_m is not None:
        config = replace(config, block_m=block_m)
    config.check()
    kern = _kernels()
    if config.hopper_bf16 and prefill.usable(hidden, n, k):
        return prefill.prefill_experts(
            kern, hidden, w1, w2, topk_weights, topk_ids, out, n=n, groups=(g1, g2), kind=KINDS[quant.kind],
            zero_code=8 if quant.kind == "int4" else 128, scales=(w1_scale, w2_scale),
            zero_points=(w1_zero_point, w2_zero_point) if quant.zero_point else (None, None),
            perms=(w1_perm, w2_perm), global_scales=(w1_global_scale, w2_global_scale), biases=(w1_bias, w2_bias),
            activation=activation, swiglu_limit=swiglu_limit, interleaved=interleaved, split=split,
        )
    from moe_fsm.kernels.triton_moe.align import align_tokens, pair_blocks
    from moe_fsm.kernels.triton_moe.fused import topk_sum

    if num_tokens == 1:  # one token's slots name distinct experts: no sorting, one row block per pair
        rows = pair_blocks(topk_ids, experts, config.block_m)
        sorted_ids = block_expert = rows.topk_ids
        num_padded = rows.topk_ids
    else:
        rows = align_tokens(topk_ids, experts, config.block_m)
        sorted_ids, block_expert, num_padded = rows.sorted_ids, rows.block_expert, rows.num_padded
    num_row_blocks = rows.num_row_blocks
    kind, zero = KINDS[quant.kind], (8 if quant.kind == "int4" else 128)
    has_zp, has_bias = quant.zero_point, w1_bias is not None
    fast = fast and hidden.dtype == torch.bfloat16 and quant.kind != "int8"
    # stands in for absent zero points / biases / global scales (never read: the constexpr flags are off)
    dummy = w1_scale.view(torch.uint8) if w1_scale.dtype == torch.float8_e4m3fn else w1_scale
    flat_weights = topk_weights.contiguous().reshape(-1)
    flat_ids = topk_ids.contiguous().reshape(-1)

    def launch(x, w, s, z, b, perm, gs, out_t, r_out, kred, group, which, gated):
        """One GEMM; with split-K, its fp32 partial sums go to a workspace, returned for the epilogue pass."""
        block_n, block_k, warps, stages = config.gemm(which)
        _check_tile(quant, group, kred, block_k, split)
        z = z if has_zp else dummy
        b = b if has_bias else dummy
        p = perm if perm is not None else sorted_ids
        s = s.view(torch.uint8) if s.dtype == torch.float8_e4m3fn else s  # NVFP4 scales: decoded in the kernel
        k_tiles = -(-kred // block_k)
        tiles_per_slice = -(-k_tiles // min(config.splits(which), k_tiles))
        slices = -(-k_tiles // tiles_per_slice)
        target = out_t
        if slices > 1:
            target = torch.empty((slices, num_pairs, 2 * r_out if gated else r_out), dtype=torch.float32,
                                 device=hidden.device)
        grid = (num_row_blocks * -(-r_out // block_n), slices)
        kern.wq_gemm_kernel[grid](
            x, w, s, z, b, flat_weights, target, sorted_ids, block_expert, num_padded, p, gs if gs is not None else dummy,
            r_out, kred, num_pairs, experts, num_row_blocks, top_k if gated else 1, float(swiglu_limit or 0.0),
            x.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), z.stride(0), z.stride(1), b.stride(0),
            target.stride(-2), p.stride(0) if perm is not None else 0, tiles_per_slice, target.stride(0),
            BLOCK_M=config.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=config.group_m,
            GROUP=group, KIND=kind, HAS_ZP=has_zp, ZERO=zero, HAS_BIAS=has_bias, GATED=gated,
            ACT=ACTIVATIONS[activation], HAS_LIMIT=swiglu_limit is not None, INTERLEAVED=interleaved and gated,
            ROUTER_WEIGHT=not gated, PAIR_BLOCKS=num_tokens == 1, SPLIT=split, FAST=fast,
            EVEN_K=kred % block_k == 0, SCALE_ACC=_scale_acc(quant, group, kred, block_k), SCALED_DOT=scaled_dot,
            HAS_PERM=perm is not None, SPLIT_K=slices > 1, CHAIN_ACC=config.chain_acc,
            num_warps=warps, num_stages=stages,
        )
        return target if slices > 1 else None

    intermediate = torch.empty((num_pairs, n), dtype=hidden.dtype, device=hidden.device)
    partial = launch(hidden, w1, w1_scale, w1_zero_point, w1_bias, w1_perm, w1_global_scale, intermediate, n, k, g1,
                     "w1", True)
    sm_count = _sm_count(hidden.device)
    if partial is not None:
        block, warps = _epilogue_block(n, num_pairs, sm_count)
        kern.wq_splitk_act_kernel[(num_pairs, -(-n // block))](
            partial, flat_ids, w1_global_scale if w1_global_scale is not None else dummy,
            w1_bias if has_bias else dummy, intermediate, n, experts, partial.shape[0], partial.stride(0),
            w1_bias.stride(0) if has_bias else 0, intermediate.stride(0), float(swiglu_limit or 0.0),
            BLOCK=block, KIND=kind, HAS_BIAS=has_bias, ACT=ACTIVATIONS[activation],
            HAS_LIMIT=swiglu_limit is not None, INTERLEAVED=interleaved, MAX_SPLITS=_pow2(partial.shape[0]),
            num_warps=warps,
        )
    per_pair = torch.empty((num_pairs, k), dtype=hidden.dtype, device=hidden.device)
    partial = launch(intermediate, w2, w2_scale, w2_zero_point, w2_bias, w2_perm, w2_global_scale, per_pair, k, n, g2,
                     "w2", False)
    if partial is None:
        return topk_sum(per_pair, topk_ids, experts, out)
    block, warps = _epilogue_block(k, num_tokens, sm_count)
    kern.wq_splitk_sum_kernel[(num_tokens, -(-k // block))](
        partial, flat_ids, flat_weights, w2_global_scale if w2_global_scale is not None else dummy,
        w2_bias if has_bias else dummy, out, k, experts, partial.shape[0], partial.stride(0),
        w2_bias.stride(0) if has_bias else 0, out.stride(0),
        TOP_K=top_k, BLOCK=block, KIND=kind, HAS_BIAS=has_bias, MAX_SPLITS=_pow2(partial.shape[0]), num_warps=warps,
    )
    return out


def _pow2(count: int) -> int:
    """The power of two at or above ``count`` (the split-K epilogues' unrolled slice count)."""
    return 1 << (count - 1).bit_length()


def _epilogue_block(cols: int, rows: int, sm_count: int) -> tuple[int, int]:
    """(columns per program, warps) of a split-K epilogue pass over ``rows`` rows of ``cols`` columns: the widest
    power of two of 64-1024 columns that still gives every SM a program (a decode token's w2 sum is one row: 1024
    columns a program left 3 programs for 132 SMs), and one warp per 64 columns (1-8): the unrolled loads of every
    slot and slice are in flight together, so a thread keeps few columns (sm_90: no spills up to 8 slots x 4 slices)."""
    block = min(1024, max(64, _pow2(cols)))
    while block > 64 and rows * -(-cols // block) < sm_count:
        block //= 2
    return block, max(1, min(8, block // 64))


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    """SMs of the device the layer runs on (split-K's rule); ``FALLBACK_SM_COUNT`` off CUDA (the interpreter)."""
    if device.type != "cuda":
        return FALLBACK_SM_COUNT
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())
