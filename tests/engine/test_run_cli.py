"""`moe-fsm run`, the main job, through the CLI."""

import json

import pytest

from moe_fsm.cli.main import main


def test_run_prints_the_table_and_writes_one_trace_per_layer(tmp_path, capsys):
    code = main(["run", "--layers", "2", "--tokens", "8", "--env", "VLLM_USE_DEEP_GEMM=0", "--trace-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2/2 layers within tolerance of the float64 reference" in out
    assert "VLLM_USE_DEEP_GEMM=0" in out
    traces = sorted(tmp_path.glob("*.json"))
    assert [json.loads(p.read_text())["layer_name"] for p in traces] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_run_rejects_bad_flags_with_a_message(capsys):
    assert main(["run", "--tokens", "-1"]) == 2
    assert "--tokens must be 0 or more" in capsys.readouterr().err
    assert main(["run", "--env", "VLLM_USE_FLASHINFER_MOE_FP8=maybe", "--layers", "1"]) == 2
    assert "VLLM_USE_FLASHINFER_MOE_FP8='maybe' is not valid; accepted values: 0 or 1" in capsys.readouterr().err
    assert main(["run", "--device", "tpu"]) == 2
    assert "--device 'tpu' is not one of" in capsys.readouterr().err


def test_run_names_the_failing_layer(tmp_path, capsys):
    code = main(["run", "--preset", "mixed-nvfp4-fp8", "--layers", "4", "--backend", "emulation", "--trace-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert "layer 3 (model.layers.3.mlp.experts): moe_backend='emulation' is not supported for FP8 MoE" in err
    failed = json.loads((tmp_path / "layer003-model.layers.3.mlp.experts.json").read_text())
    assert failed["outcome"]["status"] == "failed"


@pytest.mark.distributed
def test_run_across_two_processes(tmp_path, capfd):
    code = main(["run", "--nproc", "2", "--layers", "2", "--tokens", "4", "--trace-dir", str(tmp_path)])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "AllToAllPrepareFinalize" in out and "2/2 layers within tolerance" in out
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [
        "layer000-model.layers.0.mlp.experts.rank0.json", "layer000-model.layers.0.mlp.experts.rank1.json",
        "layer001-model.layers.1.mlp.experts.rank0.json", "layer001-model.layers.1.mlp.experts.rank1.json",
    ]
