"""An integer no float can hold, in any JSON or TOML file a command reads, is one line naming the file, exit 2.

Past 4300 digits Python's int() refuses to read one (json and tomllib raised ValueError: a traceback); from
about 309 digits up one is read but fails where it meets a float (``swiglu_limit``, sizes: OverflowError);
TOML's 0x/0o/0b integers have no length limit at all and could not even be printed in an error message.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from moe_fsm.cli.main import main
from moe_fsm.errors import InputError
from moe_fsm.trace.document import parse_json, parse_toml

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = next((ROOT / "traces").glob("seeds/golden/fp8-block-sm90-auto.json"))
SCENARIOS = ROOT / "traces" / "seeds" / "scenarios"
CONFIG = ROOT / "tests" / "data" / "configs" / "qwen3-30b-a3b" / "config.json"

PAST_DIGIT_LIMIT = "9" * 5000  # int() refuses to read it
PAST_FLOAT = "9" * 400  # read, but float() overflows


def _files(tmp_path: Path, number: str) -> dict[str, tuple[list[str], str]]:
    """Each reader's file holding ``number``: name -> (argv, the path the refusal names)."""
    trace = json.loads(GOLDEN.read_text())
    (tmp_path / "trace.json").write_text(json.dumps(trace).replace('"top_k": 8', f'"top_k": {number}', 1))
    assert main(["plan", str(CONFIG), "--platform", "sm90", "--no-env", "--policy", "seeds",
                 "--trace-dir", str(tmp_path / "plan")]) == 0
    manifest = tmp_path / "plan" / "plan.manifest"
    manifest.write_text(manifest.read_text().replace('"index": 3', f'"index": {number}', 1))
    (tmp_path / "spec.json").write_text(f'{{"layer": {{"quant": "fp8", "experts": {number}}}}}')
    (tmp_path / "spec.toml").write_text(f'[layer]\nquant = "fp8"\nexperts = {number}\n')
    scenarios = tmp_path / "golden" / "seeds" / "scenarios"
    scenarios.mkdir(parents=True)
    text = (SCENARIOS / "cpu-presets.toml").read_text()
    (scenarios / "cpu-presets.toml").write_text(text.replace("[[scenario]]", f"[[scenario]]\nexperts = {number}", 1))
    shutil.copytree(ROOT / "traces" / "seeds" / "golden", tmp_path / "golden" / "seeds" / "golden")
    config = tmp_path / "config" / "config.json"
    config.parent.mkdir()
    config.write_text(CONFIG.read_text().replace('"num_hidden_layers": 48', f'"num_hidden_layers": {number}', 1))
    return {
        "explain": (["explain", "trace.json"], "trace file trace.json"),
        "replay": (["replay", "trace.json"], "trace file trace.json"),
        "explain a manifest": (["explain", str(manifest), "--layer", "3"], f"{manifest}"),
        "select --input JSON": (["select", "--input", "spec.json", "--no-env"], "input file spec.json"),
        "select --input TOML": (["select", "--input", "spec.toml", "--no-env"], "input file spec.toml"),
        "diff --input": (["diff", "--input", "spec.json", "--from", "seeds", "--to", "vllm-0.33"], "input file spec.json"),
        "golden": (["golden", "--dir", "golden", "--profile", "seeds"], "cpu-presets.toml"),
        "plan": (["plan", str(config.parent), "--platform", "sm90", "--no-env", "--trace-dir", "t"], f"model config {config}"),
    }


READERS = ["explain", "replay", "explain a manifest", "select --input JSON", "select --input TOML", "diff --input",
           "golden", "plan"]


@pytest.mark.parametrize("number", [PAST_DIGIT_LIMIT, PAST_FLOAT], ids=["5000 digits", "400 digits"])
@pytest.mark.parametrize("reader", READERS)
def test_a_huge_integer_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys, reader, number):
    monkeypatch.chdir(tmp_path)
    argv, names = _files(tmp_path, number)[reader]
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in out + err and err.count("\n") == 1, err
    assert f"{names} holds an integer" in err and "past the range of a float" in err, err
    if number is PAST_FLOAT:  # read, so the refusal says where it stands
        assert " at " in err, err


def test_toml_integers_of_any_base_are_bounded_and_the_place_is_named():
    with pytest.raises(InputError, match=r"f\.toml holds an integer at layer\.experts\[1\], past the range"):
        parse_toml("[layer]\nexperts = [1, 0x" + "f" * 5000 + "]\n", "f.toml")
    with pytest.raises(InputError, match=r"f\.toml holds an integer at b, past"):
        parse_toml("a = 1\nb = 0o7" + "0" * 400 + "\n", "f.toml")
    assert parse_toml(f"a = {sys.maxsize}\nb = 0x{'f' * 200}\n", "f.toml") == {"a": sys.maxsize, "b": int("f" * 200, 16)}


def test_the_largest_integers_a_float_holds_are_read_and_booleans_are_not_integers():
    largest = int(sys.float_info.max)
    assert parse_json(f'{{"a": [{largest}, {-largest}, true]}}', "f.json") == {"a": [largest, -largest, True]}
    with pytest.raises(InputError, match=r"f\.json holds an integer at a\[0\], past"):
        parse_json(f'{{"a": [{largest + 10 ** 300}]}}', "f.json")


def test_the_place_of_a_huge_integer_is_named_without_the_keys_control_characters():
    """A key from the file is shown by repr unless it is a plain name: its newline cannot start a line, its ESC act."""
    with pytest.raises(InputError) as caught:
        parse_json(f'{{"layer": {{"a\\nb\\u001b[2J": [1, {10 ** 400}]}}}}', "f.json")
    assert "f.json holds an integer at layer['a\\nb\\x1b[2J'][1], past" in str(caught.value)
    assert not any(c in str(caught.value) for c in "\n\x1b")


@pytest.mark.parametrize("number", ["1e999", "-1e400", "1.7976931348623159e308"])
def test_a_float_past_a_floats_range_is_refused_where_it_would_read_as_infinity(number):
    """json reads 1e999 as inf; moe-fsm's files (traces, specs, manifests) never hold one, so it is refused by name."""
    with pytest.raises(InputError, match=rf"f\.json is not valid JSON: {re.escape(number)} is past a float's range"):
        parse_json(f'{{"swiglu_limit": {number}}}', "f.json")
    assert parse_json('{"a": 1.7976931348623157e308, "b": 1e-400}', "f.json") == {"a": sys.float_info.max, "b": 0.0}
    # model configs may hold non-finite values (parse_json(non_finite=True)): read as Python reads them
    assert parse_json(f'{{"a": {number}}}', "config.json", non_finite=True)["a"] in (float("inf"), float("-inf"))
