"""`moe-fsm tune` without a GPU: which layer shapes it takes from a config.json, a preset or its flags (tp/ep
shards included), what it refuses, and the candidates it offers every kernel variant of."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_fsm.cli.main import main
from moe_fsm.kernels.triton_moe.config import default_config, validate_config
from moe_fsm.kernels.triton_moe.tuning import LayerShape, candidate_configs

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def dry_run(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(["tune", *argv, "--dry-run"])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


@pytest.mark.parametrize("argv, expected", [
    ((), "shape E=256 N=2048 K=7168 top-8 fp8 block"),
    (("--tp", "8"), "shape E=256 N=256 K=7168 top-8 fp8 block"),
    (("--ep", "8"), "shape E=32 N=2048 K=7168 top-8 fp8 block"),
])
def test_a_config_json_gives_its_moe_layers_shape_as_one_rank_holds_it(capsys, argv, expected):
    code, lines, _ = dry_run(capsys, "--config", str(CONFIGS / "deepseek-v3"), *argv)
    assert code == 0
    assert lines == [f"{expected} ({CONFIGS / 'deepseek-v3'}, layers 3-60)"]


@pytest.mark.parametrize("name, argv, expected", [
    ("glm-4.5-air-fp8", ("--tp", "2"), "shape E=128 N=704 K=4096 top-8 fp8 channel"),
    ("qwen3-30b-a3b", ("--ep", "2"), "shape E=64 N=768 K=2048 top-8 bfloat16"),
    ("mixtral-8x7b", ("--tp", "4"), "shape E=8 N=3584 K=4096 top-2 bfloat16"),
])
def test_other_checkpoints_and_shards(capsys, name, argv, expected):
    code, lines, _ = dry_run(capsys, "--config", str(CONFIGS / name), *argv)
    assert code == 0
    assert [line.split(" (")[0] for line in lines if line.startswith("shape ")] == [expected]


def test_each_distinct_layer_of_a_mixed_checkpoint_once(capsys, as_platform):
    """Its NVFP4 layers too: on Hopper they run the Triton NVFP4 stand-in, whose tiles are tuned
    (test_tune_weight_quantized.py)."""
    as_platform("sm90")
    code, lines, _ = dry_run(capsys, "--config", str(CONFIGS / "synthetic-mixed-nvfp4-fp8"))
    assert code == 0
    shapes = [line for line in lines if line.startswith("shape ")]
    assert [s.split(" (")[0] for s in shapes] == ["shape E=128 N=768 K=2048 top-8 bfloat16",
                                                  "shape E=128 N=768 K=2048 top-8 nvfp4 g16 bfloat16",
                                                  "shape E=128 N=768 K=2048 top-8 fp8 tensor"]
    assert shapes[2].endswith("layers 3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47)")


def test_a_checkpoint_with_no_tunable_layer_is_one_clear_line(capsys):
    """Kimi-K2's INT4 layers under the seeds profile, which has no int_wna16 policy: named with the profiles that
    have one."""
    code, lines, err = dry_run(capsys, "--config", str(CONFIGS / "kimi-k2-thinking"), "--policy", "seeds")
    assert code == 2
    assert "not tuned: int_wna16 experts: seeds selects no kernel for them (NoPolicyError" in lines[0]
    assert "vllm-0.33" in lines[0]
    assert ("no MoE layer moe-fsm tune can tune (16-bit or FP8 w8a8 experts, or experts that run moe-fsm's "
            "weight-quantized Triton kernels)") in err
    assert "Traceback" not in err


def test_a_preset_gives_its_layers_at_the_preset_sizes(capsys):
    code, lines, _ = dry_run(capsys, "--preset", "deepseek-v3")
    assert (code, lines) == (0, ["shape E=256 N=256 K=896 top-8 fp8 block (preset deepseek-v3, 58 layers)"])


@pytest.mark.parametrize("argv, message", [
    (("--config", str(CONFIGS / "qwen3-30b-a3b"), "--tp", "5"), "intermediate size 768 does not split over --tp 5"),
    (("--config", str(CONFIGS / "qwen3-30b-a3b"), "--ep", "3"), "128 experts do not split over --ep 3"),
    (("--config", str(CONFIGS / "qwen3-30b-a3b"), "--tp", "0"), "--tp must be 1 or more"),
    (("--experts", "8", "--intermediate", "64", "--hidden", "64", "--top-k", "2", "--tp", "2"),
     "--tp and --ep shard the layers of --config or --preset"),
    (("--preset", "qwen3-30b-a3b", "--shape", "mixtral-8x7b"), "give one of --shape, --preset, --config"),
    (("--preset", "no-such-model",), "model preset 'no-such-model' is not one of"),
    (("--config", str(CONFIGS / "qwen3-30b-a3b"), "--budget-s", "0"), "--budget-s must be a positive number"),
    (("--config", str(CONFIGS / "qwen3-30b-a3b"), "--workers", "0"), "--workers must be 1 or more"),
])
def test_bad_tune_arguments_are_one_line_naming_what_is_accepted(capsys, argv, message):
    code, _, err = dry_run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_a_tp_shard_of_block_fp8_off_the_scale_grid_is_not_tuned(capsys, tmp_path):
    """A config.json: the plan package's reader says why (vLLM refines the blocks, moe-fsm's FP8 takes 128x128);
    a preset, which no reader checks: tune's own refusal."""
    config = json.loads((CONFIGS / "deepseek-v3" / "config.json").read_text())
    config["moe_intermediate_size"] = 2304  # / 2 = 1152, a multiple of 128; / 4 = 576 is not
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, lines, _ = dry_run(capsys, "--config", str(tmp_path), "--tp", "2")
    assert code == 0 and lines[0].startswith("shape E=256 N=1152 K=7168")
    code, lines, err = dry_run(capsys, "--config", str(tmp_path), "--tp", "4")
    assert code == 2 and "per-rank intermediate size 576" in lines[0] and "no MoE layer" in err
    code, _, err = dry_run(capsys, "--preset", "deepseek-v3", "--tp", "4")
    assert code == 2 and "holds N=64, not a multiple of the 128-wide scale blocks" in err


@pytest.mark.parametrize("shape, tokens", [
    (LayerShape(256, 2048, 7168, 8, fp8="block"), 8192),
    (LayerShape(128, 768, 2048, 8), 2048),
    (LayerShape(8, 14336, 4096, 2, fp8="tensor"), 512),
])
def test_candidates_cover_every_kernel_variant_with_the_default_first(shape, tokens):
    """Pointer-load tiles, the TMA kernels (persistent, gathered input, paired, flattened), the Gluon kernel for
    block FP8, and at a decode count the swap-AB thin tiles; every candidate is a config the kernels accept."""
    block_fp8 = shape.fp8 == "block"
    found = candidate_configs(shape, tokens, hopper=True, gluon=True)
    assert found[0] == default_config(shape.num_experts, shape.intermediate, shape.hidden, shape.top_k, tokens,
                                      block_fp8=block_fp8, fp8=shape.fp8 is not None)
    assert len(found) == len(set(found))
    for config in found:
        validate_config(config, block_fp8=block_fp8)
    assert any(not c.hopper for c in found)
    assert any(c.hopper and c.w1.persistent for c in found)
    assert any(c.hopper and c.gather_input for c in found)
    assert any(c.hopper and c.w1.paired for c in found)
    assert any(c.gluon for c in found) == block_fp8
    decode = candidate_configs(shape, 1, hopper=True, gluon=True)
    assert any(c.w1.swap_ab for c in decode) and not any(c.hopper for c in decode)
    assert not any(c.hopper or c.gluon for c in candidate_configs(shape, tokens, hopper=False, gluon=False)[1:])
