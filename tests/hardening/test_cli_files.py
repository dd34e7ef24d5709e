"""Issue 12, items 7, 8, 11 (select), 12, 13 and 18: files the CLI reads and writes, tampered traces, exit codes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from moe_fsm import MoELayer, QuantScheme, preset, select
from moe_fsm.cli.main import EXIT_STATUSES, main
from moe_fsm.errors import TraceWriteError
from moe_fsm.trace.document import MAX_FILE_BYTES

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = next((ROOT / "traces").glob("*/golden/fp8-block-sm90-auto.json"))
SELECT = ["select", "--platform", "sm90", "--quant", "fp8", "--no-env"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


# -- item 7: directories, unreadable, binary, deep, endless and huge files ---------------------------------------


@pytest.fixture
def bad_files(tmp_path):
    files = {}
    (tmp_path / "a_dir").mkdir()
    files["directory"] = (tmp_path / "a_dir", "is a directory, not a file")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    files["binary"] = (binary, "is not UTF-8 text")
    deep = tmp_path / "deep.json"
    deep.write_text(_deep_json(100_000))
    files["deep"] = (deep, "nests arrays or objects too deeply")
    files["dev_zero"] = (Path("/dev/zero"), "is a character device, not a regular file")  # refused before it is read
    big = tmp_path / "big.json"
    big.write_text('{"x": "' + "a" * MAX_FILE_BYTES + '"}')
    files["big"] = (big, f"is larger than {MAX_FILE_BYTES >> 20} MiB")
    nan = tmp_path / "nan.json"
    nan.write_text('{"schema": "moe-fsm/decision-trace", "x": NaN}')
    files["nan"] = (nan, "NaN is not a JSON value")
    if os.geteuid() != 0:
        locked = tmp_path / "locked.json"
        locked.write_text("{}")
        locked.chmod(0)
        files["unreadable"] = (locked, "Permission denied")
    return files


@pytest.mark.parametrize("verb", [["explain"], ["replay"], ["select", "--input"], ["diagram", "--check"]])
@pytest.mark.parametrize("kind", ["directory", "binary", "deep", "dev_zero", "big", "nan", "unreadable"])
def test_bad_files_are_one_line_and_exit_2(verb, kind, bad_files, capsys):
    if kind not in bad_files:
        pytest.skip("root reads any file")
    if kind == "nan" and verb[0] == "diagram":
        pytest.skip("diagram reads markdown, not JSON")
    path, message = bad_files[kind]
    if verb[0] == "diagram" and kind == "deep":
        message = "has no generated diagram part"
    code, _, err = run(capsys, *verb, str(path))
    assert code == 2 and message in err and err.count("\n") <= 2, err


def test_deep_toml_input_is_refused(tmp_path, capsys):
    (tmp_path / "deep.toml").write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    code, _, err = run(capsys, "select", "--input", "deep.toml")
    assert code == 2 and "deep.toml" in err


# -- item 8: trace writes that fail name the file and the layer, exit 4 ------------------------------------------------


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_trace_directory(tmp_path, capsys):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    code, _, err = run(capsys, *SELECT, "--layer-name", "L7", "--trace-out", str(locked / "t.json"))
    assert code == 4 and "the decision trace of layer 'L7' was not written" in err and "Permission denied" in err


def test_trace_out_under_a_file_or_on_a_directory(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    code, _, err = run(capsys, *SELECT, "--trace-out", str(tmp_path / "afile" / "t.json"))
    assert code == 4 and "afile is a file, not a directory" in err
    (tmp_path / "adir").mkdir()
    code, _, err = run(capsys, *SELECT, "--trace-out", str(tmp_path / "adir"))
    assert code == 4 and "is a directory" in err


def test_run_trace_dir_that_is_a_file_is_refused_before_any_layer(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    code, out, err = run(capsys, "run", "--layers", "1", "--tokens", "1", "--repeats", "1", "--trace-dir", str(tmp_path / "afile"))
    assert code == 4 and "afile is a file, not a directory" in err and "model.layers.0" not in out + err


def test_a_full_disk_is_a_trace_write_error(tmp_path):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    from moe_fsm.trace import document

    real = document.tempfile.mkstemp

    def on_full_disk(*args, **kwargs):
        fd, name = real(*args, **kwargs)
        os.dup2(os.open("/dev/full", os.O_WRONLY), fd)
        return fd, name

    document.tempfile.mkstemp = on_full_disk
    try:
        with pytest.raises(TraceWriteError, match="No space left on device") as caught:
            select(MoELayer(quant=QuantScheme.fp8()), platform=preset("sm90"), env={}, layer_name="L3", trace_path=tmp_path / "t.json")
    finally:
        document.tempfile.mkstemp = real
    assert "layer 'L3'" in str(caught.value) and not list(tmp_path.iterdir())


def test_long_layer_names(tmp_path, capsys):
    name = "model." + "x" * 300 + ".experts"
    code, _, err = run(capsys, *SELECT, "--layer-name", name, "--trace-out", str(tmp_path / f"{name}.json"))
    assert code == 4 and "File name too long" in err and "(the file name has 319 characters)" in err
    from moe_fsm.plan.decider import LayerSpec, trace_file_name

    short = trace_file_name(3, LayerSpec(name, MoELayer()))
    assert len(short) < 140 and short.startswith("layer003-model.xxx")
    assert short != trace_file_name(3, LayerSpec(name + "y", MoELayer()))


# -- item 11: select does not overwrite its earlier trace ------------------------------------------------------------


def test_select_without_trace_out_keeps_earlier_traces(tmp_path, capsys):
    for _ in range(3):
        assert run(capsys, *SELECT)[0] == 0
    names = sorted(p.name for p in (tmp_path / "moe-fsm-traces").iterdir())
    assert names == ["decision-fp8-2.json", "decision-fp8-3.json", "decision-fp8.json"]


# -- item 12: tampered traces, escape codes ----------------------------------------------------------------------------


def test_explain_refuses_an_outcome_naming_an_unknown_backend(tmp_path, capsys):
    document = json.loads(GOLDEN.read_text())
    document["outcome"]["backend"] = "NOT_A_BACKEND"
    (tmp_path / "t.json").write_text(json.dumps(document))
    code, out, err = run(capsys, "explain", "t.json")
    assert code == 2 and "outcome names backend 'NOT_A_BACKEND'" in err and "SELECTED" not in out


def test_explain_and_select_show_escape_codes_instead_of_obeying_them(tmp_path, capsys):
    evil = "layer\x1b]0;pwned\x07\x1b[2J"
    code, out, err = run(capsys, *SELECT, "--layer-name", evil, "--trace-out", "t.json")
    assert code == 0 and "\x1b" not in out + err
    code, out, err = run(capsys, "explain", "t.json")
    assert code == 0 and "\x1b" not in out and "layer\\x1b]0;pwned\\x07\\x1b[2J" in out


def test_explain_without_jsonschema_refuses_a_malformed_trace(tmp_path, capsys, monkeypatch):
    from moe_fsm.trace import schema

    document = json.loads(GOLDEN.read_text())
    del document["outcome"]["backend"]
    document["inputs"]["layer"]["top_k"] = "eight"
    (tmp_path / "t.json").write_text(json.dumps(document))
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    schema._validator.cache_clear()
    try:
        for verb in ("explain", "replay"):
            code, _, err = run(capsys, verb, "t.json")
            assert code == 2 and "does not match the decision-trace schema" in err
    finally:
        schema._validator.cache_clear()


# -- item 13: distinct, documented exit codes --------------------------------------------------------------------------


def test_bad_input_and_failed_selection_have_different_exit_codes(capsys):
    assert run(capsys, *SELECT, "--experts", "zero")[0] == 2
    assert run(capsys, "select", "--platform", "sm90", "--quant", "fp8", "--no-env", "--backend", "fastest")[0] == 3
    help_text = run(capsys, "--help")[1]
    for line in EXIT_STATUSES.splitlines()[1:]:
        assert line.strip() in help_text


# -- item 18: golden --check outside the repository ---------------------------------------------------------------------


def test_golden_outside_the_repository_points_at_dir(capsys):
    code, _, err = run(capsys, "golden", "--check")
    assert code == 2 and "with --dir DIR" in err
    assert run(capsys, "golden", "--check", "--dir", str(ROOT / "traces"))[0] == 0


def test_explain_a_guard_event_without_its_step(tmp_path, capsys):
    """Found by the fuzz test: a guard kind newer than profiles, recorded without its step, made explain raise KeyError."""
    path = next(p for p in (ROOT / "traces").glob("*/golden/*.json") if '"force_backend"' in p.read_text())
    document = json.loads(path.read_text())
    for event in document["events"]:
        if event.get("guard") == "force_backend":
            del event["step"]
    (tmp_path / "t.json").write_text(json.dumps(document))
    code, out, _ = run(capsys, "explain", "t.json")
    assert code == 0 and "How the decision went" in out
