"""moe-fsm's commands under fastest-vllm-0.33: select, explain, replay, diff, plan and run take --speed-table (or
find this device's table in $MOE_FSM_SPEED_TABLE_DIR), show the figures they used, and refuse a bad table in one
line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_fsm.cli.main import main
from moe_fsm.inputs.speed import table_file_name

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "speed" / "nvidia_h100.json"
FASTEST = "fastest-vllm-0.33"
QWEN3 = ["--experts", "128", "--top-k", "8", "--hidden", "2048", "--intermediate", "768"]


@pytest.fixture(autouse=True)
def no_user_table(tmp_path, monkeypatch):
    """The user's own measured tables never leak into these tests."""
    monkeypatch.setenv("MOE_FSM_SPEED_TABLE_DIR", str(tmp_path / "speed-tables"))


def test_select_explain_and_replay_show_the_figures(tmp_path, capsys):
    trace = tmp_path / "t.json"
    code = main(["select", *QWEN3, "--platform", "sm90", "--no-env", "--policy", FASTEST,
                 "--speed-table", str(FIXTURE), "--trace-out", str(trace)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "path: start -> measured_scan -> selected" in out and "SELECTED: TORCH_GROUPED_MM" in out
    assert f"speed:    table {FIXTURE} (measured on NVIDIA H100, 2026-11-27" in out
    assert "TRITON                   20.0       60.0      400.0       78.3  eligible: the base profile's choice" in out
    assert "chose TORCH_GROUPED_MM (the base profile chooses TRITON)" in out
    assert main(["explain", str(trace)]) == 0
    explained = capsys.readouterr().out
    section = explained[explained.index("Measured speed"):explained.index("Why candidates were rejected")]
    assert "TORCH_GROUPED_MM         18.0       50.0      380.0       69.9  chosen: no slower than TRITON" in section
    assert "FLASHINFER_CUTLASS       30.0       55.0      300.0       79.1  no: slower than TRITON at 1 token" in section
    assert main(["replay", str(trace)]) == 0
    assert "byte-identical" in capsys.readouterr().out


def test_explain_says_why_the_table_was_not_used(tmp_path, capsys):
    trace = tmp_path / "t.json"
    assert main(["select", *QWEN3, "--platform", "sm100", "--no-env", "--policy", FASTEST,
                 "--speed-table", str(FIXTURE), "--trace-out", str(trace)]) == 0
    capsys.readouterr()
    assert main(["explain", str(trace)]) == 0
    assert ("not used: the speed table was measured on 'NVIDIA H100', not on this device "
            "(E=128,N=768,K=2048,topk=8,dtype=bfloat16,quant=unquantized on NVIDIA B200); decided as the base profile"
            in capsys.readouterr().out)


def test_the_table_is_found_in_the_config_directory_by_device_name(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "tables"
    folder.mkdir()
    (folder / table_file_name("NVIDIA H100")).write_text(FIXTURE.read_text())
    monkeypatch.setenv("MOE_FSM_SPEED_TABLE_DIR", str(folder))
    assert main(["select", *QWEN3, "--platform", "sm90", "--no-env", "--policy", FASTEST,
                 "--trace-out", str(tmp_path / "t.json")]) == 0
    assert "SELECTED: TORCH_GROUPED_MM" in capsys.readouterr().out


def test_a_bad_table_is_one_line_naming_the_field(tmp_path, capsys):
    bad = json.loads(FIXTURE.read_text())
    bad["measured"]["date"] = "yesterday"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    code = main(["select", *QWEN3, "--platform", "sm90", "--no-env", "--policy", FASTEST, "--speed-table", str(path)])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert f"speed table {path}: 'measured.date' must be YYYY-MM-DD, got 'yesterday'" in err


def test_diff_shows_where_the_measured_scan_parts_from_vllm(capsys):
    code = main(["diff", "--policy", "vllm-0.33", "--policy", FASTEST, *QWEN3, "--platform", "sm90", "--no-env",
                 "--speed-table", str(FIXTURE)])
    out = capsys.readouterr().out
    assert code == 1, out  # the decisions differ
    assert "TRITON (TritonExperts)" in out and "TORCH_GROUPED_MM (GroupedMMExperts)" in out
    assert "enter measured_scan" in out


def _qwen3_table(tmp_path, key: str) -> Path:
    table = json.loads(FIXTURE.read_text())
    table["shapes"] = {key: {"tokens": {"1": {"TRITON": 20.0, "TORCH_GROUPED_MM": 10.0}}}}
    path = tmp_path / "qwen3.json"
    path.write_text(json.dumps(table))
    return path


def test_plan_orders_every_layer_of_a_checkpoint_by_the_table(tmp_path, capsys):
    config = ROOT / "tests" / "data" / "configs" / "qwen3-30b-a3b"
    key = "E=128,N=768,K=2048,topk=8,dtype=bfloat16,quant=unquantized"
    code = main(["plan", str(config), "--platform", "sm90", "--no-env", "--policy", FASTEST,
                 "--speed-table", str(_qwen3_table(tmp_path, key)), "--trace-dir", str(tmp_path / "plan")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "-> TORCH_GROUPED_MM (GroupedMMExperts, via measured_scan" in out
    document = json.loads(next((tmp_path / "plan").glob("layer*.json")).read_text())
    assert document["inputs"]["speed_table"]["shapes"].keys() == {key}


def test_run_takes_the_table_and_refuses_a_bad_one_before_starting(tmp_path, capsys):
    # the qwen3-30b-a3b preset is the model at sizes / 8: hidden 256, intermediate 96
    key = "E=128,N=96,K=256,topk=8,dtype=bfloat16,quant=unquantized"
    table = _qwen3_table(tmp_path, key)
    code = main(["run", "--preset", "qwen3-30b-a3b", "--layers", "1", "--platform", "sm90", "--policy", FASTEST,
                 "--speed-table", str(table), "--trace-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "TORCH_GROUPED_MM" in out
    code = main(["run", "--preset", "qwen3-30b-a3b", "--nproc", "2", "--policy", FASTEST,
                 "--speed-table", str(tmp_path / "missing.json")])
    assert code != 0 and "missing.json: cannot be read" in capsys.readouterr().err
