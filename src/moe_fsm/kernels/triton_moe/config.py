"""Kernel configs for the Triton fused-MoE GEMMs: tuned tables plus a default.

A config is the tile shape and launch shape of the two grouped GEMMs. The
alignment step pads every expert's rows to ``block_m``, so both GEMMs share
``block_m``; everything else (BLOCK_N, BLOCK_K, GROUP_M, warps, stages, swap-AB)
is chosen per GEMM, because the w1 GEMM (K -> 2N, fused activation) and the w2
GEMM (N -> K) have different shapes. ``fold_topk`` makes w2 add its rows into
the token's output (atomics) instead of writing one row per (token, slot).

Tables are JSON written by the tuner (``tuning.py``: ``moe-fsm tune``, ``bench/tune_triton.py``),
one file per device name, keyed by ``"E=..,N=..,K=..,dtype=.."`` and then by the
token count they were tuned at. Two places hold them, read in this order:

1. the user's config directory (``$MOE_FSM_TRITON_CONFIG_DIR``, else
   ``$XDG_CACHE_HOME/moe_fsm/triton_moe`` or ``~/.cache/moe_fsm/triton_moe``):
   what ``moe-fsm tune`` wrote on this machine, like vLLM's tuned-config folder;
2. the tables shipped in the package (``configs/``).

A shape found in the user's table is served from it alone. A lookup takes the
tuned token count nearest to the actual one on a log scale (a 600-token batch
uses the 512 entry), because the best tile mostly depends on the rows per
expert, which scales with tokens. Shapes in no table get ``default_config``,
a rule fitted on a sweep of untuned shapes against vLLM's kernel (its docstring).

This module imports neither Triton nor CUDA so the tables can be read, written
and checked anywhere.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Optional

from moe_fsm.errors import InputError, KernelInputError
from moe_fsm.trace.document import parse_json, read_text, write_atomic

FP8_GROUP = 128  # DeepSeek-V3 block size: 128x128 weight blocks, 1x128 activation groups
HOPPER_SMEM_BYTES = 232448  # the shared memory one sm_90 program may opt into


def weight_scale_span(block_n: int, n: int, gated: bool) -> int:
    """How many 128-row weight-scale groups (block FP8) one output tile's columns can touch, per half of a w1
    tile: one tile aligned to the groups touches ``ceil(block_n / 128)``; the up half of a w1 tile starts at row
    ``n + n0``, off the group grid when ``n`` is not a multiple of 128, and can touch one more. The kernels load
    that many scalars per K step (``_group_scales``), and with one group a row scale times a scalar replaces the
    per-element product of two scale vectors."""
    aligned = not gated or n % FP8_GROUP == 0
    return (block_n - 1) // FP8_GROUP + (1 if aligned else 2)


@dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of one grouped GEMM (``block_n`` is the output tile width).

    The Hopper kernels (``MoEConfig.hopper``) take four more: ``persistent`` (one program per SM walking
    the tiles), ``flatten`` (with ``persistent``: the tile loop and the K loop fused into one software-pipelined
    loop, so a tile's first loads overlap the last one's epilogue; it also multi-buffers more, which some
    tiles cannot afford in shared memory), ``warp_specialize`` (Triton's producer/consumer warps on the K loop:
    with ``num_warps=4``, which Triton 3.6 runs as 12 warps, and for w1 only with ``MoEConfig.gather_input``)
    and, for w1 only, ``paired`` (gate and up tiles fetched as one box and multiplied as one wgmma twice as wide).
    """

    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    persistent: bool = False
    warp_specialize: bool = False
    paired: bool = False
    flatten: bool = False

    def to_json(self) -> dict:
        data = asdict(self)
        # the Hopper-only fields stay out of a table until set, so older tables read back unchanged
        for name in ("persistent", "warp_specialize", "paired", "flatten"):
            if not data[name]:
                del data[name]
        return data


@dataclass(frozen=True)
class MoEConfig:
    """Both GEMMs' configs and the row block they share.

    ``hopper`` runs both GEMMs through the tensor-descriptor kernels (``hopper.py``) where the call allows,
    with the intermediate in sorted-row order; ``gather_input`` then also copies the w1 GEMM's input rows
    into sorted order first, so the copy engine loads them as well. ``gluon`` (with both, block FP8 only)
    runs the two GEMMs through the Gluon kernel that scales each K step's product while the next one runs
    (``_gluon_kernels.py``): its w1 tile is ``w1.block_n`` gate plus as many up columns, its w2 tile
    ``w2.block_n`` columns, each in ``block_m / 16`` warps, or with ``block_m / 8`` warps in two warpgroups side
    by side, each over half the tile's columns (``gluon_pair_config``). There ``warp_specialize`` adds a producer warp
    that issues the copy-engine loads (Gluon's explicit partitions, not Triton 3.6's automatic ones, which
    ``validate_config`` refuses), and ``persistent`` (with it) runs one program per SM over many tiles.
    """

    block_m: int
    w1: GemmConfig
    w2: GemmConfig
    fold_topk: bool = False
    hopper: bool = False
    gather_input: bool = False
    gluon: bool = False

    def to_json(self) -> dict:
        data = {"block_m": self.block_m, "w1": self.w1.to_json(), "w2": self.w2.to_json(), "fold_topk": self.fold_topk}
        # the Hopper-only fields stay out of a table until set, so older tables read back unchanged
        for name in ("hopper", "gather_input", "gluon"):
            if getattr(self, name):
                data[name] = True
        return data

    @classmethod
    def from_json(cls, data: dict) -> "MoEConfig":
        try:
            return cls(
                int(data["block_m"]), GemmConfig(**data["w1"]), GemmConfig(**data["w2"]), bool(data.get("fold_topk", False)),
                bool(data.get("hopper", False)), bool(data.get("gather_input", False)), bool(data.get("gluon", False)),
            )
        except (KeyError, TypeError) as exc:
            raise KernelInputError(
                f"a Triton MoE config needs block_m plus w1/w2 objects with block_n, block_k, "
                f"group_m, num_warps, num_stages (optional swap_ab, persistent, warp_specialize, paired, flatten), optional fold_topk "
                f"hopper, gather_input and gluon; got {data!r} ({exc})"
            ) from None


# The w2 GEMM with the top-k sum inside (``fused.w2_token_sum``) has one program per (token, output tile) where the
# GEMM that leaves the sum to its own launch has one per (pair, tile): top_k times fewer at the same tile. Measured on
# one H200 (docs/perf/decode.md, "The top-k sum inside w2"; check shapes at 1-8 tokens, beside the two-launch sum):
# it was faster only where its grid had at least TOKEN_SUM_MIN_PROGRAMS programs at a tile of at least
# TOKEN_SUM_MIN_BLOCK_N columns (DeepSeek-V3 TP4 block FP8 at 4 tokens by 5%, Qwen3-Next TP2 at 8 tokens by 8%), and
# slower at every point that needed a narrower tile to fill its grid (16-32 columns: 1.1-2.3 times the time, every
# point at one token among them). Its loop reads a slot's expert id before that slot's tiles, and Triton's pipeliner
# spends stages on that chain (compiled for sm_90: num_stages 4 left one tile buffer at 16 columns, 9 left four), so
# the kernel asks TOKEN_SUM_STAGES.
TOKEN_SUM_MIN_PROGRAMS = 256
TOKEN_SUM_MIN_BLOCK_N = 64
TOKEN_SUM_STAGES = 8


def token_sum_config(w2: GemmConfig, num_tokens: int, n_out: int) -> GemmConfig:
    """The tile of the w2 GEMM that sums each token's slots itself: ``w2``'s, swap-AB, ``block_n`` halved while it
    is wider than ``TOKEN_SUM_MIN_BLOCK_N`` and the grid (tokens x output tiles of ``n_out`` columns) has fewer than
    ``TOKEN_SUM_MIN_PROGRAMS`` programs, and ``TOKEN_SUM_STAGES`` pipeline stages."""
    block_n = w2.block_n
    while block_n > TOKEN_SUM_MIN_BLOCK_N and num_tokens * -(-n_out // block_n) < TOKEN_SUM_MIN_PROGRAMS:
        block_n //= 2
    return replace(w2, block_n=block_n, group_m=1, swap_ab=True, num_stages=TOKEN_SUM_STAGES)


def sums_slots_in_w2(unsorted: bool, config: "MoEConfig", num_tokens: int, n_out: int) -> bool:
    """Whether the pointer path's w2 GEMM sums each token's slots itself (``fused.w2_token_sum``), saving the top-k
    sum's launch: where every pair has a row block of its own (``unsorted``, ``align.pair_blocks``: w2 reads each
    pair's expert slice alone whichever program sums), with the decode (swap-AB) w2 tile, no atomic fold, and a grid
    of at least ``TOKEN_SUM_MIN_PROGRAMS`` programs at a tile of at least ``TOKEN_SUM_MIN_BLOCK_N`` columns
    (``token_sum_config``; the measurement above it). One token does only past a hidden size of 16384 (256 tiles of
    64 columns): one program per output tile is too few to stream its weights."""
    if not (unsorted and config.w2.swap_ab and not config.fold_topk):
        return False
    tile = token_sum_config(config.w2, num_tokens, n_out).block_n
    return tile >= TOKEN_SUM_MIN_BLOCK_N and num_tokens * -(-n_out // tile) >= TOKEN_SUM_MIN_PROGRAMS


def dtype_key(compute_dtype: str, fp8: Optional[str]) -> str:
    """The table's dtype field: ``bf16``/``fp16`` for unquantized, ``fp8_<weight granularity>`` for w8a8."""
    if fp8 is None:
        return {"bfloat16": "bf16", "float16": "fp16"}.get(compute_dtype, compute_dtype)
    return f"fp8_{fp8}"


def shape_key(num_experts: int, n: int, k: int, dtype: str) -> str:
    return f"E={num_experts},N={n},K={k},dtype={dtype}"


def validate_config(config: MoEConfig, *, block_fp8: bool) -> None:
    """Reject configs the kernels cannot run, naming the field and what is accepted."""

    def pow2(x: int) -> bool:
        return x >= 1 and (x & (x - 1)) == 0

    if not pow2(config.block_m) or config.block_m < 16:
        raise KernelInputError(f"block_m={config.block_m}: accepted are powers of two >= 16")
    for name, g in (("w1", config.w1), ("w2", config.w2)):
        for field_name in ("block_n", "block_k"):
            value = getattr(g, field_name)
            if not pow2(value) or value < 16:
                raise KernelInputError(f"{name}.{field_name}={value}: accepted are powers of two >= 16")
        if g.group_m < 1 or g.num_warps not in (1, 2, 4, 8, 16) or g.num_stages < 1:
            raise KernelInputError(
                f"{name}: group_m >= 1, num_warps in 1/2/4/8/16 and num_stages >= 1 are accepted; got {g}"
            )
        if block_fp8 and FP8_GROUP % g.block_k:
            raise KernelInputError(
                f"{name}.block_k={g.block_k}: block FP8 needs block_k dividing {FP8_GROUP} "
                "(one weight-scale block per K step)"
            )
        if (g.persistent or g.warp_specialize or g.paired or g.flatten) and not config.hopper:
            raise KernelInputError(
                f"{name}: persistent, flatten, warp_specialize and paired are Hopper-kernel options; set hopper too"
            )
        if g.flatten and not g.persistent:
            raise KernelInputError(f"{name}.flatten fuses the persistent tile loop with the K loop; set persistent too")
    if config.w2.flatten and config.fold_topk:
        raise KernelInputError(
            "w2.flatten with fold_topk: the flattened loop with the atomic top-k epilogue needs more shared memory than "
            "Hopper has (278,552 bytes compiled for sm_90 at the smallest bf16 tile tried, against 232,448); fold the "
            "top-k sum or flatten w2, not both"
        )
    if config.w2.paired:
        raise KernelInputError("w2.paired: only the w1 GEMM has gate and up tiles to load as a pair")
    if config.gather_input and not config.hopper:
        raise KernelInputError("gather_input is a Hopper-kernel option; set hopper too")
    if config.gluon:
        _check_gluon(config, block_fp8)
    else:
        _check_warp_specialization(config, block_fp8)
    if (config.w1.warp_specialize or config.w2.warp_specialize) and not config.gluon and not warp_specialization_opted_in():
        raise KernelInputError(
            "warp_specialize: Triton 3.6's warp-specialized K loop computed wrong layers on an H100 (2026-11-25, "
            "tests/gpu/test_triton_hopper.py: NaN rows in bf16 at block_m 64 with gather_input, 3.7e-2 off the "
            "float64 emulation in block FP8; one bf16 block_m 128 case was right), so it is refused; "
            f"{WARP_SPECIALIZE_ENV}=1 lets a kernel developer run it anyway (docs/perf/hopper.md)"
        )
    if config.hopper:
        # wgmma takes 64-row tiles per warpgroup; the copy engine takes boxes of at most 256 per dimension
        tiles = (config.block_m, config.w1.block_n, config.w1.block_k, config.w2.block_n, config.w2.block_k)
        if config.block_m < 64 or max(tiles) > 256 or config.w1.swap_ab or config.w2.swap_ab:
            raise KernelInputError(
                f"hopper configs need block_m >= 64, tiles of at most 256 and no swap_ab; got block_m={config.block_m}, "
                f"w1={config.w1}, w2={config.w2}"
            )


def _check_gluon(config: MoEConfig, block_fp8: bool) -> None:
    """Refuse what the Gluon block-FP8 kernel (``_gluon_kernels.py``) does not do, naming what it takes."""
    if not block_fp8:
        raise KernelInputError("gluon: the Gluon kernel runs block-FP8 layers only; leave gluon off for this dtype")
    if not (config.hopper and config.gather_input) or config.fold_topk:
        raise KernelInputError("gluon needs hopper and gather_input (every operand through the copy engine) and "
                               "no fold_topk (its w2 writes one row per pair)")
    # wider tiles (a 256-wide wgmma) need more than 255 registers for the sum and the two product sets: they spill,
    # and ptxas then serializes every wgmma (tools/sm90_compile_hopper_moe.py --only gluon --force)
    # widths are a warpgroup's: with block_m = 8 x num_warps two warpgroups split the tile's columns (each its own
    # weight boxes over the block's one A tile), so the tile is twice as wide
    for name, g, widths in (("w1", config.w1, (32, 64)), ("w2", config.w2, (64, 128))):
        split = 16 * g.num_warps // config.block_m if 16 * g.num_warps % config.block_m == 0 else 0
        if g.block_k != FP8_GROUP or split not in (1, 2) or g.block_n // max(split, 1) not in widths:
            raise KernelInputError(
                f"gluon {name}: block_k {FP8_GROUP} (one scale group a K step), block_m = 16 x num_warps (one 64-row "
                f"wgmma per warpgroup) with block_n in {widths}, or block_m = 8 x num_warps (two warpgroups side by "
                f"side) with block_n in {tuple(2 * w for w in widths)}, are accepted; got block_m={config.block_m}, {g}"
            )
        if g.flatten or g.paired or g.swap_ab:
            raise KernelInputError(f"gluon {name}: flatten, paired and swap_ab are options of the Triton kernels, not "
                                   f"of the Gluon one; got {g}")
        # shared memory: the ring of (A tile, two weight boxes) FP8 stages and the bf16 output tile the epilogue
        # stages (w1: its activation, half the wgmma's width)
        weight_rows = 2 * g.block_n if name == "w1" else g.block_n  # w1: gate and up rows
        smem = g.num_stages * (config.block_m + weight_rows) * FP8_GROUP + config.block_m * g.block_n * 2
        if smem > HOPPER_SMEM_BYTES:
            raise KernelInputError(
                f"gluon {name}: {g.num_stages} stages of block_m {config.block_m} x block_n {g.block_n} tiles need "
                f"{smem:,} bytes of shared memory, past the {HOPPER_SMEM_BYTES:,} an sm_90 program may have; take "
                "fewer stages"
            )
        if g.persistent and not g.warp_specialize:
            raise KernelInputError(f"gluon {name}: persistent needs warp_specialize too (the producer warp runs ahead "
                                   f"across the program's tiles); got {g}")


WARP_SPECIALIZE_ENV = "MOE_FSM_TRITON_WARP_SPECIALIZE"

# Block-FP8 layers with N >= 2048 past 512 tokens take ``gluon_pair_config`` from this many expected rows per expert:
# the seventh sweep (H200, docs/perf/default_rules_h200_7.json) ran it faster at 64-410 rows (DeepSeek-V3 at 2048
# tokens 3422 -> 3088 µs, Qwen3-Coder-480B-like at 2048 and 8192 tokens 9% and 5%, Kimi-K2-like at 8192 8726 -> 7588,
# DeepSeek-V3 at 8192 2%) and 1.5% slower at 43 (Kimi-K2-like at 2048 tokens, which keeps ``gluon_mid_config``)
GLUON_PAIR_MIN_ROWS = 48
# ... and up to this many: past it no card ran the pair faster. The eighth sweep (one H100,
# docs/perf/default_rules_h100_8.json, docs/perf/vs_vllm.md, "The eighth sweep") ran it 6% slower at 1024 rows per
# expert (ERNIE-4.5-300B-like at 8192 tokens, 13966 against 13087 µs on the 128-row Gluon blocks, which are
# one-sixteenth pads there), faster at 102 and 410 rows, level at 64, slower at 171 (Kimi-K2-like at 8192, 4%); the
# H200 was measured up to 410 rows (all faster). So past 512 rows every card keeps the 128-row Gluon blocks
# (``gluon_prefill_config``), where they were measured.
GLUON_PAIR_MAX_ROWS = 512


def warp_specialization_opted_in() -> bool:
    """Whether a kernel developer asked to run warp-specialized GEMMs despite their measured wrong results."""
    return os.environ.get(WARP_SPECIALIZE_ENV, "") not in ("", "0")


def _check_warp_specialization(config: MoEConfig, block_fp8: bool) -> None:
    """Refuse the warp-specialized GEMMs Triton 3.6 cannot build (``tools/sm90_compile_hopper_moe.py`` maps them).

    Triton's Hopper pass (NVGPUWarpSpecialization) turns a 4-warp K loop into 12 warps: a producer warpgroup
    issuing the loop's copy-engine loads and two consumer warpgroups, between which it splits the tile (its
    rows from block_m 128 on, else its columns) and everything the tile feeds after the loop. What it cannot
    split or feed aborts the compile; one combination compiles without wgmma.
    """

    def refuse(what: str, why: str, fix: str = "leave warp_specialize off there") -> None:
        raise KernelInputError(f"{what}: {why}; {fix}")

    for name, g in (("w1", config.w1), ("w2", config.w2)):
        if not g.warp_specialize:
            continue
        if g.num_warps != 4:
            refuse(f"{name}.warp_specialize with num_warps={g.num_warps}",
                   "Triton's Hopper warp specialization takes num_warps=4 (it adds the producer and second consumer "
                   "warpgroups itself: 12 warps run) and silently ignores the request at other widths")
        if config.block_m == 64 and g.block_n == 256:
            refuse(f"{name}.warp_specialize with block_m=64 and block_n=256",
                   "the two consumer warpgroups' 64x128 halves fail wgmma lowering (Instruction shape is too large)")
    if config.w1.warp_specialize:
        if not config.gather_input:
            refuse("w1.warp_specialize without gather_input",
                   "the producer warpgroup takes only tensor-descriptor loads, and the w1 GEMM's gathered input rows "
                   "are pointer loads (cp.async) unless gather_input copies them into sorted order first (the "
                   "compiler aborts in WSLowerToken)", "set gather_input too, or leave warp_specialize off")
        if config.w1.paired:
            refuse("w1.warp_specialize with w1.paired",
                   "the split of the paired gate/up tile (reshape, permute, split) cannot be partitioned between "
                   "the consumer warpgroups")
        if block_fp8 and config.w1.block_n % FP8_GROUP == 0 and config.block_m > 64:
            refuse(f"w1.warp_specialize with block FP8, block_m={config.block_m}, w1.block_n={config.w1.block_n}",
                   "the epilogue's 1x128 group quantization (a reshape and a reduction) cannot be split by rows "
                   "between the consumer warpgroups")
    if config.w2.warp_specialize and config.fold_topk:
        refuse("w2.warp_specialize with fold_topk",
               "the atomic adds of the folded top-k sum cannot be partitioned (block_m >= 128 aborts the compile; "
               "block_m 64 compiles without wgmma)")


# Where a card's own sweep moved the fitted rule, by the device name ``torch.cuda.get_device_name()`` gives (data, not
# a branch per card; cards not named keep the fitted rule): the most rows per expert at which a bf16 layer past 512
# tokens runs vLLM's own default tile (``vllm_default_tile_config``) where the fitted rule runs the 128-row
# pointer-load tile or the flattened persistent TMA tiles. The H100 sweep (``docs/perf/default_rules_h100_6.json``,
# ``docs/perf/vs_vllm.md``, "The H100") ran it faster at all 4 such points of the fit shapes (64-128 rows;
# E512 N768 at 8192 tokens x0.83 -> x1.04 against vLLM, DeepSeek-V2-like at 2048 x0.95 -> x1.02) and of the held-out
# and check ones (GLM-4.5-Air-like x0.91 -> x1.04, GPT-OSS-120B-shaped x0.95 -> x1.02, its TP2 shard x0.95 -> x1.03);
# at 136-192 rows it tied or lost (DeepSeek-V2-Lite-like at 192 x1.16 -> x1.09), and so did the unflattened TMA tiles
# of wide layers at 128 rows (Llama-4-Scout-like x1.13 -> x1.02). On an H200 the same tile lost at 11 of 14 bf16 points
# at 2048 tokens, both at 128 rows and 2 of 4 at 64-77 among them (``docs/perf/default_rules_h200_5.json``), so the
# H200 keeps the fitted rule.
VLLM_TILE_MAX_ROWS_BY_DEVICE: dict[str, int] = {"NVIDIA H100 80GB HBM3": 128}

# The same sweep's 128-token candidates, on the cards named: block-FP8 layers at 97-512 tokens with 8-16 rows per
# expert, where the fitted rule runs 16-row swap-AB blocks, take 32-row ones (``block_fp8_row_block32_config``):
# faster at all 3 such points (ERNIE-4.5-300B-like at 128 tokens 2078 -> 1966 µs, x0.98 -> x1.03 against vLLM;
# DeepSeek-V3-shaped at 512 4200 -> 3926, x0.97 -> x1.04; Kimi-K2-like at 512 3%), where vLLM's own 64-row tile
# gained 1-5%. Not measured on an H200.
BLOCK_FP8_ROW_BLOCK32_DEVICES: frozenset[str] = frozenset({"NVIDIA H100 80GB HBM3"})

# bf16 layers at 97-512 tokens with 8 rows per expert or fewer whose thin blocks keep 64-wide weight tiles
# (``wide_thin_tiles_pay`` false: N > 768) take vLLM's tuned H100 tile for E=128 N=2880 at 128 tokens
# (``thin_deep_k_config``) on the cards named: the same sweep ran it faster on GPT-OSS-120B-shaped (2095 -> 2054 µs,
# x0.99 -> x1.01) and its TP2 shard (2%), level on GLM-4.5-Air-like (0.1%). Not measured on an H200.
THIN_DEEP_K_DEVICES: frozenset[str] = frozenset({"NVIDIA H100 80GB HBM3"})


def default_config(num_experts: int, n: int, k: int, top_k: int, num_tokens: int, *, block_fp8: bool, fp8: bool = False,
                   device: str = "") -> MoEConfig:
    """The config for a shape no table holds, from the token count and the expected rows per expert.

    The rule was fitted on a sweep (``bench/sweep_default_rules.py``, ``docs/perf/vs_vllm.md``, "Shapes no table
    holds") of 16 layer shapes against vLLM 0.33's kernel and checked on 13 others, then refined by a second sweep of
    candidates on those 29 (1, 8, 2048 and 8192 tokens) and checked on shapes neither sweep looked at (``CHECK``); a
    third and a fourth sweep (vLLM's tuned tiles, the 8192-token misses) changed the regimes their notes below name.
    Decode calls (64 tokens or fewer) take vLLM's tiles (``vllm_tile_config``), six stages deep for a single token of a
    row-wise FP8 layer (1-12% faster on 5 of 6 such shapes, 3% slower on one; deeper pipelines lost on bf16 and block
    FP8 and at 8 tokens, and w1 tiles 16 wide, for more programs, lost everywhere:
    ``docs/perf/default_rules_h200_2_decode.json``). Past that the expected rows per expert, ``tokens x top-k / E``,
    decides, because a row block is padded to ``block_m`` per expert: a many-expert layer at 128-512 tokens fills a
    64-row block a tenth, and thin 16-row blocks with swap-AB ran it faster; a layer whose experts get 96 rows or more
    runs the Hopper paths the tuner picks for the named shapes (the TMA kernels, the Gluon kernel for block FP8). Thin
    16-row blocks of narrow bf16 layers (N <= 768) past one token, and of row-wise FP8 layers past 64 tokens, take
    128-wide weight tiles in 8 warps (``wide_thin_tiles_pay``; the third sweep, ``docs/perf/default_rules_h200_3.json``,
    which found 32-row blocks at 8-32 rows per expert and 64-row TMA tiles at 48-96 rows past 512 tokens slower).
    What the first two sweeps found per regime:

    - block FP8: 16 rows or fewer, thin blocks (x1.14-1.40 against vLLM at 128 tokens, where 64-row blocks gave
      x0.90-1.17); 40-96 rows, 64-row TMA tiles; 96 rows and more, the Gluon kernel (x1.27-1.57 at 8192 tokens
      where the pointer-load tiles gave x1.13-1.29); past 512 tokens, on layers with N >= 2048, 40-256 rows take
      the Gluon kernel on 64-row blocks (``gluon_mid_config``): a 128-row block of an expert with 170 rows is a
      third pads (Kimi-K2-like at 8192 tokens x1.25 -> x1.36, at 2048 x1.08 -> x1.12, DeepSeek-V3 at 2048 x1.09 ->
      x1.18), while narrower layers (N 256-1536) lost 4-16% with it (not profiled; their w2 runs only 2-12 K
      steps a tile); from ``GLUON_PAIR_MIN_ROWS`` to ``GLUON_PAIR_MAX_ROWS`` rows (the seventh and eighth sweeps)
      those layers take 64-row blocks in two warpgroups side by side (``gluon_pair_config``), also from 256 rows
      on, where 128-row Gluon blocks ran, where N is a multiple of that config's 128-wide w1 tile;
    - bf16 and row-wise FP8: 8 rows or fewer, thin blocks (swept up to 512 tokens; past it, where a 128-row block
      would be 94% pads, they are kept by reasoning, not measured); 96 rows and more up to 512 tokens, 64-row
      TMA tiles (Mixtral-like layers at 512 tokens: x0.71 -> x0.97-1.32); past 512 tokens the 128-row TMA tiles,
      persistent with gate and up paired, the loop flattened where N <= 1536 (flattening won there, lost on the wide
      layers); row-wise FP8 keeps the pointer-load 128-row tile below 4096 tokens, where it beat the TMA one
      (x1.33-1.54 against x1.12-1.31 at 2048); past 512 tokens, 8-48 rows take 64-row pointer-load blocks
      (``pointer_mid_config``, vLLM's tuned H200 tile for E=512 N=512: Qwen3-Next-like at 2048 tokens x0.98 ->
      x1.04, E512 N768 x1.08 -> x1.13, Llama-4-Maverick-like FP8 per-channel x1.32 -> x1.46) where the 128-row
      blocks were 60-90% pads; at 64-77 rows they lost (x1.02 -> x0.81), so 48 rows and more keep 128.
    - bf16 at 97-512 tokens with fewer than 32 rows per expert (more than 8): 32-row blocks without swap-AB
      (``row_block32_config``, the fourth sweep), where vLLM's rule pads them to 64.

    A ``hopper`` config runs the pointer-load kernels with the same tiles where the TMA kernels cannot
    (``hopper.hopper_usable``); a ``gluon`` one the Triton kernels (``fused.py``). The top-k sum is never folded into
    w2: folded, the layer was slower in 26 of 28 comparisons (``docs/perf/hopper.md``, "The default config").

    ``device`` (the card's name) applies that card's measured exceptions (``VLLM_TILE_MAX_ROWS_BY_DEVICE``,
    ``BLOCK_FP8_ROW_BLOCK32_DEVICES``, ``THIN_DEEP_K_DEVICES``); without it, or for a card not named there, the
    fitted rule decides alone.
    """
    fitted = _fitted_default(num_experts, n, top_k, num_tokens, block_fp8=block_fp8, fp8=fp8)
    rows = num_tokens * top_k / max(num_experts, 1)
    if block_fp8:
        if (device in BLOCK_FP8_ROW_BLOCK32_DEVICES and 96 < num_tokens <= 512 and 8 < rows <= 16
                and fitted.block_m == 16):
            return block_fp8_row_block32_config()
        return fitted
    if (device in THIN_DEEP_K_DEVICES and not fp8 and 96 < num_tokens <= 512 and rows <= 8 and fitted.block_m == 16
            and not wide_thin_tiles_pay(n, num_tokens, fp8=False)):
        return thin_deep_k_config()
    max_rows = VLLM_TILE_MAX_ROWS_BY_DEVICE.get(device)
    if (max_rows is not None and not fp8 and num_tokens > 512 and rows <= max_rows and fitted.block_m == 128
            and not fitted.gluon and (not fitted.hopper or fitted.w1.flatten)):
        return vllm_default_tile_config()
    return fitted


def _fitted_default(num_experts: int, n: int, top_k: int, num_tokens: int, *, block_fp8: bool, fp8: bool) -> MoEConfig:
    """``default_config``'s rule as fitted on the sweeps, before any card's exceptions."""
    m = num_tokens
    rows = m * top_k / max(num_experts, 1)
    if m <= 64:
        tiles = vllm_tile_config(num_experts, m, block_fp8=block_fp8, fp8=fp8)
        if m == 1 and fp8 and not block_fp8:
            return MoEConfig(tiles.block_m, replace(tiles.w1, num_stages=6), replace(tiles.w2, num_stages=6))
        if tiles.block_m == 16 and not block_fp8 and wide_thin_tiles_pay(n, m, fp8=fp8):
            return thin_wide_config(fp8=fp8)
        return tiles
    if block_fp8:
        pair = gluon_pair_config()
        # the Gluon kernel takes an intermediate width on its w1 tile grid only (hopper.gluon_usable)
        if m > 512 and n >= 2048 and GLUON_PAIR_MIN_ROWS <= rows <= GLUON_PAIR_MAX_ROWS and n % pair.w1.block_n == 0:
            return pair
        if m > 512 and n >= 2048 and 40 <= rows < 256:
            return gluon_mid_config()
        if rows >= 96:
            return gluon_prefill_config()
        if rows >= 40:
            return tma_mid_config(FP8_GROUP)
        return vllm_tile_config(num_experts, 32 if rows <= 16 else m, block_fp8=True, fp8=True)
    block_k = 128 if fp8 else 64
    if rows >= 96:
        if m <= 512:
            return tma_mid_config(block_k)
        if fp8 and m < 4096:
            return vllm_tile_config(num_experts, m, block_fp8=False, fp8=True)
        return tma_prefill_config(block_k, flatten=n <= 1536)
    if rows <= 8:
        if wide_thin_tiles_pay(n, m, fp8=fp8):
            return thin_wide_config(fp8=fp8)
        return vllm_tile_config(num_experts, 32, block_fp8=False, fp8=fp8)
    if m > 512 and rows < 48:
        return pointer_mid_config(block_k)
    if not fp8 and 96 < m <= 512 and rows < 32:
        return row_block32_config()
    return vllm_tile_config(num_experts, m, block_fp8=False, fp8=fp8)


def vllm_default_tile_config() -> MoEConfig:
    """vLLM 0.33's ``get_default_config`` tile past 512 tokens as vLLM runs it, on the pointer-load kernels: 128-row
    blocks, 128-wide weight tiles (w1 64 gate + 64 up columns, w2 128), 64-wide K steps, 8 warps, 3 stages, no
    grouping (vLLM groups only past 128 tokens per expert, more rows than ``VLLM_TILE_MAX_ROWS_BY_DEVICE`` admits).
    Its three stages of 128 x 64 and 64 x 128 bf16 tiles take 96 KiB of shared memory, room for two programs on an
    SM, where the fitted 128-row tiles' four stages (w2 256 wide) take 192 KiB; on an H100 it ran bf16 layers at
    48-128 rows per expert faster than those (``VLLM_TILE_MAX_ROWS_BY_DEVICE``), why was not profiled."""
    return MoEConfig(128, GemmConfig(64, 64, 1, 8, 3), GemmConfig(128, 64, 1, 8, 3))


def row_block32_config() -> MoEConfig:
    """32-row blocks on the pointer-load kernels, w1 64 (128 gate and up columns) / w2 128 wide, 128-wide K steps,
    4 warps, 3 stages, no swap-AB: vLLM's tuned H200 tile for E=64 N=2560 at 128 tokens, for bf16 layers at 97-512
    tokens whose experts get more than 8 and fewer than 32 rows, which vLLM's rule pads to 64-row blocks. The fourth
    sweep (H100, ``docs/perf/default_rules_h100_4.json``) ran it 2-5% faster than the 64-row tile at all 10 such
    points (4 fit, 3 held-out, 3 check shapes; Qwen2-57B-A14B-like at 128 tokens 1244 -> 1194 µs against vLLM's 1257);
    at 32 rows per expert it lost on Mixtral-like layers (15-22% slower) and GLM-4.5-Air-like (1%), and on row-wise
    FP8 layers at 12-16 rows (1%), so those keep vLLM's tile. The H200 check run after it (``docs/perf/vs_vllm.md``)
    put the four check points it changed between 5% slower and 1% faster than the run before, within that page's
    run-to-run spread."""
    return MoEConfig(32, GemmConfig(64, 128, 1, 4, 3), GemmConfig(128, 128, 1, 4, 3))


def block_fp8_row_block32_config() -> MoEConfig:
    """32-row swap-AB blocks for block FP8, w1 64 (128 gate and up columns) / w2 128 wide, 128-wide K steps (one
    scale group), 4 warps, 3 stages: the fitted thin blocks' tiles on blocks twice as tall, so an expert of 8-16
    rows (up to ~25 under a random routing) fills one block where 16-row blocks take two, the second mostly pads
    (``BLOCK_FP8_ROW_BLOCK32_DEVICES`` says where)."""
    return MoEConfig(32, GemmConfig(64, FP8_GROUP, 1, 4, 3, True), GemmConfig(128, FP8_GROUP, 1, 4, 3, True))


def thin_deep_k_config() -> MoEConfig:
    """16-row swap-AB blocks with vLLM's 64-wide weight tiles (w1 32 gate + 32 up columns, w2 64), 256-wide K steps, 4
    warps, 5 stages: vLLM's tuned H100 entry for E=128 N=2880 at 128 tokens, twice the K step and one more stage than
    the fitted thin tiles (``THIN_DEEP_K_DEVICES`` says where). Its five stages of 40 KiB take 200 KiB of shared
    memory, which only Hopper-class cards have."""
    return MoEConfig(16, GemmConfig(32, 256, 1, 4, 5, True), GemmConfig(64, 256, 1, 4, 5, True))


def wide_thin_tiles_pay(n: int, num_tokens: int, *, fp8: bool) -> bool:
    """Whether a bf16 or row-wise FP8 layer that runs thin 16-row blocks takes ``thin_wide_config`` over vLLM's
    64-wide decode tiles: a bf16 layer with N <= 768 past one token, a row-wise FP8 layer past 64 tokens.

    A 64-wide w2 tile of a narrow layer is a program that streams 64 x N weights in N / 128 K steps (2 at a Qwen3-Next
    TP2 shard's N = 256): too short to fill its pipeline, so twice the width in twice the warps moves more per
    program. The third sweep (``docs/perf/vs_vllm.md``, "The third sweep"), against vLLM on an H200: at 128 tokens
    faster or level on every narrow bf16 and every row-wise FP8 layer (Qwen3-Next-like x0.99 -> x1.02, E256 N512
    x1.05 -> x1.09, Llama-4-Maverick-like per-channel x1.01 -> x1.04) and level to 1% slower on wide bf16 layers
    (GPT-OSS-120B-shaped x1.07 -> x1.05, Llama-4-Scout-like x1.08 -> x1.07); at 8 tokens within 0.4% or faster on the
    narrow bf16 layers (E256 N512 x1.14 -> x1.17), 0.5-4% slower on wide bf16 layers and from 1% slower to 5% faster
    on row-wise FP8 ones, which keep vLLM's tiles there. One token keeps vLLM's tiles (not swept); 32 tokens follows 8
    and 128, and row-wise FP8 past 128 tokens (8 rows per expert or fewer) follows 128 (neither swept).
    """
    if num_tokens <= 1:
        return False
    return num_tokens > 64 if fp8 else n <= 768


def thin_wide_config(*, fp8: bool) -> MoEConfig:
    """16-row swap-AB blocks with 128-wide weight tiles (w1 64 gate + 64 up columns, w2 128), 128-wide K steps (256
    for FP8: the same bytes), 8 warps, 3 stages: vLLM's tuned H200 entry for E=512 N=256/512 at 128 tokens
    (``wide_thin_tiles_pay`` says where)."""
    block_k = 256 if fp8 else 128
    w1 = GemmConfig(64, block_k, 1, 8, 3, swap_ab=True)
    return MoEConfig(16, w1, GemmConfig(128, block_k, 1, 8, 3, swap_ab=True))


def tma_prefill_config(block_k: int, *, flatten: bool) -> MoEConfig:
    """128-row blocks through the TMA kernels, one program per SM, w1's gate and up tiles loaded as one box (with
    ``flatten`` the tile loop and the K loop fused, four stages): the tuner's prefill winners (``configs/``)."""
    stages = 4 if flatten else 3
    return MoEConfig(128, GemmConfig(128, block_k, 16, 8, stages, persistent=True, paired=True, flatten=flatten),
                     GemmConfig(256, block_k, 16, 8, stages, persistent=True, flatten=flatten), hopper=True)


def tma_mid_config(block_k: int) -> MoEConfig:
    """64-row blocks through the TMA kernels, w1 128 / w2 256 wide (DeepSeek-V3's tuned 2048-token entry)."""
    return MoEConfig(64, GemmConfig(128, block_k, 8, 8, 4), GemmConfig(256, block_k, 8, 8, 4), hopper=True)


def pointer_mid_config(block_k: int) -> MoEConfig:
    """64-row blocks on the pointer-load kernels, w1 64 (128 gate and up columns) / w2 128 wide, 4 warps, 3 stages,
    no grouping: vLLM's tuned H200 tile for E=512 N=512 at 1024-3072 tokens, for past 512 tokens at 8-48 rows per
    expert."""
    return MoEConfig(64, GemmConfig(64, block_k, 1, 4, 3), GemmConfig(128, block_k, 1, 4, 3))


def gluon_mid_config() -> MoEConfig:
    """The Gluon block-FP8 kernel on 64-row blocks (one math warpgroup and the producer warp), persistent, 6 stages:
    half the pad rows of ``gluon_prefill_config`` where experts get 40-48 rows (past that ``gluon_pair_config``).
    Six stages over five: faster at all 4 points of the fourth sweep where it ran (H100, Kimi-K2-like at 8192 tokens
    9927 -> 9447 µs, 581 -> 611 TFLOP/s; at 2048 tokens Kimi-K2-like, DeepSeek-V3 and Qwen3-Coder-480B-like 1-6%)."""
    w1 = GemmConfig(64, FP8_GROUP, 8, 4, 6, persistent=True, warp_specialize=True)
    w2 = GemmConfig(128, FP8_GROUP, 8, 4, 6, persistent=True, warp_specialize=True)
    return MoEConfig(64, w1, w2, fold_topk=False, hopper=True, gather_input=True, gluon=True)


def gluon_pair_config() -> MoEConfig:
    """The Gluon block-FP8 kernel on 64-row blocks in two math warpgroups side by side (8 warps and the producer
    warp), each over its own weight boxes of the block's one A tile: w1 128 (64 gate + 64 up columns a warpgroup),
    w2 256 wide (128 a warpgroup), persistent; the pad rows of ``gluon_mid_config`` with the tensor-core work per
    program of ``gluon_prefill_config``. Five stages for w1, four for w2 (five of its 40 KiB stages and the 32 KiB
    output tile are past the shared memory)."""
    w1 = GemmConfig(128, FP8_GROUP, 8, 8, 5, persistent=True, warp_specialize=True)
    w2 = GemmConfig(256, FP8_GROUP, 8, 8, 4, persistent=True, warp_specialize=True)
    return MoEConfig(64, w1, w2, fold_topk=False, hopper=True, gather_input=True, gluon=True)


def gluon_prefill_config() -> MoEConfig:
    """The Gluon block-FP8 kernel, warp-specialized and persistent, 128-row blocks (DeepSeek-V3's tuned 8192 entry)."""
    w1 = GemmConfig(64, FP8_GROUP, 8, 8, 5, persistent=True, warp_specialize=True)
    w2 = GemmConfig(128, FP8_GROUP, 8, 8, 5, persistent=True, warp_specialize=True)
    return MoEConfig(128, w1, w2, fold_topk=False, hopper=True, gather_input=True, gluon=True)


def vllm_tile_config(num_experts: int, m: int, *, block_fp8: bool, fp8: bool) -> MoEConfig:
    """vLLM's default tile rule for ``m`` tokens, mapped onto our kernels (the whole default before the sweep).

    vLLM picks its tile from the token count M alone (its w1 and w2 share one config). We take the same BLOCK_M,
    BLOCK_K, GROUP_M, warps and stages; our w1 tile reads gate and up rows together, so its ``block_n`` is half
    vLLM's (the same weight tile), and swap-AB goes on where vLLM turns it on for Hopper FP8 (row blocks under 64
    with weight tiles of 64 or more), here for every dtype since thin row blocks waste the 64-row wgmma the same way
    in bf16. Past 512 tokens (row blocks of 128) bf16 and row-wise FP8 take w1 128 wide (256 gate and up columns),
    w2 256, 8 warps, 4 stages, group 16: the tuner's pick before the TMA kernels (``docs/perf/hopper.md``).
    """
    if block_fp8:
        block_m = 16 if m <= 64 else 64
        block_n = 64 if m <= 8 else FP8_GROUP
        stages = 4 if m <= 4 else 3
        group_m = 1 if m <= 16 else 32
        swap = block_m < 64
        w1 = GemmConfig(block_n // 2, FP8_GROUP, group_m, 4, stages, swap)
        w2 = GemmConfig(block_n, FP8_GROUP, group_m, 4, stages, swap)
        return MoEConfig(block_m, w1, w2)
    block_k = 128 if fp8 or m <= 64 else 64
    if m > 512:
        return MoEConfig(128, GemmConfig(128, block_k, 16, 8, 4), GemmConfig(256, block_k, 16, 8, 4))
    block_m = 16 if m <= 32 else 32 if m <= 96 else 64
    block_n = 64 if m <= 64 else 128
    group_m = 16 if m // max(num_experts, 1) > 128 else 1
    warps = 4 if m <= 128 else 8
    stages = 4 if m <= 32 else 3
    w1 = GemmConfig(block_n // 2, block_k, group_m, warps, stages, block_m < 64 and block_n >= 64)
    w2 = GemmConfig(block_n, block_k, group_m, warps, stages, block_m < 64 and block_n >= 64)
    return MoEConfig(block_m, w1, w2)


def config_file_name(device_name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``NVIDIA_H100_80GB_HBM3.json``."""
    return "".join(c if c.isalnum() else "_" for c in device_name) + ".json"


CONFIG_DIR_ENV = "MOE_FSM_TRITON_CONFIG_DIR"


def user_config_dir() -> Path:
    """Where ``moe-fsm tune`` writes tables and the runtime reads them first."""
    return _user_config_dir(os.environ.get(CONFIG_DIR_ENV), os.environ.get("XDG_CACHE_HOME"))


@functools.lru_cache(maxsize=16)
def _user_config_dir(explicit: Optional[str], xdg_cache: Optional[str]) -> Path:
    if explicit:
        return Path(explicit).expanduser()
    return Path(xdg_cache or str(Path.home() / ".cache")) / "moe_fsm" / "triton_moe"


def _parse_table(text: str, where: str):
    """A table file's JSON, read as moe-fsm reads every JSON file (trace.document.parse_json); KernelInputError
    naming the file when it is not JSON moe-fsm reads (malformed, or an integer past a float's range)."""
    try:
        return parse_json(text, f"the Triton MoE config table {where}")
    except InputError as exc:
        raise KernelInputError(str(exc)) from None


def read_table_text(path: Path, what: str) -> str:
    """A user's tile table file as text; KernelInputError naming it when it is not readable UTF-8 (binary, UTF-16, a
    directory or device, too big): the Triton MoE tables here and the weight-quantized ones (``triton_wq.tables``)."""
    try:
        return read_text(path, what)
    except InputError as exc:
        raise KernelInputError(str(exc)) from None


def _read_table(text: str, where: str) -> dict:
    data = _parse_table(text, where)
    configs = data.get("configs") if isinstance(data, dict) else None
    if not isinstance(configs, dict):
        raise KernelInputError(f"the Triton MoE config table {where} has no 'configs' object")
    return configs


@functools.lru_cache(maxsize=None)
def load_shipped_table(device_name: str) -> dict:
    """The table shipped in the package for a device, or an empty one."""
    resource = resources.files("moe_fsm.kernels.triton_moe").joinpath("configs", config_file_name(device_name))
    if not resource.is_file():
        return {}
    return _read_table(resource.read_text(), f"configs/{config_file_name(device_name)}")


@functools.lru_cache(maxsize=None)
def load_user_table(directory: str, device_name: str) -> dict:
    """The table ``moe-fsm tune`` wrote into ``directory`` for a device, or an empty one."""
    path = Path(directory) / config_file_name(device_name)
    if not path.is_file():
        return {}
    return _read_table(read_table_text(path, "the Triton MoE config table"), str(path))


def load_table(device_name: str) -> dict:
    """Shape key -> {token count -> config JSON}: the user's entries over the shipped ones."""
    return {**load_shipped_table(device_name), **load_user_table(str(user_config_dir()), device_name)}


def clear_caches() -> None:
    """Forget loaded tables and looked-up configs (after a tuner wrote a new table)."""
    load_shipped_table.cache_clear()
    load_user_table.cache_clear()
    _user_config_dir.cache_clear()
    _lookup.cache_clear()


def write_user_table(device_name: str, key: str, entries: dict[int, MoEConfig], meta: dict, directory: Optional[Path] = None) -> Path:
    """Merge tuned ``entries`` for one shape key into the user's table for a device; returns its path.

    Other shapes already in the file are kept; this shape's token counts are replaced. A file at the path that is
    not such a table (a JSON object with a ``configs`` object) is not moe-fsm's: it is refused, never replaced.
    """
    directory = Path(directory) if directory is not None else user_config_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / config_file_name(device_name)
    data = _parse_table(read_table_text(path, "the Triton MoE config table"), str(path)) if path.is_file() else {"configs": {}}
    if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
        raise KernelInputError(f"{path} is not a Triton MoE config table (a JSON object with a 'configs' object), so "
                               "moe-fsm does not replace it: move it away or tune into another --config-dir")
    data.update({k: v for k, v in meta.items() if k != "configs"})
    data["device"] = device_name
    data["configs"][key] = {str(t): c.to_json() for t, c in sorted(entries.items())}
    write_atomic(path, json.dumps(data, indent=1) + "\n")
    clear_caches()
    return path


def get_config(
    device_name: str,
    num_experts: int,
    n: int,
    k: int,
    top_k: int,
    num_tokens: int,
    compute_dtype: str,
    fp8: Optional[str],
) -> MoEConfig:
    """The tuned config nearest in token count for this shape, else ``default_config`` (cached per shape and count)."""
    environ = os.environ
    return _lookup(
        environ.get(CONFIG_DIR_ENV), environ.get("XDG_CACHE_HOME"), device_name, num_experts, n, k, top_k, num_tokens,
        compute_dtype, fp8,
    )


@functools.lru_cache(maxsize=4096)
def _lookup(
    explicit_dir: Optional[str], xdg_cache: Optional[str], device_name: str, num_experts: int, n: int, k: int, top_k: int,
    num_tokens: int, compute_dtype: str, fp8: Optional[str],
) -> MoEConfig:
    block_fp8 = fp8 == "block"
    key = shape_key(num_experts, n, k, dtype_key(compute_dtype, fp8))
    user_dir = str(_user_config_dir(explicit_dir, xdg_cache))
    entries = load_user_table(user_dir, device_name).get(key) or load_shipped_table(device_name).get(key)
    if not entries:
        return default_config(num_experts, n, k, top_k, num_tokens, block_fp8=block_fp8, fp8=fp8 is not None,
                              device=device_name)
    target = math.log2(max(num_tokens, 1))
    nearest = min(entries, key=lambda m: (abs(math.log2(int(m)) - target), int(m)))
    config = MoEConfig.from_json(entries[nearest])
    validate_config(config, block_fp8=block_fp8)
    return config
