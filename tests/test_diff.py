"""`moe-fsm diff`: the same inputs under two profiles, with where and why the paths part.

The profiles compared here are built from data in the test (a profile is just data): the seeds
profile with FP8's LoRA shortcut removed and FlashInfer moved behind the other backends on SM90.
"""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType

import pytest

from moe_fsm import diff, profiles
from moe_fsm.backends.requirements import CudaCapability
from moe_fsm.cli.main import main
from moe_fsm.decision import make_inputs
from moe_fsm.fsm.policy import Reorder
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.platform import preset
from moe_fsm.inputs.quant import QuantFamily, QuantScheme

SEEDS = profiles.get("seeds")


@pytest.fixture
def next_profile():
    fp8 = SEEDS.policy(QuantFamily.FP8)
    reorder = Reorder(when=(CudaCapability(exact=((9, 0),)),), backends=("FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS"),
                      to="back", because="FlashInfer is slower than Triton on SM90")
    changed = dataclasses.replace(fp8, steps=tuple(s for s in fp8.steps if s.name != "lora_shortcut"),
                                  reorders=(reorder,))
    profile = profiles.register(dataclasses.replace(
        SEEDS, name="test-next", vllm_version=(99, 0),
        policies=MappingProxyType({**SEEDS.policies, QuantFamily.FP8: changed}),
    ))
    yield profile.name
    profiles.unregister(profile.name)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_reordered_scan_parts_inside_auto_scan(next_profile):
    inputs = make_inputs(MoELayer(quant=QuantScheme.fp8()), env={}, platform=preset("sm90"), policy="seeds")
    d = diff.diff_layer(inputs, "seeds", next_profile)
    assert not d.same_decision
    assert (d.before.outcome["backend"], d.after.outcome["backend"]) == ("FLASHINFER_CUTLASS", "DEEPGEMM")
    assert d.divergence.state == ("auto_scan", "auto_scan")  # the skipped LoRA guard is not a parting
    assert any(e["event"] == "reordered" for e in d.divergence.events[1])


def test_a_removed_step_parts_at_the_first_state(next_profile):
    inputs = make_inputs(MoELayer(quant=QuantScheme.fp8(), lora=True), env={}, platform=preset("sm90"))
    d = diff.diff_layer(inputs, "seeds", next_profile)
    assert d.before.document["path"] == ["start", "lora_shortcut", "selected"]
    assert d.divergence.segment == 0
    assert d.divergence.events[0][-1]["dest"] == "lora_shortcut"
    assert d.divergence.events[1][-1]["dest"] == "auto_scan"


def test_identical_decisions_do_not_part(next_profile):
    inputs = make_inputs(MoELayer(), env={}, platform=preset("sm90"))
    d = diff.diff_layer(inputs, "seeds", next_profile)
    assert d.same_decision and d.divergence is None


def test_cli_single_layer_defaults_to_the_newest_release(capsys, next_profile):
    code, out, _ = run(capsys, "diff", "--platform", "sm90", "--quant", "fp8", "--no-env")
    assert code == 1
    assert "moe-fsm diff: seeds -> test-next" in out
    assert "DIFFERENT decision; the paths part in auto_scan:" in out
    assert "moved FLASHINFER_TRTLLM, FLASHINFER_CUTLASS to the back" in out
    code, out, _ = run(capsys, "diff", "--to", next_profile, "--platform", "sm90", "--no-env")
    assert code == 0 and "same decision; the paths do not part" in out


def test_cli_preset_groups_layers_and_counts_the_changes(capsys, next_profile):
    code, out, _ = run(capsys, "diff", "--to", next_profile, "--preset", "mixed-nvfp4-fp8", "--platform", "sm90",
                       "--no-env")
    assert code == 1
    assert "layers 3,7,11,15,19,23,27,31,35,39 (10)" in out
    assert "10 of 40 layers decide differently under test-next than under seeds" in out
    code, out, _ = run(capsys, "diff", "--to", next_profile, "--preset", "mixed-nvfp4-fp8", "--platform", "sm90",
                       "--no-env", "--json")
    rows = json.loads(out)
    assert sorted(len(r["layers"]) for r in rows) == [10, 30]
    changed = next(r for r in rows if not r["same_decision"])
    assert changed["parts_at"]["states"] == ["auto_scan", "auto_scan"]


def test_cli_reports_env_a_profile_does_not_read(capsys, next_profile):
    narrower = dataclasses.replace(profiles.get(next_profile), name="test-narrow-env",
                                   env=SEEDS.env.__class__.of(SEEDS.env["VLLM_USE_DEEP_GEMM"]),
                                   policies=MappingProxyType({QuantFamily.UNQUANTIZED: SEEDS.policy(QuantFamily.UNQUANTIZED)}))
    unq = narrower.policies[QuantFamily.UNQUANTIZED]
    narrower = dataclasses.replace(narrower, policies=MappingProxyType({QuantFamily.UNQUANTIZED: dataclasses.replace(
        unq, steps=tuple(s for s in unq.steps if s.name != "flashinfer_preference"))}))
    profiles.register(narrower)
    try:
        code, out, _ = run(capsys, "diff", "--to", "test-narrow-env", "--platform", "sm100",
                           "--env", "VLLM_USE_FLASHINFER_MOE_FP16=1")
        assert "env it ignores" in out and "VLLM_USE_FLASHINFER_MOE_FP16" in out
    finally:
        profiles.unregister("test-narrow-env")


def test_cli_needs_two_profiles_and_known_names(capsys):
    code, _, err = run(capsys, "diff", "--to", "vllm-9.9", "--platform", "sm90", "--no-env")
    assert code == 2 and "unknown policy profile 'vllm-9.9'" in err


def test_readme_and_guide_diff_examples_are_true(capsys):
    """Every line the README and the commands guide show for a `moe-fsm diff` command is a line of its output ('...' elides)."""
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pages = "".join((root / page).read_text() for page in ("README.md", "docs/guide-commands.md"))
    blocks = [b for b in re.findall(r"```text\n(.*?)```", pages, re.DOTALL) if "$ moe-fsm diff" in b]
    assert blocks, "neither the README nor the guide shows a moe-fsm diff example"
    checked = 0
    for block in blocks:
        for command in re.split(r"^(?=\$ )", block, flags=re.M):
            if not command.startswith("$ moe-fsm diff"):
                continue
            first, *shown = command.rstrip("\n").split("\n")
            code, out, _ = run(capsys, *shlex.split(first[len("$ moe-fsm "):]))
            assert code in (0, 1)
            lines = out.splitlines()
            for line in shown:
                if line.strip() != "...":
                    assert line in lines, f"{first}: README line not in the output: {line!r}"
                    checked += 1
    assert checked >= 10
