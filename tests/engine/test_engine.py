"""The per-layer engine and the main job, on the CPU."""

import json

import pytest

from moe_fsm.engine.engine import Engine
from moe_fsm.engine.presets import PRESETS, LayerSpec, preset
from moe_fsm.engine.run import run_model
from moe_fsm.errors import BackendUnavailableError, BackendUnsupportedError, InputError
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import preset as platform_preset
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.inputs.request import BackendRequest

CPU = platform_preset("cpu")


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_presets_run_selected_checked_and_traced(tmp_path, name):
    engine, results = run_model(preset(name), tokens=16, num_layers=3, env=EnvSnapshot(), platform=CPU, trace_dir=tmp_path)
    assert len(results) == 3
    assert all(r.ok for r in results), results
    assert {r.backend for r in results} == {"CPU"}
    assert engine.distinct_decisions == 1
    assert [r.cached for r in results] == [False, True, True]
    traces = sorted(tmp_path.glob("layer*.json"))  # one trace per distinct decision, named after its first layer
    assert [p.name for p in traces] == ["layer000-model.layers.0.mlp.experts.json"]
    assert [layer.trace_path for layer in engine.loaded] == traces * 3
    assert [layer.decision.trace["layer_name"] for layer in engine.loaded] == [r.name for r in results]
    assert engine.layer_traces == [(r.name, traces[0]) for r in results]


def test_mixed_preset_gives_fp8_and_nvfp4_layers_different_backends(tmp_path):
    engine, results = run_model(preset("mixed-nvfp4-fp8"), tokens=8, num_layers=4, env=EnvSnapshot(), platform=CPU, trace_dir=tmp_path)
    by_family = {r.family: r.backend for r in results}
    assert by_family == {"nvfp4": "EMULATION", "fp8": "NONE"}
    assert all(r.ok for r in results), results
    fp8_trace = json.loads((tmp_path / "layer003-model.layers.3.mlp.experts.json").read_text())
    assert fp8_trace["outcome"]["status"] == "fallback_none"
    assert any(e["event"] == "fallback" for e in fp8_trace["events"])


def test_zero_tokens_run(tmp_path):
    _, results = run_model(preset("qwen3-30b-a3b"), tokens=0, num_layers=1, env=EnvSnapshot(), platform=CPU, trace_dir=tmp_path)
    assert results[0].backend == "CPU"


def test_a_failing_layer_writes_its_trace_and_is_named(tmp_path):
    model = preset("mixed-nvfp4-fp8")
    engine = Engine(
        list(model.layers[:4]), parallel=ParallelConfig(), request=BackendRequest.parse("flashinfer_b12x"),
        env=EnvSnapshot(), platform=platform_preset("sm121"), trace_dir=tmp_path, build=False,
    )
    with pytest.raises(BackendUnsupportedError, match=r"^layer 3 \(model.layers.3.mlp.experts\): moe_backend='flashinfer_b12x' is not supported for FP8 MoE") as info:
        engine.load()
    assert info.value.trace_path and json.loads(open(info.value.trace_path).read())["outcome"]["status"] == "failed"


def test_per_family_request_gets_past_the_mixed_checkpoint_failure(tmp_path):
    model = preset("mixed-nvfp4-fp8")
    failing = Engine(list(model.layers[:4]), parallel=ParallelConfig(), request=BackendRequest.parse("flashinfer_cutlass"),
                     env=EnvSnapshot(), platform=platform_preset("sm121"), trace_dir=tmp_path / "a", strict_build=True,
                     device="cuda")
    # flashinfer_cutlass is valid for both families; moe-fsm's FlashInfer adapter runs unquantized and
    # FP8 per-tensor layers, so a strict build of the first (NVFP4) layer is what fails, naming the layer.
    with pytest.raises(BackendUnavailableError, match=r"^layer 0 \(model.layers.0.mlp.experts\): moe-fsm's FlashInfer CUTLASS adapter runs unquantized and FP8 per-tensor"):
        failing.load()
    # without strict, the NVFP4 layer runs as moe-fsm's torch experts (same numerics), the decision unchanged
    loaded = Engine(list(model.layers[:1]), parallel=ParallelConfig(), request=BackendRequest.parse("flashinfer_cutlass"),
                    env=EnvSnapshot(), platform=platform_preset("sm121"), trace_dir=tmp_path / "c", device="cuda").load()
    assert loaded[0].decision.backend == "FLASHINFER_CUTLASS" and loaded[0].stand_in.label == "moe-fsm torch experts"
    assert json.loads(loaded[0].trace_path.read_text())["build"]["stand_in"]["replaces"] == "FlashInferExperts"
    decisions = [
        Engine([spec], parallel=ParallelConfig(), request=BackendRequest.parse({"nvfp4": "emulation"}), env=EnvSnapshot(),
               platform=CPU, trace_dir=tmp_path / "b").load()[0].decision
        for spec in model.layers[3:5]
    ]
    assert [d.backend for d in decisions] == ["NONE", "EMULATION"]


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(InputError, match=r"model preset 'llama' is not one of \["):
        preset("llama")


def test_every_preset_keeps_its_real_shape_ratios():
    real = {"qwen3-30b-a3b": (2048, 768), "mixtral-8x7b": (4096, 14336), "deepseek-v3": (7168, 2048), "mixed-nvfp4-fp8": (2048, 512)}
    for name, (k, n) in real.items():
        layer = PRESETS[name].layers[0].layer
        assert layer.hidden_size * PRESETS[name].shrink == k
        assert layer.intermediate_size * PRESETS[name].shrink == n


@pytest.mark.parametrize("name,family", [("gpt-oss-20b", "mxfp4"), ("qwen3-30b-a3b-gptq-int4", "int_wna16")])
def test_presets_of_newer_families_decide_with_a_profile_that_models_them(tmp_path, name, family):
    model = preset(name)
    assert model.policy == "vllm-0.33"
    x86 = platform_preset("cpu-x86-amx")  # vLLM's CPU experts for these families need a known CPU architecture
    engine, results = run_model(model, tokens=4, num_layers=1, env=EnvSnapshot(), platform=x86, trace_dir=tmp_path)
    trace = json.loads(next(tmp_path.glob("layer000-*.json")).read_text())
    assert trace["inputs"]["profile"]["name"] == "vllm-0.33"
    assert [(r.family, r.backend) for r in results] == [(family, "CPU")]
    assert results[0].rel_error <= results[0].tolerance
    with pytest.raises(Exception, match=f"no selection policy for family {family} in profile seeds"):
        run_model(model, tokens=4, num_layers=1, env=EnvSnapshot(), platform=x86, trace_dir=tmp_path / "s",
                  policy="seeds")
