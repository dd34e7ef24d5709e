"""The Triton MoE config tables: what the tuner writes into the user's directory, the runtime reads first.

No GPU needed: the tables, their lookup and the default heuristic are plain Python.
"""

from __future__ import annotations

import json

import pytest

from moe_fsm.errors import KernelInputError
from moe_fsm.kernels.triton_moe import config as cfg
from moe_fsm.kernels.triton_moe.config import GemmConfig, MoEConfig
from triton_launches import interpreter

DEVICE = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(cfg.CONFIG_DIR_ENV, str(tmp_path))
    cfg.clear_caches()
    yield tmp_path
    cfg.clear_caches()


def tuned(block_m: int, fold: bool = False) -> MoEConfig:
    return MoEConfig(block_m, GemmConfig(32, 128, 1, 4, 4, True), GemmConfig(64, 256, 1, 4, 3, True), fold)


def test_a_table_written_by_the_tuner_is_what_the_runtime_picks(user_dir):
    shipped = cfg.get_config(DEVICE, 128, 768, 2048, 8, 8, "bfloat16", None)
    key = cfg.shape_key(128, 768, 2048, "bf16")
    path = cfg.write_user_table(DEVICE, key, {1: tuned(16), 512: tuned(64, True)}, {"generated_by": "test"})
    assert path == user_dir / "NVIDIA_H100_80GB_HBM3.json"
    assert cfg.get_config(DEVICE, 128, 768, 2048, 8, 8, "bfloat16", None) == tuned(16)
    assert cfg.get_config(DEVICE, 128, 768, 2048, 8, 600, "bfloat16", None) == tuned(64, True)
    assert shipped != tuned(16)
    # other shapes still come from the shipped table
    fp8 = cfg.get_config(DEVICE, 256, 2048, 7168, 8, 8, "bfloat16", "block")
    assert fp8 == MoEConfig.from_json(cfg.load_shipped_table(DEVICE)["E=256,N=2048,K=7168,dtype=fp8_block"]["8"])


def test_tuning_another_shape_keeps_the_first(user_dir):
    cfg.write_user_table(DEVICE, cfg.shape_key(8, 64, 32, "bf16"), {1: tuned(16)}, {})
    cfg.write_user_table(DEVICE, cfg.shape_key(8, 64, 32, "fp8_tensor"), {4: tuned(32)}, {})
    data = json.loads((user_dir / "NVIDIA_H100_80GB_HBM3.json").read_text())
    assert set(data["configs"]) == {"E=8,N=64,K=32,dtype=bf16", "E=8,N=64,K=32,dtype=fp8_tensor"}
    assert cfg.get_config(DEVICE, 8, 64, 32, 2, 1, "bfloat16", None) == tuned(16)
    assert cfg.get_config(DEVICE, 8, 64, 32, 2, 1, "bfloat16", "tensor") == tuned(32)
    assert cfg.get_config(DEVICE, 8, 64, 32, 2, 1, "bfloat16", "channel") == cfg.default_config(8, 64, 32, 2, 1, block_fp8=False, fp8=True)


def test_a_broken_user_table_names_its_file(user_dir):
    (user_dir / "NVIDIA_H100_80GB_HBM3.json").write_text("{not json")
    with pytest.raises(KernelInputError, match="NVIDIA_H100_80GB_HBM3.json is not valid JSON"):
        cfg.get_config(DEVICE, 8, 64, 32, 2, 1, "bfloat16", None)


@pytest.mark.parametrize("content, message", [(b"\x80\x81 binary", "is not UTF-8 text"),
                                              (b"\xff\xfe{}", "is UTF-16 text")])
def test_a_user_table_that_is_not_utf8_names_its_file_and_is_kept(user_dir, content, message):
    """One line naming the file (was a UnicodeDecodeError), at lookup and when tuning would write into it."""
    path = user_dir / "NVIDIA_H100_80GB_HBM3.json"
    path.write_bytes(content)
    with pytest.raises(KernelInputError, match=f"NVIDIA_H100_80GB_HBM3.json {message}"):
        cfg.get_config(DEVICE, 8, 64, 32, 2, 1, "bfloat16", None)
    with pytest.raises(KernelInputError, match=f"NVIDIA_H100_80GB_HBM3.json {message}"):
        cfg.write_user_table(DEVICE, cfg.shape_key(8, 64, 32, "bf16"), {1: tuned(16)}, {})
    assert path.read_bytes() == content


@pytest.mark.parametrize("digits", [400, 5000])  # read but past a float; past Python's int max str digits
def test_a_user_table_with_a_huge_integer_names_its_file(user_dir, digits):
    (user_dir / "NVIDIA_H100_80GB_HBM3.json").write_text('{"configs": {}, "version": ' + "9" * digits + "}")
    with pytest.raises(KernelInputError, match="NVIDIA_H100_80GB_HBM3.json holds an integer"):
        cfg.get_config(DEVICE, 8, 64, 32, 2, 1, "bfloat16", None)
    with pytest.raises(KernelInputError, match="NVIDIA_H100_80GB_HBM3.json holds an integer"):
        cfg.write_user_table(DEVICE, cfg.shape_key(8, 64, 32, "bf16"), {1: tuned(16)}, {})


@pytest.mark.parametrize("text", ["[1, 2]", '"a string"', '{"configs": [1]}', '{"device": "x"}'])
def test_a_file_that_is_not_a_table_is_refused_and_kept(user_dir, text):
    """Valid JSON but not a table: one line naming the file (was an AttributeError), and the file is untouched."""
    path = user_dir / "NVIDIA_H100_80GB_HBM3.json"
    path.write_text(text)
    with pytest.raises(KernelInputError, match="NVIDIA_H100_80GB_HBM3.json is not a Triton MoE config table"):
        cfg.write_user_table(DEVICE, cfg.shape_key(8, 64, 32, "bf16"), {1: tuned(16)}, {})
    assert path.read_text() == text


def test_old_tables_without_the_new_fields_still_load():
    entry = {"block_m": 16, "w1": {"block_n": 32, "block_k": 128, "group_m": 1, "num_warps": 4, "num_stages": 4},
             "w2": {"block_n": 64, "block_k": 128, "group_m": 1, "num_warps": 4, "num_stages": 4}}
    c = MoEConfig.from_json(entry)
    assert not c.fold_topk and not c.w1.swap_ab
    assert MoEConfig.from_json(c.to_json()) == c


@pytest.mark.parametrize("tokens", [1, 8, 32, 64, 96, 128, 512, 513, 2048, 8192])
@pytest.mark.parametrize("fp8", [None, "tensor", "block"])
def test_the_vllm_tiles_are_vllms_rule_then_the_tuned_prefill_tile(tokens, fp8):
    """Up to 512 tokens: vLLM's BLOCK_M/K, warps, stages (w1 reads the same weight tile: half the width, gate+up).
    Past that (bf16 and row-wise FP8): the prefill tile the tuner kept picking. Never a folded top-k sum."""
    c = cfg.vllm_tile_config(128, tokens, block_fp8=fp8 == "block", fp8=fp8 is not None)
    cfg.validate_config(c, block_fp8=fp8 == "block")
    if fp8 == "block":
        assert c.block_m == (16 if tokens <= 64 else 64)
        assert c.w2.block_n == (64 if tokens <= 8 else 128) and c.w2.block_k == 128
        assert 2 * c.w1.block_n == c.w2.block_n
    elif tokens > 512:
        assert c.block_m == 128 and not c.hopper
        assert (c.w1.block_n, c.w2.block_n, c.w1.block_k) == (128, 256, 128 if fp8 else 64)
        assert (c.w1.num_warps, c.w1.num_stages, c.w1.group_m) == (c.w2.num_warps, c.w2.num_stages, c.w2.group_m) == (8, 4, 16)
    else:
        assert c.block_m == (16 if tokens <= 32 else 32 if tokens <= 96 else 64)
        assert c.w2.block_n == (64 if tokens <= 64 else 128)
        assert c.w2.block_k == (128 if fp8 or tokens <= 64 else 64)
        assert c.w2.num_warps == (4 if tokens <= 128 else 8)
        assert 2 * c.w1.block_n == c.w2.block_n
    assert c.w1.swap_ab == c.w2.swap_ab == (c.block_m < 64)
    assert not c.fold_topk


# (E, N, K, top-k, FP8 granularity or None, tokens) -> what the fitted default takes (bench/sweep_default_rules.py)
DEFAULT_CASES = [
    ((256, 2048, 7168, 8, "block", 8), "vllm"),  # decode: vLLM's tiles
    ((64, 1408, 2048, 6, "tensor", 1), "vllm_deep"),  # one token, row-wise FP8: vLLM's tiles six stages deep
    ((128, 8192, 5120, 1, "channel", 8), "vllm"),
    ((128, 768, 2048, 8, None, 1), "vllm"),
    ((256, 256, 7168, 8, "block", 1), "vllm"),
    ((256, 2048, 7168, 8, "block", 128), "thin"),  # 4 rows per expert: 16-row blocks with swap-AB
    ((384, 2048, 7168, 8, "block", 2048), "gluon_mid"),  # 43 rows, N 2048: 64-row Gluon blocks
    ((384, 2048, 7168, 8, "block", 8192), "gluon_pair"),  # 171 rows: 64-row blocks in two warpgroups side by side
    ((256, 2048, 7168, 8, "block", 2048), "gluon_pair"),  # 64 rows
    ((384, 2112, 7168, 8, "block", 8192), "gluon_mid"),  # N off the pair's 128-wide w1 grid: one warpgroup
    ((384, 256, 7168, 8, "block", 2048), "tma_mid"),  # 43 rows, N 256: the 64-row TMA tiles
    ((160, 1536, 5120, 8, "block", 2048), "gluon"),  # 102 rows, N 1536: 128-row Gluon blocks
    ((256, 2048, 7168, 8, "block", 8192), "gluon_pair"),  # 256 rows, N 2048
    ((64, 2048, 7168, 8, "block", 4096), "gluon_pair"),  # 512 rows: the pair's last
    ((64, 3584, 8192, 8, "block", 8192), "gluon"),  # ERNIE-4.5-300B-like, 1024 rows: past the pair (lost 6% there)
    ((48, 2048, 7168, 8, "block", 8192), "gluon"),  # Kimi-K2 EP8 shard, 1365 rows
    ((256, 1536, 7168, 8, "block", 8192), "gluon"),  # 256 rows, N 1536: 128-row Gluon blocks
    ((128, 1536, 4096, 8, "block", 512), "vllm"),  # 32 rows: vLLM's 64-row pointer-load tile
    ((512, 768, 4096, 8, None, 512), "thin_wide"),  # 8 rows, narrow bf16 (N <= 768): 128-wide tiles in 8 warps
    ((128, 2880, 2880, 4, None, 128), "thin"),  # 4 rows, wide bf16: vLLM's 64-wide decode tiles
    ((512, 256, 2048, 10, None, 8), "thin_wide"),  # decode, narrow bf16 (Qwen3-Next TP2)
    ((512, 512, 2048, 10, None, 128), "thin_wide"),  # 2.5 rows, narrow bf16 (Qwen3-Next)
    ((512, 256, 2048, 10, None, 1), "vllm"),  # one token keeps vLLM's tiles
    ((64, 768, 3072, 8, "tensor", 8), "vllm"),  # decode, row-wise FP8: vLLM's tiles
    ((128, 8192, 5120, 1, "channel", 128), "thin_wide"),  # 1 row, row-wise FP8 past 64 tokens
    ((8, 14336, 4096, 2, None, 512), "tma_mid"),  # 128 rows at 512 tokens
    ((128, 768, 2048, 8, None, 8192), "tma_flat"),  # 512 rows, narrow N
    ((8, 14336, 4096, 2, None, 8192), "tma"),  # wide N: not flattened
    ((128, 1536, 4096, 8, "channel", 2048), "vllm"),  # row-wise FP8 below 4096 tokens: the pointer-load 128 tile
    ((128, 1536, 4096, 8, "channel", 8192), "tma_flat"),
    ((128, 2880, 2880, 4, None, 2048), "vllm"),  # 64 rows: vLLM's rule (the 128-row pointer tile past 512)
    ((512, 512, 2048, 10, None, 2048), "pointer_mid"),  # 40 rows past 512 tokens: 64-row pointer-load blocks
    ((128, 8192, 5120, 1, "channel", 2048), "pointer_mid"),  # 16 rows
    ((512, 768, 4096, 1, None, 4096), "thin_wide"),  # 8 rows past 512 tokens: still thin blocks
    ((512, 1024, 4096, 1, None, 4096), "thin"),
    ((64, 2560, 3584, 8, None, 128), "rows32"),  # 16 rows at 128 tokens, bf16: 32-row blocks (Qwen2-57B-A14B-like)
    ((160, 1536, 5120, 6, None, 512), "rows32"),  # 19 rows at 512 tokens
    ((8, 14336, 4096, 2, None, 128), "vllm"),  # 32 rows (Mixtral-like): vLLM's 64-row block
    ((64, 768, 3072, 8, "tensor", 128), "vllm"),  # 16 rows, row-wise FP8: vLLM's tile
]


def deep(config: MoEConfig) -> MoEConfig:
    return MoEConfig(config.block_m, GemmConfig(**{**config.w1.to_json(), "num_stages": 6}),
                     GemmConfig(**{**config.w2.to_json(), "num_stages": 6}))


@pytest.mark.parametrize("case, kind", DEFAULT_CASES)
def test_the_default_picks_by_rows_per_expert(case, kind):
    e, n, k, top_k, fp8, tokens = case
    c = cfg.default_config(e, n, k, top_k, tokens, block_fp8=fp8 == "block", fp8=fp8 is not None)
    cfg.validate_config(c, block_fp8=fp8 == "block")
    block_k = 64 if fp8 is None else 128
    expected = {
        "vllm": cfg.vllm_tile_config(e, tokens, block_fp8=fp8 == "block", fp8=fp8 is not None),
        "thin": cfg.vllm_tile_config(e, 32, block_fp8=fp8 == "block", fp8=fp8 is not None),
        "thin_wide": cfg.thin_wide_config(fp8=fp8 is not None),
        "tma_mid": cfg.tma_mid_config(block_k),
        "gluon": cfg.gluon_prefill_config(),
        "gluon_mid": cfg.gluon_mid_config(),
        "gluon_pair": cfg.gluon_pair_config(),
        "vllm_deep": deep(cfg.vllm_tile_config(e, tokens, block_fp8=False, fp8=True)),
        "pointer_mid": cfg.pointer_mid_config(block_k),
        "tma_flat": cfg.tma_prefill_config(block_k, flatten=True),
        "tma": cfg.tma_prefill_config(block_k, flatten=False),
        "rows32": cfg.row_block32_config(),
    }[kind]
    assert c == expected
    assert not c.fold_topk


def _interpreted_layer_error(experts: int, k: int, n: int, top_k: int, tokens: int, *, seed: int, config=None) -> float:
    """Relative error against float64 of a float16 layer that ``fused_experts`` computes (under Triton's interpreter,
    which computes float16) with ``config`` (None: the runtime's own choice), its output poisoned with NaN first."""
    import torch

    from moe_fsm.kernels.reference import moe_reference
    from moe_fsm.kernels.triton_moe import fused_experts

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen).half()
    w1 = (torch.randn(experts, 2 * n, k, generator=gen) / k**0.5).half()
    w2 = (torch.randn(experts, k, n, generator=gen) / n**0.5).half()
    g, ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1)
    g, ids = (g / g.sum(1, keepdim=True)).float(), ids.int()
    out = torch.full((tokens, k), float("nan"), dtype=torch.float16)
    fused_experts(x, w1, w2, g, ids, out=out, config=config)
    ref = moe_reference(x, w1.double(), w2.double(), g, ids)
    return float((out.double() - ref).norm() / ref.norm())


@interpreter
def test_the_h100_default_vllm_tile_computes_the_layer():
    """vLLM's default 128-row tile, which an H100's default takes at 48-128 rows per expert past 512 tokens
    (``vllm_default_tile_config``), computes the layer: under Triton's interpreter (float16; tests/gpu/test_triton_moe.py
    runs bf16 on a GPU) against float64, 75 rows per expert, N and K not multiples of the tiles, the output poisoned."""
    experts, k, n, top_k, tokens = 8, 160, 96, 1, 600
    config = cfg.default_config(experts, n, k, top_k, tokens, block_fp8=False, device=DEVICE)
    assert config == cfg.vllm_default_tile_config()
    assert _interpreted_layer_error(experts, k, n, top_k, tokens, seed=11, config=config) < 1e-2


# (E, N, K, top-k, FP8 granularity or None, tokens) -> whether an H100 takes vLLM's default tile where the fitted rule
# does not (config.VLLM_TILE_MAX_ROWS_BY_DEVICE: bf16 past 512 tokens at most 128 rows per expert, where the fitted
# rule runs the 128-row pointer-load tile or the flattened TMA tiles)
H100_CASES = [
    ((128, 2880, 2880, 4, None, 2048), True),  # GPT-OSS-120B-shaped, 64 rows: the 128-row pointer-load tile before
    ((128, 1440, 2880, 4, None, 2048), True),  # its TP2 shard
    ((128, 1408, 4096, 8, None, 2048), True),  # GLM-4.5-Air-like, 128 rows: the flattened TMA tiles before
    ((512, 768, 4096, 8, None, 8192), True),  # 128 rows at 8192 tokens
    ((160, 1536, 5120, 6, None, 2048), True),  # 77 rows
    ((60, 1408, 2048, 4, None, 2048), False),  # 137 rows: past 128
    ((64, 1408, 2048, 6, None, 2048), False),  # 192 rows
    ((16, 8192, 5120, 1, None, 2048), False),  # 128 rows of a wide layer: the unflattened TMA tiles stay
    ((512, 512, 2048, 10, None, 2048), False),  # 40 rows: the 64-row pointer-load blocks stay
    ((128, 2880, 2880, 4, None, 512), False),  # 16 rows at 512 tokens
    ((128, 1536, 4096, 8, "channel", 2048), False),  # row-wise FP8
    ((384, 2048, 7168, 8, "block", 2048), False),  # block FP8
]


@pytest.mark.parametrize("case, vllm_tile", H100_CASES)
def test_an_h100_runs_vllms_default_tile_at_48_to_128_rows_per_expert(case, vllm_tile, user_dir):
    e, n, k, top_k, fp8, tokens = case
    fitted = cfg.default_config(e, n, k, top_k, tokens, block_fp8=fp8 == "block", fp8=fp8 is not None)
    on_h100 = cfg.default_config(e, n, k, top_k, tokens, block_fp8=fp8 == "block", fp8=fp8 is not None, device=DEVICE)
    on_h200 = cfg.default_config(e, n, k, top_k, tokens, block_fp8=fp8 == "block", fp8=fp8 is not None,
                                 device="NVIDIA H200")
    assert on_h200 == fitted
    assert on_h100 == (cfg.vllm_default_tile_config() if vllm_tile else fitted)
    assert (fitted == cfg.vllm_default_tile_config()) is False
    cfg.validate_config(on_h100, block_fp8=fp8 == "block")
    # the runtime's lookup passes the card's name: a shape no table holds gets that card's default
    assert cfg.load_table(DEVICE).get(cfg.shape_key(e, n, k, cfg.dtype_key("bfloat16", fp8))) is None
    assert cfg.get_config(DEVICE, e, n, k, top_k, tokens, "bfloat16", fp8) == on_h100


# (E, N, K, top-k, FP8 granularity or None, tokens) -> what an H100's default takes where the eighth sweep's exceptions
# depart from the fitted rule (config.BLOCK_FP8_ROW_BLOCK32_DEVICES: 32-row blocks for block FP8 at 8-16 rows past 96
# tokens; THIN_DEEP_K_DEVICES: 256-wide K steps on the thin blocks of wide bf16 layers past 96 tokens); None: the
# fitted rule's config
H100_BLOCK_AND_THIN_CASES = [
    ((64, 3584, 8192, 8, "block", 8192), None),  # ERNIE-4.5-300B-like, 1024 rows: the 128-row Gluon blocks
    ((64, 2048, 7168, 8, "block", 4096), None),  # 512 rows: the pair
    ((160, 2560, 6144, 8, "block", 8192), None),  # Qwen3-Coder-480B-like, 410 rows: the pair (5% faster)
    ((384, 2048, 7168, 8, "block", 8192), None),  # Kimi-K2-like, 171 rows: the pair
    ((64, 3584, 8192, 8, "block", 128), "rows32"),  # ERNIE-4.5-300B-like at 128 tokens, 16 rows
    ((256, 2048, 5120, 8, "block", 512), "rows32"),  # DeepSeek-V3-like at 512 tokens, 16 rows (K 7168 is tabled)
    ((384, 2048, 7168, 8, "block", 512), "rows32"),  # Kimi-K2-like at 512 tokens, 10.7 rows
    ((256, 2048, 5120, 8, "block", 128), None),  # 4 rows: 16-row blocks
    ((48, 2048, 7168, 8, "block", 128), None),  # 21 rows: vLLM's 64-row tile
    ((64, 3584, 8192, 8, "block", 64), None),  # decode: vLLM's tiles
    ((128, 2880, 2880, 4, None, 128), "deep_k"),  # GPT-OSS-120B-shaped, 4 rows
    ((128, 1440, 2880, 4, None, 128), "deep_k"),  # its TP2 shard
    ((128, 1408, 4096, 8, None, 128), "deep_k"),  # GLM-4.5-Air-like, 8 rows
    ((512, 512, 2048, 10, None, 128), None),  # narrow: the 128-wide thin tiles
    ((128, 2880, 2880, 4, None, 64), None),  # decode
    ((128, 2880, 2880, 4, "channel", 128), None),  # row-wise FP8
    ((64, 2560, 3584, 8, None, 128), None),  # 16 rows: the bf16 32-row blocks
]


@pytest.mark.parametrize("case, kind", H100_BLOCK_AND_THIN_CASES)
def test_an_h100_keeps_its_measured_block_fp8_and_thin_tiles(case, kind, user_dir):
    e, n, k, top_k, fp8, tokens = case
    quant = {"block_fp8": fp8 == "block", "fp8": fp8 is not None}
    fitted = cfg.default_config(e, n, k, top_k, tokens, **quant)
    on_h100 = cfg.default_config(e, n, k, top_k, tokens, **quant, device=DEVICE)
    assert cfg.default_config(e, n, k, top_k, tokens, **quant, device="NVIDIA H200") == fitted
    expected = {None: fitted, "rows32": cfg.block_fp8_row_block32_config(), "deep_k": cfg.thin_deep_k_config()}[kind]
    assert on_h100 == expected
    if kind is not None:
        assert fitted != expected
        assert fitted == cfg.vllm_tile_config(e, 32, block_fp8=fp8 == "block", fp8=fp8 is not None)
    cfg.validate_config(on_h100, block_fp8=fp8 == "block")
    # the runtime's lookup passes the card's name: a shape no table holds gets that card's default
    assert cfg.load_table(DEVICE).get(cfg.shape_key(e, n, k, cfg.dtype_key("bfloat16", fp8))) is None
    assert cfg.get_config(DEVICE, e, n, k, top_k, tokens, "bfloat16", fp8) == on_h100


@interpreter
def test_the_h100_thin_deep_k_tile_computes_the_layer():
    """vLLM's tuned H100 tile with 256-wide K steps, which an H100's default takes on the thin blocks of wide bf16
    layers at 97-512 tokens (``thin_deep_k_config``), computes the layer: under Triton's interpreter (float16) against
    float64, 6 rows per expert, N past 768 (narrower layers take the 128-wide thin tiles) and neither N nor K a multiple
    of the tiles, the output poisoned."""
    experts, k, n, top_k, tokens = 16, 320, 800, 1, 100
    config = cfg.default_config(experts, n, k, top_k, tokens, block_fp8=False, device=DEVICE)
    assert config == cfg.thin_deep_k_config()
    assert _interpreted_layer_error(experts, k, n, top_k, tokens, seed=13, config=config) < 1e-2


def test_merging_a_partial_tuning_into_the_shipped_table_keeps_the_other_token_counts(tmp_path):
    """bench/tune_triton.py run for a few token counts replaces those entries of a shape and keeps the rest."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "tune_triton.py"
    spec = importlib.util.spec_from_file_location("tune_triton", script)
    tune_triton = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_triton)
    key, other = cfg.shape_key(8, 64, 32, "bf16"), cfg.shape_key(8, 128, 32, "bf16")
    shipped_dir, tuned_dir = tmp_path / "shipped", tmp_path / "tuned"
    shipped_dir.mkdir()
    name = cfg.config_file_name(DEVICE)
    (shipped_dir / name).write_text(json.dumps({"configs": {
        key: {"1": tuned(16).to_json(), "8192": tuned(64).to_json()}, other: {"1": tuned(16).to_json()}}}))
    tuned_path = cfg.write_user_table(DEVICE, key, {8192: tuned(128), 2048: tuned(64, True)}, {"generated_by": "test"},
                                      tuned_dir)
    merged = json.loads(tune_triton.merge_into_shipped(tuned_path, shipped_dir).read_text())["configs"]
    assert list(merged[key]) == ["1", "2048", "8192"]
    assert MoEConfig.from_json(merged[key]["8192"]) == tuned(128)
    assert MoEConfig.from_json(merged[key]["1"]) == tuned(16)
    assert merged[other] == {"1": tuned(16).to_json()}


@interpreter
def test_the_default_32_row_blocks_compute_the_layer():
    """The 32-row blocks the default takes for bf16 layers at 8-32 rows per expert past 96 tokens (``row_block32_config``)
    compute the layer: under Triton's interpreter (float16, which it computes; tests/gpu/test_triton_moe.py runs bf16 on
    a GPU) against float64, the output poisoned with NaN first."""
    experts, k, n, top_k, tokens = 16, 128, 64, 4, 100  # 25 rows per expert
    assert cfg.default_config(experts, n, k, top_k, tokens, block_fp8=False) == cfg.row_block32_config()
    assert _interpreted_layer_error(experts, k, n, top_k, tokens, seed=7) < 1e-2
