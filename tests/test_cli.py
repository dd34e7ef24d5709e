"""The `moe-fsm` command, run in-process through ``main([...])``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_fsm.cli.main import main
from moe_fsm import profiles
from moe_fsm.cli import diagram
from moe_fsm.fsm.machine import mermaid
from moe_fsm.inputs.quant import QuantFamily

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "traces" / "seeds" / "golden"

FP8_SM90 = ["--platform", "sm90", "--quant", "fp8", "--weight-scale", "block", "--no-env"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("VLLM_USE_FLASHINFER_MOE_FP8", "VLLM_USE_DEEP_GEMM", "VLLM_TEST_FORCE_FP8_MARLIN"):
        monkeypatch.delenv(name, raising=False)


# -- select -------------------------------------------------------------------------


def test_select_prints_the_path_and_writes_the_trace(capsys, tmp_path):
    code, out, err = run(capsys, "select", *FP8_SM90)
    assert code == 0, err
    assert "path: start -> auto_scan -> selected" in out
    assert "skip  flashinfer_preference  VLLM_USE_FLASHINFER_MOE_FP8 unset" in out
    assert "no    FLASHINFER_TRTLLM: needs compute capability 10.x, this is 9.0" in out
    assert "ok    FLASHINFER_CUTLASS -> FlashInferExperts" in out
    assert "SELECTED: FLASHINFER_CUTLASS" in out
    assert "prepare/finalize: LocalPrepareFinalize" in out
    written = tmp_path / "moe-fsm-traces" / "decision-fp8.json"
    assert f"trace written to {Path('moe-fsm-traces') / 'decision-fp8.json'}" in out
    document = json.loads(written.read_text())
    assert document["outcome"]["backend"] == "FLASHINFER_CUTLASS"
    assert "volatile" in document


def test_select_json_prints_the_trace(capsys, tmp_path):
    code, out, err = run(capsys, "select", *FP8_SM90, "--json", "--layer-name", "model.layers.3.mlp")
    assert code == 0, err
    document = json.loads(out)
    assert document["schema"] == "moe-fsm/decision-trace"
    assert document["layer_name"] == "model.layers.3.mlp"
    assert document["outcome"]["status"] == "selected"
    assert not (tmp_path / "moe-fsm-traces").exists()  # --json writes a file only with --trace-out


def test_select_json_with_trace_out_writes_both(capsys, tmp_path):
    code, out, err = run(capsys, "select", *FP8_SM90, "--json", "--trace-out", "t/x.json")
    assert code == 0
    assert json.loads(out) == json.loads((tmp_path / "t" / "x.json").read_text())
    assert "trace written to t/x.json" in err


def test_select_env_flags_reach_the_decision(capsys):
    code, out, _ = run(capsys, "select", *FP8_SM90, "--env", "VLLM_USE_FLASHINFER_MOE_FP8=0")
    assert code == 0
    assert "pruned FLASHINFER_TRTLLM, FLASHINFER_CUTLASS: VLLM_USE_FLASHINFER_MOE_FP8=0 rejects FlashInfer" in out
    assert "SELECTED: DEEPGEMM" in out


def test_select_reads_the_process_env_by_default(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_TEST_FORCE_FP8_MARLIN", "1")
    code, out, _ = run(capsys, "select", "--platform", "sm90", "--quant", "fp8")
    assert code == 0 and "SELECTED: MARLIN" in out
    code, out, _ = run(capsys, "select", "--platform", "sm90", "--quant", "fp8", "--no-env")
    assert code == 0 and "SELECTED: FLASHINFER_CUTLASS" in out
    # with any --env flag, only those count
    code, out, _ = run(capsys, "select", "--platform", "sm90", "--quant", "fp8", "--env", "VLLM_USE_DEEP_GEMM=1")
    assert code == 0 and "SELECTED: DEEPGEMM" in out


def test_selection_error_exits_3_and_still_writes_the_trace(capsys, tmp_path):
    code, out, err = run(capsys, "select", "--platform", "sm121", "--quant", "fp8", "--weight-scale", "tensor",
                         "--act-scale", "tensor", "--static-act", "--backend", "flashinfer_b12x", "--no-env")
    assert code == 3  # issue 12 item 13: 2 is bad input, 3 a failed selection
    assert "FAILED: BackendUnsupportedError" in out
    assert "moe_backend='flashinfer_b12x' is not supported for FP8 MoE" in err
    document = json.loads((tmp_path / "moe-fsm-traces" / "decision-fp8.json").read_text())
    assert document["outcome"]["status"] == "failed"
    assert "trace written to" in out


def test_select_per_family_mapping(capsys):
    code, out, _ = run(capsys, "select", "--platform", "sm121", "--quant", "fp8", "--weight-scale", "tensor",
                       "--act-scale", "tensor", "--static-act", "--backend", "nvfp4=flashinfer_b12x", "--no-env")
    assert code == 0
    assert "request:  auto for fp8: the mapping (nvfp4=flashinfer_b12x) does not name fp8" in out
    assert "SELECTED: FLASHINFER_CUTLASS" in out


def test_select_from_toml_and_json_input(capsys, tmp_path):
    (tmp_path / "layer.toml").write_text(
        '[layer]\nquant = "nvfp4"\nexperts = 64\ntop_k = 4\n\n[parallel]\ntp = 2\nep = 2\n\n[env]\n'
        'VLLM_USE_FLASHINFER_MOE_FP4 = "0"\n'
    )
    code, out, err = run(capsys, "select", "--input", "layer.toml", "--platform", "sm100")
    assert code == 0, err
    assert "64 experts, top-4" in out and "tp=2 dp=1 ep=2" in out
    assert "SELECTED: MARLIN" in out  # FlashInfer pruned, vLLM CUTLASS FP4 refuses EP
    (tmp_path / "layer.json").write_text(json.dumps({"layer": {"quant": "unquantized"}, "platform": "rocm-mi300",
                                                     "env": {"VLLM_ROCM_USE_AITER": "1"}}))
    code, out, _ = run(capsys, "select", "--input", "layer.json")
    assert code == 0 and "SELECTED: AITER" in out


def test_select_accepts_a_trace_as_input_with_overrides(capsys, tmp_path):
    trace = GOLDEN / "fp8-block-sm90-auto.json"
    code, out, _ = run(capsys, "select", "--input", str(trace), "--backend", "fp8=triton")
    assert code == 0
    assert "256 experts, top-8" in out  # from the trace
    assert "SELECTED: TRITON" in out
    code, out, _ = run(capsys, "select", "--input", str(trace), "--static-act", "--act-scale", "tensor",
                       "--weight-scale", "tensor")
    assert code == 0 and "fp8_e4m3 static tensor" in out


# -- bad input: one line, exit 2, never a traceback ------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--platform", "sm95"], "platform preset 'sm95' is not one of"),
    (["--platform", "sm90", "--env", "VLLM_USE_FLASHINFER_MOE_FP8=maybe"],
     "VLLM_USE_FLASHINFER_MOE_FP8='maybe' is not valid; accepted values: 0 or 1"),
    (["--platform", "sm90", "--env", "VLLM_FLASHINFER_MOE_BACKEND=fastest"],
     "VLLM_FLASHINFER_MOE_BACKEND='fastest' is not valid; accepted values: throughput, latency, masked_gemm"),
    (["--platform", "sm90", "--env", "VLLM_USE_FLASHINFER_MOE_FP9=1"], "unknown environment variable(s) ['VLLM_USE_FLASHINFER_MOE_FP9']"),
    (["--platform", "sm90", "--env", "NOEQUALS"], "must look like NAME=VALUE"),
    (["--platform", "sm90", "--backend", "int9=triton"], "backend mapping key 'int9' is not a quantization family"),
    (["--platform", "sm90", "--quant", "nvfp4", "--hidden", "100"], "NVFP4 needs hidden_size divisible by 16"),
    (["--platform", "sm90", "--quant", "fp8", "--act-scale", "group", "--static-act"], "FP8 activation scale 'group' (static)"),
    (["--platform", "sm90", "--experts", "2", "--top-k", "4"], "top_k=4 exceeds num_experts=2"),
    (["--platform", "sm90", "--weight-scale", "block"], "only apply to quantized layers"),
    (["--platform", "sm90", "--router-weight-on-input"], "router_weight_on_input needs top_k == 1"),
    (["--input", "missing.toml"], "input file missing.toml does not exist"),
])
def test_bad_input_is_one_clear_line(capsys, argv, message):
    code, out, err = run(capsys, "select", *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err + out


def test_unknown_backend_is_a_selection_error_naming_the_accepted_names(capsys):
    code, out, err = run(capsys, "select", "--platform", "sm90", "--quant", "fp8", "--backend", "fastest", "--no-env")
    assert code == 3
    assert "moe_backend='fastest' is not supported for FP8 MoE. Expected one of ['triton', 'deep_gemm'" in err


def test_argparse_errors_return_2(capsys):
    code, _, err = run(capsys, "select", "--experts", "zero")
    assert code == 2 and "'zero' is not an integer" in err
    code, _, err = run(capsys, "select", "--quant", "int4")
    assert code == 2 and "invalid choice" in err
    assert run(capsys)[0] == 2
    assert run(capsys, "--version")[0] == 0


def test_malformed_input_files(capsys, tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    code, _, err = run(capsys, "select", "--input", "bad.json")
    assert code == 2 and "is not valid JSON" in err
    (tmp_path / "bad.toml").write_text("[layer\n")
    code, _, err = run(capsys, "select", "--input", "bad.toml")
    assert code == 2 and "is not valid TOML" in err
    (tmp_path / "sections.json").write_text('{"layers": {}}')
    code, _, err = run(capsys, "select", "--input", "sections.json")
    assert code == 2 and "unknown section(s) ['layers']" in err
    (tmp_path / "field.json").write_text('{"layer": {"expert_count": 8}, "platform": "cpu"}')
    code, _, err = run(capsys, "select", "--input", "field.json")
    assert code == 2 and "unknown layer field 'expert_count'" in err


# -- explain ------------------------------------------------------------------------


def test_explain_tells_the_story(capsys, tmp_path):
    run(capsys, "select", *FP8_SM90, "--trace-out", "t.json")
    code, out, err = run(capsys, "explain", "t.json")
    assert code == 0, err
    for section in ("What was asked", "How the decision went", "Why candidates were rejected", "Outcome",
                    "To get a different backend"):
        assert section in out
    assert "skipped FlashInfer preference: VLLM_USE_FLASHINFER_MOE_FP8 unset" in out
    assert "FLASHINFER_TRTLLM: needs compute capability 10.x, this is 9.0" in out
    assert "FLASHINFER_CUTLASS           --backend flashinfer_cutlass  (this decision's choice)" in out
    assert "DEEPGEMM                     --backend deep_gemm" in out
    assert "TRITON                       --backend triton" in out
    assert "moe-fsm select --input t.json --backend fp8=deep_gemm" in out


def test_explain_suggests_env_that_would_enable_a_backend(capsys):
    code, out, _ = run(capsys, "explain", str(GOLDEN / "fp8-block-mi300-auto.json"))
    assert code == 0
    assert "it runs with --env VLLM_ROCM_USE_AITER=1 --env VLLM_ROCM_USE_AITER_MOE=1" in out


def test_explain_a_failed_decision_of_the_pr_thread(capsys):
    code, out, _ = run(capsys, "explain", str(GOLDEN / "mixed-pr43334-fp8-layer-single-b12x.json"))
    assert code == 0
    assert "FAILED: BackendUnsupportedError (a ValueError): moe_backend='flashinfer_b12x'" in out
    assert "--backend nvfp4=flashinfer_b12x" in out
    assert "FLASHINFER_CUTLASS           --backend flashinfer_cutlass" in out


def test_explain_notes_requests_that_lora_overrides(capsys):
    code, out, _ = run(capsys, "explain", str(GOLDEN / "fp8-block-sm90-lora.json"))
    assert code == 0
    assert "--backend deep_gemm: selects TRITON instead" in out


def test_explain_rejects_what_is_not_a_trace(capsys, tmp_path):
    (tmp_path / "x.json").write_text("{}")
    code, _, err = run(capsys, "explain", "x.json")
    assert code == 2 and "is not a moe-fsm decision trace" in err
    code, _, err = run(capsys, "explain", "missing.json")
    assert code == 2 and "does not exist" in err
    document = json.loads((GOLDEN / "unq-sm90-auto.json").read_text())
    document["outcome"]["status"] = "exploded"
    (tmp_path / "bad.json").write_text(json.dumps(document))
    code, _, err = run(capsys, "explain", "bad.json")
    assert code == 2 and "does not match the decision-trace schema" in err and "outcome/status" in err


# -- replay -------------------------------------------------------------------------


def test_replay_of_an_unchanged_trace_exits_0(capsys):
    run(capsys, "select", *FP8_SM90, "--trace-out", "t.json")
    code, out, _ = run(capsys, "replay", "t.json")
    assert code == 0
    assert "same decision, byte-identical canonical trace" in out


def test_replay_of_a_failed_decision(capsys):
    code, out, _ = run(capsys, "replay", str(GOLDEN / "mixed-pr43334-fp8-layer-single-b12x.json"))
    assert code == 0 and "BackendUnsupportedError" in out


def test_replay_of_a_tampered_outcome_fails_with_a_diff(capsys, tmp_path):
    run(capsys, "select", *FP8_SM90, "--trace-out", "t.json")
    document = json.loads((tmp_path / "t.json").read_text())
    document["outcome"]["backend"] = "TRITON"
    document["outcome"]["kernel"] = "TritonExperts"
    (tmp_path / "t.json").write_text(json.dumps(document))
    code, out, _ = run(capsys, "replay", "t.json")
    assert code == 1
    assert "the decision changed" in out
    assert '-    "backend": "TRITON",' in out and '+    "backend": "FLASHINFER_CUTLASS",' in out


def test_replay_with_tampered_inputs_decides_differently(capsys, tmp_path):
    run(capsys, "select", *FP8_SM90, "--trace-out", "t.json")
    document = json.loads((tmp_path / "t.json").read_text())
    document["inputs"]["env"] = {"VLLM_USE_FLASHINFER_MOE_FP8": "0"}
    (tmp_path / "t.json").write_text(json.dumps(document))
    code, out, _ = run(capsys, "replay", "t.json")
    assert code == 1 and '+    "backend": "DEEPGEMM",' in out


def test_replay_event_wording_only_passes_unless_strict(capsys, tmp_path):
    run(capsys, "select", *FP8_SM90, "--trace-out", "t.json")
    document = json.loads((tmp_path / "t.json").read_text())
    scan = next(e for e in document["events"] if e["event"] == "pruned")
    scan["because"] = "old wording"
    (tmp_path / "t.json").write_text(json.dumps(document))
    code, out, _ = run(capsys, "replay", "t.json")
    assert code == 0 and "same path and outcome" in out and "-      \"because\": \"old wording\"," in out
    code, out, _ = run(capsys, "replay", "--strict", "t.json")
    assert code == 1


# -- diagram ------------------------------------------------------------------------


def test_diagram_prints_each_familys_machine_per_profile(capsys):
    code, out, _ = run(capsys, "diagram", "--profile", "seeds", "--family", "fp8")
    assert code == 0 and out == mermaid(profiles.get("seeds").policy(QuantFamily.FP8))
    assert out.startswith("stateDiagram-v2") and "deep_gemm_override" in out
    code, out, _ = run(capsys, "diagram")
    assert code == 0
    for name in profiles.names():
        for family in profiles.get(name).policies:
            assert f"## {name}: {family.value}" in out
    code, out, _ = run(capsys, "diagram", "--list")
    assert code == 0 and "seeds" in out


def test_diagram_check_and_update(capsys, tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(f"# Machine\n\n{diagram.BEGIN}\nold\n{diagram.END}\n\ntext after\n")
    code, out, _ = run(capsys, "diagram", "--check", "d.md")
    assert code == 1 and "differ from the machines" in out and "+" in out
    code, _, _ = run(capsys, "diagram", "--update", "d.md")
    assert code == 0
    assert doc.read_text().endswith(f"{diagram.END}\n\ntext after\n")
    code, out, _ = run(capsys, "diagram", "--check", "d.md")
    assert code == 0 and "match the machines" in out
    (tmp_path / "none.md").write_text("no diagram here\n")
    code, _, err = run(capsys, "diagram", "--check", "none.md")
    assert code == 2 and "has no generated diagram part" in err


def test_docs_state_diagram_matches_the_machine(capsys):
    code, out, _ = run(capsys, "diagram", "--check", str(ROOT / "docs" / "state-diagram.md"))
    assert code == 0, out


# -- golden -------------------------------------------------------------------------


def test_golden_check_passes_on_the_repository(capsys):
    code, out, _ = run(capsys, "golden", "--check", "--dir", str(ROOT / "traces"))
    assert code == 0, out
    assert "scenarios match their golden traces" in out


def _small_traces(tmp_path: Path) -> Path:
    traces = tmp_path / "traces"
    (traces / "seeds" / "scenarios").mkdir(parents=True)
    (traces / "seeds" / "scenarios" / "s.toml").write_text(
        '[[scenario]]\nname = "a"\nplatform = "sm90"\nlayer = { quant = "fp8" }\nexpect = "selected:FLASHINFER_CUTLASS"\n\n'
        '[[scenario]]\nname = "b"\nplatform = "cpu"\nlayer = { quant = "fp8" }\nexpect = "fallback_none:NONE"\n'
    )
    return traces


def test_golden_update_then_check_then_detect_a_change(capsys, tmp_path):
    traces = _small_traces(tmp_path)
    code, out, _ = run(capsys, "golden", "--update", "--dir", str(traces))
    assert code == 0 and "2 written" in out
    assert run(capsys, "golden", "--dir", str(traces))[0] == 0
    golden_a = traces / "seeds" / "golden" / "a.json"
    recorded = json.loads(golden_a.read_text())
    recorded["outcome"]["backend"] = "DEEPGEMM"
    golden_a.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")
    (traces / "seeds" / "golden" / "zombie.json").write_text("{}")
    code, out, _ = run(capsys, "golden", "--check", "--dir", str(traces))
    assert code == 1
    assert "--- seeds/a: the decision trace changed" in out
    assert '-    "backend": "DEEPGEMM",' in out and '+    "backend": "FLASHINFER_CUTLASS",' in out
    assert "stale golden file" in out and "zombie.json" in out
    code, out, _ = run(capsys, "golden", "--update", "--dir", str(traces))
    assert code == 0 and "removed" in out
    assert run(capsys, "golden", "--dir", str(traces))[0] == 0


def test_golden_reports_unmet_expectations(capsys, tmp_path):
    traces = _small_traces(tmp_path)
    scenarios = traces / "seeds" / "scenarios" / "s.toml"
    scenarios.write_text(scenarios.read_text().replace("selected:FLASHINFER_CUTLASS", "selected:TRITON"))
    code, out, _ = run(capsys, "golden", "--update", "--dir", str(traces))
    assert code == 1 and "EXPECTATION NOT MET: a: expected selected:TRITON, got selected:FLASHINFER_CUTLASS" in out


def test_golden_list(capsys):
    code, out, _ = run(capsys, "golden", "--list", "--dir", str(ROOT / "traces"), "fp8-block-cpu-fallback")
    assert code == 0 and "fallback_none" in out and "NONE" in out


def test_golden_bad_scenario_file(capsys, tmp_path):
    traces = tmp_path / "traces"
    (traces / "seeds" / "scenarios").mkdir(parents=True)
    (traces / "seeds" / "scenarios" / "s.toml").write_text('[[scenario]]\nname = "Bad Name"\nplatform = "sm90"\n')
    code, _, err = run(capsys, "golden", "--dir", str(traces))
    assert code == 2 and "name must match" in err
    code, _, err = run(capsys, "golden", "--dir", str(tmp_path / "nowhere"))
    assert code == 2 and "does not exist" in err


def test_explain_and_replay_work_without_jsonschema(capsys, monkeypatch):
    """jsonschema is a test dependency: without it the CLI skips validation instead of failing."""
    import sys

    from moe_fsm.trace import schema

    monkeypatch.setitem(sys.modules, "jsonschema", None)
    schema._validator.cache_clear()
    try:
        trace = str(GOLDEN / "fp8-block-sm90-auto.json")
        code, out, _ = run(capsys, "explain", trace)
        assert code == 0 and "To get a different backend" in out
        assert run(capsys, "replay", trace)[0] == 0
    finally:
        schema._validator.cache_clear()


def test_select_names_the_flag_a_parallel_error_is_about(capsys):
    """A parallel-config refusal speaks the command's flags (--batched), not ParallelConfig's fields."""
    code = main(["select", "--dp", "8", "--ep", "8", "--all2all", "deepep_low_latency", "--platform", "sm90", "--no-env"])
    err = capsys.readouterr().err
    assert code == 2 and "set --batched" in err and "batched_activation_format" not in err, err
