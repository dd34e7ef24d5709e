"""MOE_FSM_PLATFORM: the probe reports a named preset, and every trace says it was not probed."""

from __future__ import annotations

import json

import pytest

from moe_fsm.cli.main import main
from moe_fsm.errors import InputError
from moe_fsm.inputs.platform import PRESETS, PlatformFacts, probe, probe_override


@pytest.mark.parametrize("name", ["cpu-x86", "cpu-x86-amx", "cpu-arm", "sm90"])
def test_the_probe_reports_the_named_preset(name, monkeypatch):
    monkeypatch.setenv("MOE_FSM_PLATFORM", name)
    facts = probe()
    assert facts.probe_override == name
    assert PlatformFacts.from_json({**PRESETS[name].to_json(), "probe_override": name}) == facts
    assert facts != PRESETS[name], "a reported preset is a different record from one the caller gave"
    assert facts.to_json()["probe_override"] == name


@pytest.mark.parametrize("value", ["", "probe", "  "])
def test_unset_empty_or_probe_reads_the_machine(value, monkeypatch):
    monkeypatch.setenv("MOE_FSM_PLATFORM", value)
    assert probe_override() is None
    facts = probe()
    assert facts.probe_override is None and "probe_override" not in facts.to_json()


def test_an_unknown_preset_is_refused_with_the_accepted_names(monkeypatch):
    monkeypatch.setenv("MOE_FSM_PLATFORM", "cpu-epyc")
    with pytest.raises(InputError, match=r"MOE_FSM_PLATFORM='cpu-epyc' is not a platform preset; accepted: \[.*'cpu-x86'"):
        probe()
    with pytest.raises(InputError, match="probe_override 'cpu-epyc' is not a platform preset"):
        PlatformFacts.from_json({**PRESETS["cpu"].to_json(), "probe_override": "cpu-epyc"})


def test_select_explain_replay_carry_the_override(as_platform, tmp_path, capsys):
    as_platform("cpu-x86")
    trace = tmp_path / "sel.json"
    assert main(["select", "--quant", "mxfp4", "--policy", "vllm-0.33", "--trace-out", str(trace)]) == 3
    recorded = json.loads(trace.read_text())["inputs"]["platform"]
    assert recorded["probe_override"] == "cpu-x86" and recorded["cpu_arch"] == "x86" and "cpu_amx" not in recorded
    capsys.readouterr()
    assert main(["explain", str(trace)]) == 0
    shown = capsys.readouterr().out
    assert "x86 without AMX tiles" in shown and "[not probed: MOE_FSM_PLATFORM=cpu-x86]" in shown
    assert main(["replay", str(trace)]) == 0


def test_the_cli_refuses_a_bad_override_with_exit_2(monkeypatch, as_platform, capsys):
    as_platform("sm99")
    assert main(["select", "--quant", "fp8"]) == 2
    assert "MOE_FSM_PLATFORM='sm99' is not a platform preset" in capsys.readouterr().err
