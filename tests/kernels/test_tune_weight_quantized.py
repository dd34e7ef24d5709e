"""`moe-fsm tune` for weight-quantized layers, without a GPU: which layers it tunes (decided and built as the runtime
does, TP/EP shards included) and which it names and leaves out, the tile candidates it offers, the user's table it
writes and the runtime's lookup reads, and the screening-and-timing run with a fake trial and timer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from moe_fsm.backends.stand_ins import TRITON_WNA16
from moe_fsm.cli.main import main
from moe_fsm.errors import KernelInputError
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.kernels.triton_moe.config import CONFIG_DIR_ENV
from moe_fsm.kernels.triton_wq import tables
from moe_fsm.kernels.triton_wq.fused import SPLIT_CHUNK, WeightQuant, WqConfig, default_wq_config, get_wq_config
from moe_fsm.kernels.triton_wq.tuning import WqLayerShape, candidate_wq_configs, tune_and_write_wq

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
SHIPPED_DEVICE = "NVIDIA H100 80GB HBM3"
SHIPPED_KEY = "int4,g=128,zp=0,E=128,N=768,K=2048,top_k=8"
KIMI_EP8 = dict(num_experts=48, top_k=8, hidden_size=7168, intermediate_size=2048)


def dry_run(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(["tune", *argv, "--dry-run"])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def shape_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("shape ")]


def test_a_gptq_preset_is_tuned_on_the_triton_stand_in_of_the_marlin_kernel_it_decides(capsys, as_platform):
    as_platform("sm90")
    code, lines, _ = dry_run(capsys, "--preset", "qwen3-30b-a3b-gptq-int4")
    assert code == 0
    assert "weight-quantized layers decided by profile vllm-0.33 on NVIDIA H100 (sm90)" in lines
    assert shape_lines(lines) == [
        "shape E=128 N=96 K=256 top-8 int4 g32 bfloat16 (TritonWna16Experts) (preset qwen3-30b-a3b-gptq-int4, "
        "48 layers; MARLIN (MarlinExperts) decided, runs as moe-fsm Triton W4A16 (stand-in))"]


def test_a_mixed_checkpoint_tunes_its_nvfp4_layers_on_the_triton_stand_in_of_marlin(capsys, as_platform):
    """NVFP4 on Hopper: vLLM's Marlin decided, the Triton NVFP4 stand-in runs it with 16-bit activations; the FP8
    layers go to the 16-bit/FP8 tuner as before."""
    as_platform("sm90")
    code, lines, _ = dry_run(capsys, "--config", str(CONFIGS / "synthetic-mixed-nvfp4-fp8"))
    assert code == 0
    nvfp4 = shape_lines(lines)[1]
    assert nvfp4.startswith("shape E=128 N=768 K=2048 top-8 nvfp4 g16 bfloat16 (TritonNvfp4Experts)")
    assert nvfp4.endswith("MARLIN (MarlinExperts) decided, runs as moe-fsm Triton NVFP4, 16-bit activations (stand-in))")


@pytest.mark.parametrize("argv, expected", [
    (("--ep", "8"), "shape E=48 N=2048 K=7168 top-8 int4 g32 bfloat16 (TritonWna16Experts)"),
    (("--tp", "8"), "shape E=384 N=256 K=7168 top-8 int4 g32 bfloat16 (TritonWna16Experts)"),
])
def test_a_kimi_k2_shard_is_tuned_as_one_rank_holds_it(capsys, as_platform, argv, expected):
    as_platform("sm90")
    code, lines, _ = dry_run(capsys, "--config", str(CONFIGS / "kimi-k2-thinking"), "--policy", "vllm-0.33", *argv)
    assert code == 0
    assert [line.split(" (tests")[0].split(f" ({CONFIGS}")[0] for line in shape_lines(lines)] == [expected]


def test_a_gpt_oss_tp2_shard_off_the_64_column_chunks_is_tuned(capsys, as_platform):
    """N = 1440 is not a multiple of 64: the SPLIT layout pads it, so the shard is tuned like any other. (sm90-bare:
    no FlashInfer, so vLLM decides Marlin and the Triton MXFP4 stand-in runs it.)"""
    as_platform("sm90-bare")
    code, lines, _ = dry_run(capsys, "--config", str(CONFIGS / "gpt-oss-120b"), "--policy", "vllm-0.33", "--tp", "2")
    assert code == 0
    assert shape_lines(lines)[0].startswith("shape E=128 N=1440 K=2880 top-4 mxfp4 g32, biases bfloat16 "
                                            "(TritonMxfp4Experts)")


def test_a_layer_decided_to_a_kernel_other_than_moe_fsm_triton_is_named_and_left_out(capsys, as_platform):
    """Without FlashInfer or Marlin's library, the seeds profile decides NVFP4's emulation, which runs moe-fsm's
    torch experts: named, not tuned; the FP8 layers beside them still are."""
    as_platform("sm90-bare")
    code, lines, _ = dry_run(capsys, "--preset", "mixed-nvfp4-fp8")
    assert code == 0
    assert any("30 layers not tuned: nvfp4 experts: EMULATION (TorchExperts) decided, runs as TorchExperts; "
               "moe-fsm tune tunes moe-fsm's Triton kernels only" in line for line in lines)
    assert [line.split(" (")[0] for line in shape_lines(lines)] == ["shape E=256 N=64 K=256 top-8 fp8 tensor"]


@pytest.mark.parametrize("argv, message", [
    (("--config", str(CONFIGS / "kimi-k2-thinking"), "--policy", "vllm-0.33", "--tp", "128"),
     "a --tp 128 shard holds N=16, which its experts cannot take: int_wna16 group size (32) must evenly divide"),
    (("--config", str(CONFIGS / "gpt-oss-120b"), "--policy", "vllm-0.33", "--tp", "8"),
     "a --tp 8 shard holds N=360, which its experts cannot take: mxfp4 group size (32)"),
    (("--experts", "8", "--intermediate", "64", "--hidden", "64", "--top-k", "2", "--policy", "vllm-0.33"),
     "--policy decides the layers of --config or --preset"),
    (("--preset", "qwen3-30b-a3b-gptq-int4", "--policy", "vllm-9.99"), "vllm-9.99"),
])
def test_bad_weight_quantized_arguments_are_one_line(capsys, as_platform, argv, message):
    as_platform("sm90")
    code, _, err = dry_run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("tokens, top_k, layer", [
    (1, 8, KIMI_EP8), (8, 8, KIMI_EP8), (1, 4, dict(num_experts=128, top_k=4, hidden_size=2880, intermediate_size=1440)),
])
def test_decode_candidates_are_thin_tiles_in_one_pass_and_split_along_k(tokens, top_k, layer):
    e, n, k = layer["num_experts"], layer["intermediate_size"], layer["hidden_size"]
    found = candidate_wq_configs(tokens, top_k, e, n, k, sm_count=132)
    assert found[0] == default_wq_config(tokens, top_k, e, n, k, 132)
    assert len(found) == len(set(found)) > 10
    for config in found:
        config.check()
        assert config.block_m == 16
        assert all(config.gemm(which)[1] % SPLIT_CHUNK == 0 for which in ("w1", "w2"))  # the SPLIT layout's steps
    one_pass = [c for c in found if (c.splits("w1"), c.splits("w2")) == (1, 1)]
    split = [c for c in found if max(c.splits("w1"), c.splits("w2")) > 1]
    assert len(one_pass) >= 6 and len(split) >= 6
    assert len({(c.block_n, c.block_k, c.num_warps, c.num_stages) for c in found}) >= 6
    for config in split:  # every slice keeps at least two K tiles
        for which, cols in (("w1", k), ("w2", n)):
            assert -(-cols // config.gemm(which)[1]) >= 2 * config.splits(which) or config.splits(which) == 1


@pytest.mark.parametrize("tokens, block_ms, group_m", [(512, {32, 64}, 1), (8192, {64, 128}, 8)])
def test_prefill_candidates_are_wide_row_blocks(tokens, block_ms, group_m):
    e, n, k, top_k = 48, 2048, 7168, 8
    served = WqConfig(128, 64, 64, 4, 3, group_m=8)
    found = candidate_wq_configs(tokens, top_k, e, n, k, served=served)
    assert found[:2] == [default_wq_config(tokens, top_k, e, n, k), served]
    assert {c.block_m for c in found[2:]} == block_ms
    assert {c.group_m for c in found[2:]} == {group_m}
    assert all(c.splits("w1") == c.splits("w2") == 1 for c in found)


@pytest.mark.parametrize("tokens, default_takes_it", [(512, False), (1536, False), (8192, True)])
def test_the_bf16_hopper_path_is_a_candidate_past_the_mid_counts(tokens, default_takes_it):
    """Past 96 pairs an expert the tuner tries the dequantize-into-bf16 Hopper path, below the default rule's 256."""
    e, n, k, top_k = 64, 2048, 7168, 8  # 512 tokens: 64 pairs an expert; 1536: 192; 8192: 1024
    found = candidate_wq_configs(tokens, top_k, e, n, k)
    hopper = [c for c in found if c.hopper_bf16]
    assert len(hopper) == (0 if tokens == 512 else 1)
    assert found[0].hopper_bf16 is default_takes_it


def test_the_user_table_is_read_over_the_shipped_one_count_by_count(tmp_path, monkeypatch):
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    quant = WeightQuant("int4", 128)
    shipped = get_wq_config(SHIPPED_DEVICE, quant, 128, 768, 2048, 8, 8192)
    tuned = WqConfig(16, 32, 256, 4, 4, split_k=3, w2_split_k=2)
    path = tables.write_user_table(SHIPPED_DEVICE, SHIPPED_KEY, {1: tuned.to_json()})
    assert path == tmp_path / "wq_NVIDIA_H100_80GB_HBM3.json"
    assert get_wq_config(SHIPPED_DEVICE, quant, 128, 768, 2048, 8, 1) == tuned
    assert get_wq_config(SHIPPED_DEVICE, quant, 128, 768, 2048, 8, 8192) == shipped  # a count the user did not tune
    # a shape no table holds: the default rule
    assert get_wq_config(SHIPPED_DEVICE, quant, 64, 768, 2048, 8, 1) == default_wq_config(1, 8, 64, 768, 2048)


def test_writing_merges_into_the_users_table(tmp_path):
    first = WqConfig(16, 64, 128, 4, 4)
    second = WqConfig(64, 128, 128, 8, 3)
    tables.write_user_table("Test GPU", "a", {1: first.to_json(), 512: first.to_json()}, tmp_path)
    tables.write_user_table("Test GPU", "b", {8: first.to_json()}, tmp_path)
    path = tables.write_user_table("Test GPU", "a", {512: second.to_json()}, tmp_path)
    data = json.loads(path.read_text())
    assert data == {"a": {"1": first.to_json(), "512": second.to_json()}, "b": {"8": first.to_json()}}


@pytest.mark.parametrize("text", ["[1, 2]", '{"configs": {"E=8": {}}}', '{"a": {"1": {"block_m": "x"}}}', "not json"])
def test_a_file_moe_fsm_did_not_make_is_never_replaced(tmp_path, text):
    path = tmp_path / tables.table_file_name("Test GPU")
    path.write_text(text)
    with pytest.raises(KernelInputError, match="moe-fsm does not replace it"):
        tables.write_user_table("Test GPU", "a", {1: WqConfig(16).to_json()}, tmp_path)
    assert path.read_text() == text


@pytest.mark.parametrize("content, message", [
    (b'{"a": [1]}', "is not a JSON object of shape keys"),
    (b"\x80\x81 binary", "is not UTF-8 text"),  # was a UnicodeDecodeError
    (b"\xff\xfe{}", "is UTF-16 text"),
])
def test_a_broken_user_table_is_one_error_naming_it_at_lookup_and_is_never_replaced(tmp_path, monkeypatch, content,
                                                                                    message):
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    path = tmp_path / tables.table_file_name("Broken GPU")
    path.write_bytes(content)
    tables.load_user_table.cache_clear()
    with pytest.raises(KernelInputError, match=f"{tmp_path}.*{message}"):
        get_wq_config("Broken GPU", WeightQuant("int4", 128), 8, 64, 64, 2, 1)
    with pytest.raises(KernelInputError, match="moe-fsm does not replace it"):
        tables.write_user_table("Broken GPU", "a", {1: WqConfig(16).to_json()}, tmp_path)
    assert path.read_bytes() == content


def refuse_split_k(candidate) -> None:
    """A screening trial that refuses every split-K tile, as one that does not build would (top-level: the child
    process imports it by name)."""
    if max(candidate[2].splits("w1"), candidate[2].splits("w2")) > 1:
        raise RuntimeError("refused by the test")


def test_the_run_writes_the_fastest_screened_tile_and_never_a_refused_one(tmp_path, monkeypatch):
    """Screening in real child processes, timing faked (no GPU): the run times only what passed, writes each count's
    fastest into the user's table, which the runtime's lookup then serves."""
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    layer = MoELayer(quant=QuantScheme.int_wna16(4, 32, checkpoint="gptq"), dtype="bfloat16", **KIMI_EP8)
    shape = WqLayerShape(layer, TRITON_WNA16)
    timed: dict = {}

    def fake_time(shape_, plan, deadline):
        timed.update(plan)
        best = {t: configs[-1] for t, configs in plan.items()}  # the last screened tile is "fastest"
        return best, {t: 10.0 * t for t in plan}, []

    lines: list[str] = []
    report = tune_and_write_wq([shape], [1, 512], workers=2, directory=None, log=lines.append, trial=refuse_split_k,
                               time_shape=fake_time, device="Test GPU", sm_count=132, candidate_timeout_s=120)
    assert report.refused and all("refused by the test" in r.reason for r in report.refused)
    refused = {(r.candidate[1], r.candidate[2]) for r in report.refused}
    assert all(max(c.splits("w1"), c.splits("w2")) > 1 for _, c in refused)
    assert not refused & {(t, c) for t, cs in timed.items() for c in cs}
    assert report.path == tmp_path / "wq_Test_GPU.json"
    entries = json.loads(report.path.read_text())[shape.key()]
    assert set(entries) == {"1", "512"}
    for tokens in (1, 512):
        assert entries[str(tokens)] == timed[tokens][-1].to_json()
        assert get_wq_config("Test GPU", shape.quant, 48, 2048, 7168, 8, tokens) == timed[tokens][-1]
    assert shape.key() == "int4,g=32,zp=0,E=48,N=2048,K=7168,top_k=8"
    assert any(line.startswith("screened in") for line in lines)


def test_a_layers_key_is_the_runtimes(as_platform):
    layer = MoELayer(quant=QuantScheme.int_wna16(4, 128, checkpoint="gptq"), num_experts=128, top_k=8,
                     hidden_size=2048, intermediate_size=768)
    assert WqLayerShape(layer, TRITON_WNA16).key() == SHIPPED_KEY
    assert WqLayerShape(replace(layer, num_experts=64), TRITON_WNA16).key() != SHIPPED_KEY
