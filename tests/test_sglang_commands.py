"""moe-fsm's commands under the sglang-0.5.23 profile: select with SGLang's flags, plan of every fixture of
tests/data/configs (and a run of each of its decisions on CPU), run of every preset on CPU, explain, replay, and
diff against vllm-0.33."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from moe_fsm.cli.main import main
from moe_fsm.engine.presets import PRESETS, ModelPreset
from moe_fsm.engine.run import run_model
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.plan.decider import LayerSpec
from moe_fsm.inputs.platform import preset
from moe_fsm.plan.plan import plan_model

SGLANG = "sglang-0.5.23"
CONFIGS = Path(__file__).resolve().parent / "data" / "configs"
FIXTURES = sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").is_file())


def test_select_takes_sglang_flags_and_records_them(tmp_path, capsys):
    trace = tmp_path / "t.json"
    code = main(["select", "--quant", "fp8", "--architecture", "DeepseekV3ForCausalLM", "--tp", "8",
                 "--a2a-backend", "deepep_v2", "--platform", "sm90", "--no-env", "--policy", SGLANG,
                 "--trace-out", str(trace)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "path: start -> server_args -> model_override -> a2a_constraint -> create_moe_runner -> selected" in out
    assert "rule  deepep_v2 resolves auto to deep_gemm" in out and "SELECTED: DEEP_GEMM" in out
    document = json.loads(trace.read_text())
    assert document["inputs"]["layer"]["model"]["architecture"] == "DeepseekV3ForCausalLM"
    assert document["inputs"]["parallel"]["a2a_backend"] == "deepep_v2"
    assert main(["explain", str(trace)]) == 0
    assert "resolved: " in capsys.readouterr().out
    assert main(["replay", str(trace)]) == 0


def test_a_trace_s_model_facts_can_be_amended_by_flags(tmp_path, capsys):
    trace = tmp_path / "t.json"
    assert main(["select", "--architecture", "Qwen3MoeForCausalLM", "--platform", "sm100", "--no-env",
                 "--policy", SGLANG, "--trace-out", str(trace)]) == 0
    assert "SELECTED: FLASHINFER_TRTLLM" in capsys.readouterr().out
    assert main(["select", "--input", str(trace), "--architecture", "MixtralForCausalLM",
                 "--trace-out", str(tmp_path / "u.json")]) == 0
    assert "SELECTED: TRITON" in capsys.readouterr().out


@pytest.mark.parametrize("platform", ["sm90", "sm100"])
def test_plan_decides_every_fixture_or_says_why_not(platform, tmp_path):
    for name in FIXTURES:
        plan = plan_model(CONFIGS / name, platform=preset(platform), env={}, policy=SGLANG, trace_dir=tmp_path / name)
        for row in plan.layers:
            assert row.decision is not None or (row.error or str(row.quant)), (name, row.index)


def test_plan_reads_the_checkpoint_s_architecture_and_quant_method(tmp_path):
    """gpt_oss.py and qwen3_moe.py read config.json's architectures[0] and quantization_config.quant_method."""
    gpt_oss = plan_model(CONFIGS / "gpt-oss-20b", platform=preset("sm100"), env={}, policy=SGLANG,
                         trace_dir=tmp_path / "g")
    assert {row.decision.backend for row in gpt_oss.layers} == {"FLASHINFER_MXFP4"}
    qwen3 = plan_model(CONFIGS / "qwen3-30b-a3b", platform=preset("sm100"), env={}, policy=SGLANG,
                       trace_dir=tmp_path / "q")
    assert {row.decision.backend for row in qwen3.layers} == {"FLASHINFER_TRTLLM"}
    vllm = plan_model(CONFIGS / "qwen3-30b-a3b", platform=preset("sm100"), env={}, policy="vllm-0.33",
                      trace_dir=tmp_path / "v")
    assert all("model" not in row.decision.trace["inputs"]["layer"] for row in vllm.layers)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_run_decides_every_preset_under_sglang_and_runs_it_on_cpu(name, tmp_path, capsys):
    code = main(["run", "--preset", name, "--layers", "2", "--tokens", "8", "--policy", SGLANG, "--platform", "sm90",
                 "--trace-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "2/2 layers within tolerance" in out and "(stand-in)" in out
    trace = json.loads(sorted(tmp_path.glob("layer*.json"))[0].read_text())
    assert trace["inputs"]["profile"]["name"] == SGLANG and "model" in trace["inputs"]["layer"]


@pytest.mark.parametrize("platform", ["sm90", "cpu-x86-amx", "rocm-mi300"])
def test_plan_command_on_every_fixture_speaks_sglang_s_words(platform, tmp_path, capsys):
    """`moe-fsm plan --policy sglang-0.5.23` on every fixture: exit 0 (all decided) or 1 (a layer failed or was
    refused / not mapped, with the reason), never a traceback or vLLM's wording."""
    for name in FIXTURES:
        code = main(["plan", str(CONFIGS / name), "--platform", platform, "--no-env", "--policy", SGLANG,
                     "--trace-dir", str(tmp_path / name)])
        out, err = capsys.readouterr()
        assert code in (0, 1), (name, out + err)
        assert "Traceback" not in out + err and "vLLM" not in out + err, (name, out + err)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_run_of_every_preset_on_a_cpu_platform_runs_or_gives_sglang_s_reason(name, tmp_path, capsys):
    """Decided for a CPU (--platform cpu) and run on this CPU: it runs, or SGLang's (or the profile's) refusal is
    one line, never vLLM's."""
    code = main(["run", "--preset", name, "--layers", "2", "--tokens", "8", "--policy", SGLANG, "--platform", "cpu",
                 "--device", "cpu", "--repeats", "1", "--trace-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "vLLM" not in (out + err).replace("VLLM_* env set", ""), out + err
    if code == 0:
        assert "2/2 layers within tolerance" in out
    else:
        assert "moe-fsm run: error: layer 0" in err and len(err.strip().splitlines()) <= 2, err


@pytest.mark.parametrize("platform", ["sm90", "sm100"])
def test_every_fixture_s_decisions_run_on_this_cpu(platform, tmp_path):
    """Each distinct decision of every fixture's SGLang plan, at reduced size (16 experts, top-4, 256 x 128: the
    quantization blocks stay whole) and with the checkpoint's facts (architecture, quant_method, the method SGLang
    builds it with), is decided again and run on this CPU, the decided runner or its named stand-in, within tolerance
    of the float64 reference. (A fixture SGLang refuses or whose method is not modelled has nothing to run.)"""
    ran = 0
    for name in FIXTURES:
        plan = plan_model(CONFIGS / name, platform=preset(platform), env={}, policy=SGLANG, trace_dir=tmp_path / name)
        decided = [rows[0] for _, rows in plan.groups() if rows[0].decision is not None]
        if not decided:
            assert all(row.decision is None for row in plan.layers), name
            continue
        specs = tuple(LayerSpec(row.name, replace(row.layer, num_experts=min(row.layer.num_experts, 16),
                                                  top_k=min(row.layer.top_k, 4), hidden_size=256,
                                                  intermediate_size=128)) for row in decided)
        _, results = run_model(ModelPreset(name, name, 1, specs), tokens=8, platform=preset(platform),
                               env=EnvSnapshot.from_mapping({}), policy=SGLANG, trace_dir=tmp_path / f"{name}-run")
        for row, result in zip(decided, results):
            assert result.backend == row.decision.backend, (name, row.index)
            assert result.ok, (name, row.index, result.rel_error, result.tolerance)
            ran += 1
    assert ran >= len(FIXTURES)


def test_diff_shows_where_vllm_and_sglang_part(capsys):
    code = main(["diff", "--policy", "vllm-0.33", "--policy", SGLANG, "--preset", "gpt-oss-20b", "--platform", "sm100",
                 "--no-env"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "FLASHINFER_MXFP4 (FlashInferMxfp4FusedMoE)" in out
    assert "24 of 24 layers decide differently under sglang-0.5.23 than under vllm-0.33" in out


def test_diff_on_a_config_json_compares_every_layer(capsys):
    """moe-fsm diff --config: the checkpoint's layers, read as plan reads them, under both profiles."""
    code = main(["diff", "--policy", "vllm-0.33", "--policy", SGLANG, "--config", str(CONFIGS / "qwen3-30b-a3b"),
                 "--platform", "sm100", "--no-env"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "FLASHINFER_TRTLLM (TrtLlmBf16ExpertsMonolithic)" in out
    assert "FLASHINFER_TRTLLM (FlashInferTrtllmFusedMoE)" in out
    assert "server_args -> model_override" in out
    # both engines run FlashInfer's TRT-LLM runner, locally: the same decision, its kernel class named differently
    assert "same runner, different kernel class (TrtLlmBf16ExpertsMonolithic / FlashInferTrtllmFusedMoE)" in out
    assert ("0 of 48 layers decide differently under sglang-0.5.23 than under vllm-0.33; 48 more run the same "
            "runner with a different kernel class") in out


def test_diff_on_a_config_reads_it_by_each_engine_s_rules(tmp_path, capsys):
    """Each side reads the checkpoint by its own profile's config rules: Llama-4-Maverick's fbgemm_fp8 is deprecated
    to vLLM and unknown to SGLang; group activation order is refused by vLLM's compressed-tensors, taken by SGLang's."""
    code = main(["diff", "--policy", "vllm-0.33", "--policy", SGLANG, "--config", str(CONFIGS / "llama-4-maverick-fp8"),
                 "--platform", "sm90", "--no-env"])
    out = capsys.readouterr().out
    assert code == 1 and "no layer is read by both" in out
    assert "vllm-0.33: REFUSED by vLLM (ValueError): The quantization method fbgemm_fp8 is deprecated" in out
    assert "sglang-0.5.23: REFUSED by SGLang 0.5.23 (ValueError): Unknown quantization method: fbgemm_fp8." in out
    config = json.loads((CONFIGS / "kimi-k2-thinking" / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = main(["diff", "--policy", "vllm-0.33", "--policy", SGLANG, "--config", str(tmp_path), "--platform", "sm90",
                 "--no-env"])
    out = capsys.readouterr().out
    assert code == 1 and "layers 1-60: not compared: vllm-0.33: REFUSED by vLLM (ValueError): Compressed-tensors " \
        "group/dynamic activation ordering (actorder='group') is no longer supported." in out
    assert "sglang-0.5.23: reads compressed-tensors W4A16 group 32 (target 'RoutedExperts')" in out


def test_a_plan_trace_carries_the_method_sglang_builds_and_replays(tmp_path, capsys):
    """At TP 8 Marlin's MoE check fails for Qwen3-30B-A3B-AWQ (768 / 8 = 96): SGLang builds MoeWNA16Method, which
    the trace records as the layer's method; explain says so and replay decides the same from the trace alone."""
    assert main(["plan", str(CONFIGS / "qwen3-30b-a3b-awq"), "--platform", "sm90", "--tp", "8", "--no-env",
                 "--policy", SGLANG, "--trace-dir", str(tmp_path)]) == 0
    trace = str(sorted(tmp_path.glob("layer*.json"))[0])
    capsys.readouterr()
    assert main(["explain", trace]) == 0
    assert "model: architecture Qwen3MoeForCausalLM, quant_method awq, built with the moe_wna16 method" in \
        capsys.readouterr().out
    assert main(["replay", trace]) == 0
    assert "same decision" in capsys.readouterr().out


def test_explain_s_hint_for_a_redirected_request_is_the_profile_s(tmp_path, capsys):
    """A --backend request that ends in another runner: explain names SGLang's stages, not vLLM's LoRA shortcut."""
    trace = tmp_path / "t.json"
    assert main(["select", "--quant", "fp8", "--platform", "sm90", "--no-env", "--policy", SGLANG,
                 "--trace-out", str(trace)]) == 0
    capsys.readouterr()
    assert main(["explain", str(trace)]) == 0
    out = capsys.readouterr().out
    assert ("--backend flashinfer_cutlass: selects TRITON instead (an earlier stage decides first: a model override, "
            "the all-to-all constraint, or the layer's quantization method in create_moe_runner)") in out
    assert "LoRA shortcut" not in out and "vLLM" not in out
