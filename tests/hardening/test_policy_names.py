"""An explicit policy names a profile (issue 24, item 5): an unknown name is refused with the list, never replaced by
the nearest profile; nearest-profile resolution is the installed vLLM's default, or asked for as nearest:vllm-X.Y."""

from __future__ import annotations

import pytest

from moe_fsm import MoELayer, preset, profiles, select
from moe_fsm.cli.main import main
from moe_fsm.errors import InputError


@pytest.mark.parametrize("name", ["vllm-9.99", "vllm-0.33.1", "vllm-0.34", "0.33", "seed", ""])
def test_an_unknown_profile_name_is_refused_with_the_list(name):
    with pytest.raises(InputError, match=r"unknown policy profile .*known: \[.*'seeds', .*'vllm-0.33'\]"):
        select(MoELayer(), policy=name, env={}, platform=preset("sm90"))


def test_nearest_is_asked_for_explicitly_and_recorded():
    decision = select(MoELayer(), policy="nearest:vllm-9.99", env={}, platform=preset("sm90"))
    profile = decision.trace["inputs"]["profile"]
    assert profile["name"] == "vllm-0.33"
    assert "nearest to vLLM 9.99 was asked for (nearest:vllm-9.99)" in profile["reason"]
    assert "vllm-0.33 is the nearest older profile" in profile["reason"]
    assert profiles.choose("nearest:0.33.2").name == "vllm-0.33"  # a patch release of a profiled version
    assert profiles.choose("nearest:vllm-0.1").name == "seeds"  # older than every release profile
    with pytest.raises(InputError, match="'nearest:' takes a vLLM version"):
        profiles.choose("nearest:banana")


def test_the_installed_vllms_default_still_resolves_to_the_nearest(monkeypatch):
    monkeypatch.setattr(profiles, "installed_vllm", lambda: "9.99.0")
    profiles.resolve_default.cache_clear()
    try:
        choice = profiles.choose(None)
        assert choice.name == "vllm-0.33" and "vLLM 9.99.0 is installed beside moe-fsm" in choice.reason
        assert profiles.choose("default") == choice
    finally:
        profiles.resolve_default.cache_clear()


@pytest.mark.parametrize("argv, says", [
    (["diff", "--policy", "vllm-9.99", "--policy", "seeds"], "unknown policy profile 'vllm-9.99'; known: ["),
    (["diff", "--policy", "seeds", "--policy", "vllm-9.99"], "unknown policy profile 'vllm-9.99'; known: ["),
    (["diff", "--policy", "seeds"], "--policy is given twice to diff (from, then to), got 1"),
    (["diff", "--policy", "seeds", "--policy", "vllm-0.33", "--to", "seeds"], "not both"),
    (["diff", "--from", "vllm-9.99"], "(or 'nearest:vllm-9.99' for the nearest older profile"),
    (["diff", "--to", "seeds", "--to", "vllm-0.33"], "--to given twice"),
    (["select", "--policy", "vllm-9.99"], "unknown policy profile 'vllm-9.99'"),
    (["select", "--policy", "seeds", "--policy", "vllm-0.33"], "--policy given twice"),
    (["plan", "config.json", "--policy", "vllm-0.34"], "unknown policy profile 'vllm-0.34'"),
    (["run", "--policy", "seeds", "--policy", "vllm-0.33"], "--policy given twice"),
])
def test_the_cli_refuses_policy_names_that_name_no_profile(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text('{"num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64, '
                                          '"moe_intermediate_size": 64, "num_hidden_layers": 2}')
    assert main([*argv, "--platform", "sm90"] if argv[0] != "run" else argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_diff_takes_nearest_for_either_side(capsys):
    assert main(["diff", "--from", "seeds", "--to", "nearest:vllm-9.99", "--platform", "sm90", "--no-env"]) in (0, 1)
    assert "moe-fsm diff: seeds -> vllm-0.33" in capsys.readouterr().out
    assert main(["diff", "--policy", "nearest:vllm-0.1", "--policy", "nearest:vllm-9.99", "--platform", "sm90", "--no-env"]) in (0, 1)
    assert "moe-fsm diff: seeds -> vllm-0.33" in capsys.readouterr().out
