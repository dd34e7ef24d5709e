"""Which rule should pick the Triton MoE config of a shape no table holds: candidate rules timed side by side
with vLLM 0.33.0's ``fused_moe_kernel`` on a grid of layer shapes, the rule fitted on one part of the grid and
checked on the rest.

``default_config`` (``triton_moe/config.py``) is what every untuned shape runs. This sweep times a few rules
(not every tile: that is ``moe-fsm tune``'s job) on ``FIT`` shapes (E 8-512, K 2048-7168, N 256-16384, top-k
1-10; bf16, FP8 per-tensor, per-channel and 128-block) at the token counts where the rules differ, and the same
on ``HELD_OUT`` shapes that the choice of rule does not look at. Each point also times vLLM's kernel with its
own config (its tuned table for the device where it ships one, else its default rule), on the same weights,
routings, inputs and alignment (``bench_experts_vs_vllm.py``'s ``VllmPipeline``), so a rule is judged by the
ratio the benchmark reports.

The rules (``RULES``):

- ``vllm_tiles``: the default before this sweep (``config.vllm_tile_config``: vLLM's tile rules by token count,
  the pointer-load kernels; the first run printed it as ``current``, relabeled in docs/perf/default_rules_h200.json);
- ``tma``: the same row blocks, the prefill tiles through the Hopper TMA kernels (persistent, paired gate/up
  loads) and, for block FP8, the Gluon kernel at 128-row blocks;
- ``rows``: the row block from the expected rows per expert (tokens x top-k / E) rather than from the token
  count, so a many-expert layer is not padded to 128-row blocks it fills a third of; then ``tma``'s tiles;
- ``rows_flat``: ``rows`` with the persistent loop flattened (the Qwen3 shapes' tuned winner) at 128-row blocks
  and the pointer-load tile the tuner keeps at 64-row blocks;
- ``default``: ``default_config`` as it is now (fitted on the first run's ``FIT`` points, refined by the second).

The second sweep (``--rules default`` plus the ``CANDIDATES``, 2048 and 8192 tokens, FIT and HELD_OUT shapes) timed
``default_config`` with one regime changed at a time: 64-row pointer-load blocks or the flattened TMA tiles at 8-96
rows per expert, the flattened loop at every N, a 128-wide w2 tile, the Gluon kernel on 64-row blocks for block FP8.
The third sweep (``--rules default thin_wide_k64 thin_wide_w8 thin32 mid_tma64``, bf16 and row-wise FP8 FIT and
HELD_OUT shapes at 8 and 128 tokens, six of them at 512 and 2048) timed vLLM's tuned tiles for the layers the check
run left below vLLM: 128-wide weight tiles on thin blocks (``thin_wide_w8`` kept for narrow bf16 layers and row-wise
FP8 past 64 tokens), 32-row blocks at 8-32 rows per expert and 64-row TMA tiles at 48-96 rows past 512 tokens (both
lost). The fourth sweep (``--rules default mid32`` at 128 and 512 tokens; ``default gluon128 gluon64_deep`` and
``default tma64_persistent tma_unflat`` at 2048 and 8192; H100, docs/perf/default_rules_h100_4.json) timed vLLM's
tuned 32-row tile without swap-AB (kept for bf16 below 32 rows per expert: ``config.row_block32_config``) and, for the
8192-token layers short of the TFLOP/s targets, tiles with fewer pad rows (kept: six stages for the 64-row Gluon
blocks; the 64-row persistent TMA tiles and the unflattened loop lost). The fifth (``--rules default vllm_default128``
at 2048 tokens on 14 bf16 shapes, 2 x H200, docs/perf/default_rules_h200_5.json) timed vLLM's own default tile past
512 tokens; it lost at 11 of 14 points and is not kept. The sixth (``--rules default vllm_default128 tma_vllm128
tma_unflat`` at 2048 tokens on 9 bf16 shapes of 48-192 rows per expert, two more at 8192; one H100,
docs/perf/default_rules_h100_6.json) timed it on the card where three such points were below vLLM: there it won at
48-128 rows where the default runs the 128-row pointer-load or flattened TMA tiles, which the H100 now takes
(``config.VLLM_TILE_MAX_ROWS_BY_DEVICE``); the same tiles through the TMA kernels (``tma_vllm128``) lost everywhere.
The seventh (``--rules default gluon_pair tma64_pair`` at 2048 and 8192 tokens; one H200,
docs/perf/default_rules_h200_7.json) timed 64-row blocks in two warpgroups side by side for the 8192-token misses
(kept for block FP8: ``config.gluon_pair_config``; lost for bf16). The eighth (``--rules default
gluon_one_warpgroup thin_block_vllm thin32_block`` on four block-FP8 shapes at 128-8192 tokens, ``default
thin_deep_k`` on three bf16 ones at 128; one H100, docs/perf/default_rules_h100_8.json) checked the seventh's
two-warpgroup Gluon blocks on an H100 against the rule before them (every card keeps 128-row blocks past 512 rows per
expert: ``config.GLUON_PAIR_MAX_ROWS``) and timed tiles for the check run's two 128-token points below vLLM
(an H100 takes both: ``config.BLOCK_FP8_ROW_BLOCK32_DEVICES``, ``config.THIN_DEEP_K_DEVICES``); there ``default`` is
the rule with the seventh sweep's change and ``gluon_one_warpgroup`` the rule before it.
``default`` is the default of the card the sweep runs on. ``CHECK`` shapes are in no fit:
``bench_experts_vs_vllm.py run --sweep-shapes check`` measures the result there.

``score SWEEP.json`` (no GPU) reads a saved sweep and, for each point where ``default_config`` picks a config one of
the timed rules picked, takes that rule's time: the fitted rule's figures on the fit and the held-out shapes without a
new run.

Runs on a CUDA GPU; carry ``.vllm_extract`` (``bench_experts_vs_vllm.py prepare``). Writes JSON (every point's
µs per rule and vLLM's) and prints one line per point and the summary per rule over the fit and held-out sets.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import astuple, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from moe_fsm.kernels.triton_moe.config import (  # noqa: E402
    GemmConfig, MoEConfig, default_config, gluon_mid_config, gluon_pair_config, gluon_prefill_config,
    block_fp8_row_block32_config, pointer_mid_config, thin_deep_k_config, thin_wide_config, tma_mid_config,
    tma_prefill_config, vllm_tile_config, wide_thin_tiles_pay,
)

# (name, E, N, K, top-k, quant): quant None (bf16), "tensor", "channel" or "block"
FIT = [
    ("mixtral-8x7b", 8, 14336, 4096, 2, None),
    ("llama4-scout-like", 16, 8192, 5120, 1, None),
    ("e32-k4096-n2048", 32, 2048, 4096, 4, None),
    ("deepseek-v2-lite-like", 64, 1408, 2048, 6, None),
    ("e64-k4096-n1536-block", 64, 1536, 4096, 8, "block"),
    ("qwen3-30b-a3b", 128, 768, 2048, 8, None),
    ("qwen3-235b-like-block", 128, 1536, 4096, 8, "block"),
    ("qwen3-235b-like-channel", 128, 1536, 4096, 8, "channel"),
    ("deepseek-v2-like", 160, 1536, 5120, 6, None),
    ("deepseek-v3-block", 256, 2048, 7168, 8, "block"),
    ("e256-k2048-n512", 256, 512, 2048, 8, None),
    ("deepseek-v3-tp8-block", 256, 256, 7168, 8, "block"),
    ("mixtral-8x22b-like-tensor", 8, 16384, 6144, 2, "tensor"),
    ("e64-k3072-n768-tensor", 64, 768, 3072, 8, "tensor"),
    ("e512-k4096-n768", 512, 768, 4096, 8, None),
    ("e32-k2048-n4096-channel", 32, 4096, 2048, 2, "channel"),
]
HELD_OUT = [
    ("kimi-k2-like-block", 384, 2048, 7168, 8, "block"),
    ("glm-4.5-air-like", 128, 1408, 4096, 8, None),
    ("gpt-oss-120b-shaped", 128, 2880, 2880, 4, None),
    ("qwen3-next-like", 512, 512, 2048, 10, None),
    ("glm-4.5-like-block", 160, 1536, 5120, 8, "block"),
    ("qwen3-235b-tp4-block", 128, 384, 4096, 8, "block"),
    ("mixtral-8x22b-tp2", 8, 8192, 6144, 2, None),
    ("llama4-maverick-like-channel", 128, 8192, 5120, 1, "channel"),
    ("deepseek-v2-lite-like-tensor", 64, 1408, 2048, 6, "tensor"),
    ("gpt-oss-20b-shaped", 32, 2880, 2880, 4, None),
    ("qwen3-30b-ep2", 64, 768, 2048, 8, None),
    ("kimi-k2-tp8-block", 384, 256, 7168, 8, "block"),
    ("hunyuan-a13b-like", 64, 3072, 4096, 8, None),
]
# shapes neither fit looked at, for the benchmark of record after the second fit (bench_experts_vs_vllm.py
# --sweep-shapes check): expert counts that are no power of two (60, 48, 40), hidden sizes outside the fit grid
# (1536, 8192), N not a multiple of 128 (1440), FP8 layers of every granularity
CHECK = [
    ("dbrx-like", 16, 10752, 6144, 4, None),
    ("qwen2-57b-a14b-like", 64, 2560, 3584, 8, None),
    ("qwen1.5-moe-like", 60, 1408, 2048, 4, None),
    ("olmoe-like", 64, 1024, 2048, 8, None),
    ("deepseek-v3-tp4-block", 256, 512, 7168, 8, "block"),
    ("ernie-4.5-300b-like-block", 64, 3584, 8192, 8, "block"),
    ("minimax-like-tensor", 32, 9216, 6144, 2, "tensor"),
    ("phi-3.5-moe-like-channel", 16, 6400, 4096, 2, "channel"),
    ("granite-moe-like", 40, 512, 1536, 8, None),
    ("qwen3-235b-tp2-tensor", 128, 768, 4096, 8, "tensor"),
    ("kimi-k2-ep8-block", 48, 2048, 7168, 8, "block"),
    ("gpt-oss-120b-tp2", 128, 1440, 2880, 4, None),
    # in the regimes the second fit changed: block FP8 N >= 2048 at 40-256 rows per expert, 8-48 rows past 512 tokens
    ("qwen3-coder-480b-like-block", 160, 2560, 6144, 8, "block"),
    ("arctic-like-channel", 128, 4864, 7168, 2, "channel"),
    ("qwen3-next-tp2", 512, 256, 2048, 10, None),
]
TOKENS = (128, 512, 2048, 8192)


def _pointer_mid(block_k: int) -> MoEConfig:
    """64-row blocks on the pointer-load kernels (the 512-token entry the tuner wrote for most shapes)."""
    return MoEConfig(64, GemmConfig(64, block_k, 8, 4, 3), GemmConfig(128, block_k, 8, 4, 3))


def rule_vllm_tiles(e, n, k, top_k, m, fp8):
    return vllm_tile_config(e, m, block_fp8=fp8 == "block", fp8=fp8 is not None)


# the card the sweep runs on (``main`` sets it; ``score`` takes the saved run's): ``default`` is its default, the
# fitted rule with that card's exceptions (``config.VLLM_TILE_MAX_ROWS_BY_DEVICE``)
DEVICE = ""


def rule_default(e, n, k, top_k, m, fp8):
    return default_config(e, n, k, top_k, m, block_fp8=fp8 == "block", fp8=fp8 is not None, device=DEVICE)


def rule_tma(e, n, k, top_k, m, fp8):
    base = rule_vllm_tiles(e, n, k, top_k, m, fp8)
    block_k = 64 if fp8 is None else 128
    if fp8 == "block":
        if m > 512 and m * top_k / e >= 96:
            return gluon_prefill_config()
        return tma_mid_config(128) if base.block_m == 64 else base
    return tma_prefill_config(block_k, flatten=False) if base.block_m == 128 else base


def _by_rows(e, n, k, top_k, m, fp8, flat: bool):
    rows = m * top_k / e
    block_k = 64 if fp8 is None else 128
    if rows <= 16:  # thin blocks: the current rule's decode/swap-AB tiles
        return rule_vllm_tiles(e, n, k, top_k, min(m, 32), fp8)
    if rows <= 48:
        return rule_vllm_tiles(e, n, k, top_k, 96, fp8)  # the 32-row block of the current rule
    if rows <= 160:
        if fp8 == "block":
            return tma_mid_config(128)
        return _pointer_mid(block_k) if flat else tma_mid_config(block_k)
    if fp8 == "block":
        return gluon_prefill_config()
    return tma_prefill_config(block_k, flatten=flat)


def rule_rows(e, n, k, top_k, m, fp8):
    return _by_rows(e, n, k, top_k, m, fp8, False)


def rule_rows_flat(e, n, k, top_k, m, fp8):
    return _by_rows(e, n, k, top_k, m, fp8, True)


RULES = {"vllm_tiles": rule_vllm_tiles, "tma": rule_tma, "rows": rule_rows, "rows_flat": rule_rows_flat, "default": rule_default}


# The second sweep's candidates: each is ``default_config`` with one regime changed, so a point costs a timing only
# where the candidate differs from it (the default of the first fit when they were timed, default_rules_h200_2.json;
# ``mid_pointer64`` and ``gluon64``, restricted, are in it now). They probe what the first fit left slow: pad rows of 128-row blocks at 8-96
# rows per expert past 512 tokens (Qwen3-Next-like at 2048 tokens x0.96), the flattened persistent loop on wide
# and FP8 row-wise layers, a narrower w2 tile, and 64-row Gluon blocks for block FP8 at 40-256 rows per expert
# (Kimi-K2-like at 8192 tokens: a third of its 128-row blocks' rows are pads).


def _prefill_regime(e, top_k, m, fp8) -> bool:
    return m > 512 and fp8 != "block" and m * top_k / e >= 96


def _mid_regime(e, top_k, m, fp8) -> bool:
    return m > 512 and fp8 != "block" and 8 < m * top_k / e < 96


def rule_mid_pointer64(e, n, k, top_k, m, fp8):
    """8-96 rows per expert past 512 tokens: 64-row pointer-load blocks, vLLM's tuned H200 tile for E=512 N=512."""
    if _mid_regime(e, top_k, m, fp8):
        return pointer_mid_config(64 if fp8 is None else 128)
    return rule_default(e, n, k, top_k, m, fp8)


def rule_mid_tma_flat(e, n, k, top_k, m, fp8):
    """8-96 rows per expert past 512 tokens: the 128-row persistent TMA tiles, flattened."""
    if _mid_regime(e, top_k, m, fp8):
        return tma_prefill_config(64 if fp8 is None else 128, flatten=True)
    return rule_default(e, n, k, top_k, m, fp8)


def rule_flat_all(e, n, k, top_k, m, fp8):
    """96 rows per expert and more past 512 tokens (bf16, row-wise FP8): the persistent loop flattened at every N."""
    if _prefill_regime(e, top_k, m, fp8):
        return tma_prefill_config(64 if fp8 is None else 128, flatten=True)
    return rule_default(e, n, k, top_k, m, fp8)


def rule_w2_narrow(e, n, k, top_k, m, fp8):
    """The default's persistent TMA prefill tiles with w2 128 wide instead of 256 (more tiles for narrow outputs)."""
    base = rule_default(e, n, k, top_k, m, fp8)
    if base.hopper and base.block_m == 128 and not base.gluon:
        return MoEConfig(128, base.w1, GemmConfig(128, base.w2.block_k, 16, 8, base.w2.num_stages, persistent=True,
                                                  flatten=base.w2.flatten), hopper=True)
    return base


def rule_gluon64(e, n, k, top_k, m, fp8):
    """Block FP8, 40-256 rows per expert past 512 tokens: the Gluon kernel on 64-row blocks (one math warpgroup)."""
    if fp8 == "block" and m > 512 and 40 <= m * top_k / e < 256:
        return gluon_mid_config()
    return rule_default(e, n, k, top_k, m, fp8)


def _decode_w1_programs(e, n, top_k, m, config) -> int:
    """How many programs the decode w1 GEMM launches: one per (row block, w1 tile); at a token or two the row
    blocks are the experts hit, one each."""
    return min(m * top_k, e) * -(-n // config.w1.block_n)


def rule_decode_w1_16(e, n, k, top_k, m, fp8):
    """Decode (64 tokens or fewer): w1 16 columns wide where the default's w1 launches fewer than two programs per SM
    of an H100/H200 (132): a 1-token call of a narrow layer (TP/EP shards) is a weight stream that too few programs
    cannot keep in flight."""
    base = rule_default(e, n, k, top_k, m, fp8)
    if m <= 64 and _decode_w1_programs(e, n, top_k, m, base) < 2 * 132:
        g = base.w1
        return MoEConfig(base.block_m, GemmConfig(16, g.block_k, g.group_m, g.num_warps, g.num_stages, g.swap_ab),
                         base.w2)
    return base


def rule_decode_deep(e, n, k, top_k, m, fp8):
    """Decode at 8 tokens or fewer: both GEMMs six stages deep (more weight bytes in flight per program)."""
    base = rule_default(e, n, k, top_k, m, fp8)
    if m <= 8:
        w1, w2 = base.w1, base.w2
        return MoEConfig(base.block_m, GemmConfig(w1.block_n, w1.block_k, w1.group_m, w1.num_warps, 6, w1.swap_ab),
                         GemmConfig(w2.block_n, w2.block_k, w2.group_m, w2.num_warps, 6, w2.swap_ab))
    return base


# The third sweep's candidates (issue 44): where the check run was below vLLM's tuned H200 entries. Many-expert bf16
# layers at 8-128 tokens run thin 16-row blocks with vLLM's default 64-wide weight tiles (w1 32 gate + 32 up), which
# on a narrow layer give w2 programs of a few K steps each; vLLM's tuned E=512 entries take 128-wide tiles, 64-wide K
# steps at 8 tokens and 8 warps with 128-wide K steps at 128. At 16-32 rows per expert and 128-512 tokens vLLM's tuned
# E=64 N=1280/2560 entries take 32-row blocks where the default pads to 64; at 48-96 rows past 512 tokens the default's
# 128-row pointer-load tile is half pads (GPT-OSS-120B TP2 at 2048 tokens x0.999).


def _thin(e, n, k, top_k, m, fp8) -> bool:
    """Where the default runs 16-row swap-AB blocks on a bf16 or row-wise FP8 layer, past one token."""
    return m > 1 and fp8 != "block" and rule_default(e, n, k, top_k, m, fp8).block_m == 16


def _wide_thin_tiles(block_m: int, block_k: int, warps: int) -> MoEConfig:
    """Swap-AB blocks of ``block_m`` rows with 128-wide weight tiles (w1 64 gate + 64 up, w2 128), 3 stages."""
    return MoEConfig(block_m, GemmConfig(64, block_k, 1, warps, 3, True), GemmConfig(128, block_k, 1, warps, 3, True))


def rule_thin_wide_k64(e, n, k, top_k, m, fp8):
    """Thin blocks: 128-wide weight tiles, 64-wide K steps (128 for FP8: the same bytes), 4 warps (vLLM's tuned
    H200 entry for E=512 N=256/512 at 8 tokens)."""
    if _thin(e, n, k, top_k, m, fp8):
        return _wide_thin_tiles(16, 64 if fp8 is None else 128, 4)
    return rule_default(e, n, k, top_k, m, fp8)


def rule_thin_wide_w8(e, n, k, top_k, m, fp8):
    """Thin blocks: 128-wide weight tiles, 128-wide K steps (256 for FP8), 8 warps (vLLM's tuned H200 entry for
    E=512 N=256/512 at 128 tokens; ``config.thin_wide_config``, which the default now takes where it paid)."""
    if _thin(e, n, k, top_k, m, fp8):
        return thin_wide_config(fp8=fp8 is not None)
    return rule_default(e, n, k, top_k, m, fp8)


def rule_thin32(e, n, k, top_k, m, fp8):
    """8-32 rows per expert at 97-512 tokens: 32-row swap-AB blocks with 128-wide tiles, 128-wide K steps, 4 warps
    (vLLM's tuned H200 entries for E=64 N=1280/2560 at 128 tokens), where the default pads to 64-row blocks."""
    if fp8 != "block" and 96 < m <= 512 and 8 < m * top_k / e <= 32:
        return _wide_thin_tiles(32, 128 if fp8 is None else 256, 4)
    return rule_default(e, n, k, top_k, m, fp8)


def rule_mid_tma64(e, n, k, top_k, m, fp8):
    """48-96 rows per expert past 512 tokens: the 64-row TMA tiles the default takes at 96+ rows up to 512 tokens."""
    if m > 512 and fp8 != "block" and 48 <= m * top_k / e < 96:
        return tma_mid_config(64 if fp8 is None else 128)
    return rule_default(e, n, k, top_k, m, fp8)


# The fourth sweep's candidates (issue 44, after the third check run): Qwen2-57B-A14B-like at 128 tokens (16 rows per
# expert) stayed at x0.99 against vLLM's tuned 32-row tile without swap-AB, which the third sweep never timed (its
# ``thin32`` swapped); and the 8192-token prefill of two layers short of the TFLOP/s targets, where random routing
# leaves a share of each row block as pads: Kimi-K2-like (E384, 170 rows per expert) 33% of its rows at 128-row
# blocks and 12% at 64 (the default's 64-row Gluon blocks: one math warpgroup a tile), GPT-OSS-120B TP2 (E128, 256
# rows per expert) 19% at 128-row blocks and 11% at 64.


def rule_mid32(e, n, k, top_k, m, fp8):
    """8-32 rows per expert at 97-512 tokens (bf16, row-wise FP8): vLLM's tuned H200 tile for E=64 N=2560 at 128
    tokens as vLLM runs it: 32-row blocks, 128-wide weight tiles, 128-wide K steps (256 for FP8), 4 warps, 3 stages,
    no swap-AB; the default pads these experts to 64-row blocks."""
    if fp8 != "block" and 96 < m <= 512 and 8 < m * top_k / e <= 32:
        block_k = 128 if fp8 is None else 256
        return MoEConfig(32, GemmConfig(64, block_k, 1, 4, 3), GemmConfig(128, block_k, 1, 4, 3))
    return rule_default(e, n, k, top_k, m, fp8)


def rule_gluon128(e, n, k, top_k, m, fp8):
    """Block FP8 past 512 tokens at 96 rows per expert and more: the Gluon kernel on 128-row blocks (two math
    warpgroups, a third pads at Kimi-K2-like's 170 rows) where the default takes 64-row ones (one warpgroup)."""
    if fp8 == "block" and m > 512 and m * top_k / e >= 96:
        return gluon_prefill_config()
    return rule_default(e, n, k, top_k, m, fp8)


def rule_gluon64_deep(e, n, k, top_k, m, fp8):
    """The default's 64-row Gluon blocks with six stages instead of five (more weight tiles in flight for the one
    math warpgroup; the default's two-warpgroup 64-row blocks are left as they are)."""
    base = rule_default(e, n, k, top_k, m, fp8)
    if base.gluon and base.block_m == 64 and base.w1.num_warps == 4:
        return replace(base, w1=replace(base.w1, num_stages=6), w2=replace(base.w2, num_stages=6))
    return base


def rule_tma64_persistent(e, n, k, top_k, m, fp8):
    """bf16 and row-wise FP8 past 512 tokens where the default runs the 128-row persistent TMA tiles: the same
    persistent, paired tiles on 64-row blocks in one warpgroup (half the pad rows at 256 rows per expert)."""
    base = rule_default(e, n, k, top_k, m, fp8)
    if base.hopper and not base.gluon and base.block_m == 128:
        w1, w2 = base.w1, base.w2
        return MoEConfig(64, replace(w1, num_warps=4), replace(w2, num_warps=4), hopper=True)
    return base


def rule_tma_unflat(e, n, k, top_k, m, fp8):
    """The default's 128-row persistent TMA tiles with the loop not flattened (the default flattens at N <= 1536)."""
    base = rule_default(e, n, k, top_k, m, fp8)
    if base.hopper and not base.gluon and base.w1.flatten:
        block_k = base.w1.block_k
        return tma_prefill_config(block_k, flatten=False)
    return base


# The fifth sweep's candidate (issue 44, after the fourth): three bf16 layers at 2048 tokens stayed below vLLM on an
# H100 with every tile timed so far (GLM-4.5-Air-like x0.93 at 128 rows per expert, GPT-OSS-120B-shaped and its TP2
# shard x0.95 at 64), where vLLM runs its default: 128-row blocks of half the width in 3 stages, never timed here.


def rule_vllm_default128(e, n, k, top_k, m, fp8):
    """bf16 past 512 tokens where the default runs 128-row blocks (the TMA tiles or the pointer-load ones): vLLM
    0.33's ``get_default_config`` tile as vLLM runs it: 128-row blocks, 128-wide weight tiles (w1 64 gate + 64 up
    columns, w2 128), 64-wide K steps, 8 warps, 3 stages, groups of 16 row blocks past 128 tokens per expert."""
    base = rule_default(e, n, k, top_k, m, fp8)
    if fp8 is None and m > 512 and base.block_m == 128 and not base.gluon:
        group_m = 16 if m // max(e, 1) > 128 else 1
        return MoEConfig(128, GemmConfig(64, 64, group_m, 8, 3), GemmConfig(128, 64, group_m, 8, 3))
    return base


def rule_tma_vllm128(e, n, k, top_k, m, fp8):
    """Where ``vllm_default128`` changes the config: the same tiles through the TMA kernels (not persistent): the
    weight tiles by the copy engine where vLLM's kernel loads them with pointers."""
    base = rule_vllm_default128(e, n, k, top_k, m, fp8)
    if base != rule_default(e, n, k, top_k, m, fp8):
        return replace(base, hopper=True)
    return base


# The seventh sweep's candidates (issue 44, the two 8192-token TFLOP/s misses): 64-row blocks in two warpgroups side
# by side over the columns, where the default pads experts of 100-300 rows to 128-row blocks (a fifth to a third pads)
# or runs 64-row blocks in one warpgroup (the fourth sweep's tma64_persistent and the Gluon kernel's 64-row blocks).


def rule_gluon_pair(e, n, k, top_k, m, fp8):
    """Block FP8 where the default runs the Gluon kernel past 512 tokens: its 64-row blocks in two math warpgroups
    side by side (``config.gluon_pair_config``)."""
    base = rule_default(e, n, k, top_k, m, fp8)
    if base.gluon and m > 512:
        return gluon_pair_config()
    return base


def rule_tma64_pair(e, n, k, top_k, m, fp8):
    """bf16 and row-wise FP8 where the default runs the 128-row persistent TMA tiles: the same tiles on 64-row
    blocks in 8 warps, which Triton lays out as two warpgroups side by side over the tile's columns."""
    base = rule_default(e, n, k, top_k, m, fp8)
    if base.hopper and not base.gluon and base.block_m == 128 and base.w1.persistent:
        return replace(base, block_m=64)
    return base


# The eighth sweep's candidates (the seventh's rule checked on an H100): ``gluon_one_warpgroup`` is the rule before
# the seventh sweep, so the default is timed against what it replaced on the same card; the others probe the two
# 128-token points of the H100 check run below vLLM, both thin 16-row swap-AB blocks: ERNIE-4.5-300B-like block FP8
# at 16 rows per expert (vLLM's default ran 64-row blocks there) and GPT-OSS-120B-shaped bf16 at 4 (vLLM's tuned H100
# entry runs 256-wide K steps in 5 stages).


def rule_gluon_one_warpgroup(e, n, k, top_k, m, fp8):
    """Where the default runs ``gluon_pair_config``, the rule before it: the Gluon kernel on 64-row blocks in one
    math warpgroup (``gluon_mid_config``) below 256 rows per expert, on 128-row blocks (``gluon_prefill_config``)
    from 256 on."""
    base = rule_default(e, n, k, top_k, m, fp8)
    if base == gluon_pair_config():
        return gluon_mid_config() if m * top_k / e < 256 else gluon_prefill_config()
    return base


def _thin_block_rows16(e, n, k, top_k, m, fp8) -> bool:
    """Block FP8 at 97-512 tokens with 8-16 rows per expert, where the default runs 16-row swap-AB blocks."""
    return fp8 == "block" and 96 < m <= 512 and 8 < m * top_k / e <= 16


def rule_thin_block_vllm(e, n, k, top_k, m, fp8):
    """Block FP8 at 8-16 rows per expert past 96 tokens: vLLM's own tile for the token count (64-row blocks, w1 64
    (128 gate and up columns) / w2 128 wide, 4 warps, 3 stages, no swap-AB), which ran ERNIE-4.5-300B-like at 128
    tokens 1.5% faster than our thin blocks on an H100."""
    if _thin_block_rows16(e, n, k, top_k, m, fp8):
        return vllm_tile_config(e, m, block_fp8=True, fp8=True)
    return rule_default(e, n, k, top_k, m, fp8)


def rule_thin32_block(e, n, k, top_k, m, fp8):
    """Block FP8 at 8-16 rows per expert past 96 tokens: 32-row swap-AB blocks (``config.block_fp8_row_block32_config``,
    which an H100's default now takes there)."""
    if _thin_block_rows16(e, n, k, top_k, m, fp8):
        return block_fp8_row_block32_config()
    return rule_default(e, n, k, top_k, m, fp8)


def rule_thin_deep_k(e, n, k, top_k, m, fp8):
    """bf16 thin blocks at 97-512 tokens where the wide weight tiles do not pay (N > 768): vLLM's tuned H100 entry
    for E=128 N=2880 at 128 tokens (``config.thin_deep_k_config``, which an H100's default now takes there)."""
    if fp8 is None and 96 < m <= 512 and _thin(e, n, k, top_k, m, fp8) and not wide_thin_tiles_pay(n, m, fp8=False):
        return thin_deep_k_config()
    return rule_default(e, n, k, top_k, m, fp8)


CANDIDATES = {"mid_pointer64": rule_mid_pointer64, "mid_tma_flat": rule_mid_tma_flat, "flat_all": rule_flat_all,
              "w2_narrow": rule_w2_narrow, "gluon64": rule_gluon64, "decode_w1_16": rule_decode_w1_16,
              "decode_deep": rule_decode_deep, "thin_wide_k64": rule_thin_wide_k64, "thin_wide_w8": rule_thin_wide_w8,
              "thin32": rule_thin32, "mid_tma64": rule_mid_tma64, "mid32": rule_mid32, "gluon128": rule_gluon128,
              "gluon64_deep": rule_gluon64_deep, "tma64_persistent": rule_tma64_persistent,
              "tma_unflat": rule_tma_unflat, "vllm_default128": rule_vllm_default128,
              "tma_vllm128": rule_tma_vllm128, "gluon_pair": rule_gluon_pair, "tma64_pair": rule_tma64_pair,
              "gluon_one_warpgroup": rule_gluon_one_warpgroup, "thin_block_vllm": rule_thin_block_vllm,
              "thin32_block": rule_thin32_block, "thin_deep_k": rule_thin_deep_k}


def _shape(entry):
    from moe_fsm.kernels.triton_moe.tuning import LayerShape

    _, e, n, k, top_k, fp8 = entry
    return LayerShape(e, n, k, top_k, "bfloat16", fp8)


def _compile_worker(jobs):
    """Run each (shape tuple, tokens, ours config JSON or None, vLLM config or None) once on two experts."""
    import torch

    from bench_experts_vs_vllm import VllmPipeline, VllmTriton
    from moe_fsm.kernels.triton_moe.tuning import LayerShape, layer_fn, make_weights

    failures = []
    for extract, shape_t, tokens, ours, theirs in jobs:
        small = LayerShape(*shape_t).with_experts(2)
        try:
            weights = make_weights(small, init=False)
            x = torch.randn(tokens, small.hidden, device="cuda", dtype=torch.bfloat16)
            ids = torch.randint(0, 2, (tokens, small.top_k), device="cuda", dtype=torch.int32)
            g = torch.full(ids.shape, 1.0 / small.top_k, device="cuda")
            if ours is not None:
                layer_fn(small, weights, MoEConfig.from_json(ours))(x, g, ids)
            if theirs is not None:
                pipe = VllmPipeline(VllmTriton(Path(extract), torch.cuda.get_device_name(),
                                               torch.cuda.get_device_capability()), small, weights)
                pipe.configs[tokens] = (theirs, "given")
                pipe.force_naive = False
                pipe(x, g, ids)
            torch.cuda.synchronize()
        except Exception as exc:
            failures.append(f"{shape_t} T={tokens}: {type(exc).__name__}: {str(exc)[:160]}")
    return failures


def score(path: Path) -> dict:
    """``default_config``'s ratio to vLLM at each saved point where it chose a config that some timed rule chose."""
    report = json.loads(path.read_text())
    out: dict[str, list] = {"fit": [], "held_out": [], "check": []}
    uncovered = []
    for p in report["points"]:
        fp8 = None if p["quant"] == "bf16" else p["quant"]
        chosen = default_config(p["E"], p["N"], p["K"], p["top_k"], p["tokens"], block_fp8=fp8 == "block",
                                fp8=fp8 is not None, device=report.get("device", "")).to_json()
        timed = [name for name, cfg in p["configs"].items() if cfg == chosen and name in p["us"]]
        if not timed or "vllm" not in p["us"]:
            uncovered.append(f"{p['shape']}/{p['tokens']}")
            continue
        out[p["part"]].append((f"{p['shape']}/{p['tokens']}", p["us"]["vllm"] / p["us"][timed[0]]))
    summary = {}
    for part, rows in out.items():
        ratios = [r for _, r in rows]
        if ratios:
            summary[part] = {"points": len(ratios), "geomean": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3),
                             "min": round(min(ratios), 3), "below_1": [f"{n}: x{r:.2f}" for n, r in rows if r < 1]}
    summary["not_timed"] = uncovered
    return summary


def main() -> None:
    if sys.argv[1:2] == ["score"]:
        print(json.dumps(score(Path(sys.argv[2])), indent=1))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extract", type=Path, default=ROOT / ".vllm_extract")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--only", nargs="*", default=None,
                        help="shape names to run (default: every FIT and HELD_OUT; CHECK shapes only by name)")
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES) + list(CANDIDATES),
                        help="rules to time (default: the first sweep's; the candidates of the second are CANDIDATES)")
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--rep-ms", type=float, default=25.0)
    parser.add_argument("--budget-s", type=float, default=240.0, help="no new shape is started after this long")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out" / "sweep_default_rules.json")
    args = parser.parse_args()

    import torch

    from bench_experts_vs_vllm import VllmPipeline, VllmTriton
    from moe_fsm.kernels.triton_moe.tuning import layer_fn, make_weights, replays_per_graph, routings, time_graph

    start = time.time()
    global DEVICE
    DEVICE = torch.cuda.get_device_name()
    vllm = VllmTriton(args.extract, DEVICE, torch.cuda.get_device_capability())
    # fit and held-out shapes alternate, so a budget cut leaves both sets measured
    fit, held = [(s, "fit") for s in FIT], [(s, "held_out") for s in HELD_OUT]
    entries = [e for pair in zip(fit, held) for e in pair] + fit[len(held):] + held[len(fit):]
    if args.only:
        entries = [(s, part) for s, part in entries + [(s, "check") for s in CHECK] if s[0] in args.only]
    rules = {name: {**RULES, **CANDIDATES}[name] for name in args.rules}

    def configs_at(entry, m):
        _, e, n, k, top_k, fp8 = entry
        return {name: rule(e, n, k, top_k, m, fp8) for name, rule in rules.items()}

    jobs = []
    for entry, _ in entries:
        shape = _shape(entry)
        for m in args.tokens:
            vcfg = vllm.config(m, shape.num_experts, shape.intermediate, shape.hidden, shape.top_k, shape.fp8)[0]
            jobs.append((str(args.extract), astuple(shape), m, None, vcfg))
            for cfg in dict.fromkeys(configs_at(entry, m).values()):
                jobs.append((str(args.extract), astuple(shape), m, cfg.to_json(), None))
    # each distinct kernel once (the kernels specialize on the config and dtypes, not on the expert count)
    unique = list({json.dumps([j[1][4:], j[1][1:3], j[2] > 64, j[3], j[4]], sort_keys=True): j for j in jobs}.values())
    chunks = [c for c in (unique[i::args.workers] for i in range(args.workers)) if c]
    with mp.get_context("spawn").Pool(len(chunks)) as pool:
        failures = [f for fs in pool.map(_compile_worker, chunks) for f in fs]
    print(f"precompiled {len(unique)} jobs in {time.time() - start:.0f} s; {len(failures)} failed", flush=True)
    for f in failures:
        print("  " + f, flush=True)

    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rules": list(rules),
              "tokens": args.tokens, "points": [], "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for entry, part in entries:
        if time.time() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: {entry[0]} and later shapes not run", flush=True)
            break
        shape = _shape(entry)
        weights = make_weights(shape)
        theirs = VllmPipeline(vllm, shape, weights)
        for m in args.tokens:
            routes = routings(m, shape.num_experts, shape.top_k, replays_per_graph(m), seed=m)
            gen = torch.Generator(device="cuda").manual_seed(m + 1)
            inputs = [(torch.randn(m, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=gen), g, ids)
                      for g, ids in routes]
            point = {"shape": entry[0], "part": part, "E": shape.num_experts, "N": shape.intermediate, "K": shape.hidden,
                     "top_k": shape.top_k, "quant": shape.fp8 or "bf16", "tokens": m,
                     "flops": 2 * m * shape.top_k * 3 * shape.intermediate * shape.hidden, "us": {}, "configs": {}}
            expected = theirs(*inputs[0]).float()
            timed: dict[MoEConfig, float] = {}
            fns = [("vllm", theirs)]
            for name, cfg in configs_at(entry, m).items():
                point["configs"][name] = cfg.to_json()
                if cfg not in timed:
                    timed[cfg] = None
                    fns.append((name, layer_fn(shape, weights, cfg)))
            times: dict[str, list[float]] = {}
            for turn in range(2):  # two rounds, the order reversed in the second
                for name, fn in fns if turn == 0 else fns[::-1]:
                    if name in point.get("errors", {}):
                        continue
                    try:
                        if turn == 0 and name != "vllm":
                            out = fn(*inputs[0]).float()
                            diff = float((out - expected).norm() / expected.norm())
                            if not math.isfinite(diff) or diff > 5e-2:
                                raise ValueError(f"relative difference {diff:.2e} from vLLM's output")
                        times.setdefault(name, []).append(time_graph(fn, inputs, args.rep_ms))
                    except Exception as exc:
                        torch.cuda.synchronize()
                        point.setdefault("errors", {})[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            for name, ts in times.items():
                if name not in point.get("errors", {}):
                    point["us"][name] = statistics.mean(ts)
            for name, cfg in configs_at(entry, m).items():  # rules that chose the same config share its time
                first = next(n for n, c in configs_at(entry, m).items() if c == cfg)
                if first in point["us"]:
                    point["us"][name] = point["us"][first]
            report["points"].append(point)
            v = point["us"].get("vllm", float("nan"))
            print(f"{part:8s} {entry[0]:30s} T={m:5d} vllm {v:9.1f} | " + "  ".join(
                f"{name} {v / point['us'][name]:5.2f}x" if name in point["us"] else f"{name} err" for name in rules),
                flush=True)
            del inputs, routes
        del weights, theirs
        torch.cuda.empty_cache()
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    report["summary"] = summarize(report["points"], list(rules))
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))
    print(f"done in {time.time() - start:.0f} s")


def summarize(points: list[dict], rules: list[str]) -> dict:
    """Per rule and part: geometric mean and minimum of vLLM µs / rule µs, and points below 1."""
    out = {}
    for part in ("fit", "held_out", "check"):
        for name in rules:
            ratios = [p["us"]["vllm"] / p["us"][name] for p in points
                      if p["part"] == part and name in p["us"] and "vllm" in p["us"]]
            if ratios:
                out[f"{part}/{name}"] = {"points": len(ratios),
                                         "geomean": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3),
                                         "min": round(min(ratios), 3), "below_1": sum(r < 1 for r in ratios)}
    return out


if __name__ == "__main__":
    main()
