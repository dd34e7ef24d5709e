"""Issue 12, items 2, 3, 4 and 9: the library refuses what the CLI refuses, with a message naming what is accepted."""

from __future__ import annotations

import json
import os
import re

import pytest

from moe_fsm import (
    BackendRequest, DecisionInputs, Engine, EnvSnapshot, InputError, LayerSpec, MoELayer, ParallelConfig, QuantScheme,
    build, decide, make_inputs, preset, replay, runtime, select,
)
from moe_fsm.cli.main import main
from moe_fsm.trace import schema

SM90 = preset("sm90")
FP8 = MoELayer(quant=QuantScheme.fp8())


# -- item 2: booleans and names of the wrong type -----------------------------------------------------


@pytest.mark.parametrize("field", ["lora", "router_weight_on_input", "allow_vllm_cutlass"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, None])
def test_layer_booleans_must_be_booleans(field, value):
    with pytest.raises(InputError, match=f"{field} must be True or False, got {value!r}"):
        MoELayer(quant=QuantScheme.fp8(), **{field: value})


def test_lora_false_as_a_string_no_longer_takes_the_lora_shortcut():
    with pytest.raises(InputError, match="lora must be True or False"):
        select(MoELayer(quant=QuantScheme.fp8(), lora="false"), platform=SM90, env={})


@pytest.mark.parametrize("name", [123, b"x", ["a"]])
def test_layer_name_must_be_a_string(name, tmp_path):
    with pytest.raises(InputError, match="layer_name must be a string or None"):
        select(FP8, platform=SM90, env={}, layer_name=name, trace_path=tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


# -- item 3: a misspelt variable -------------------------------------------------------------------------


def test_a_misspelt_env_variable_is_refused_by_the_library_as_by_the_cli(capsys):
    with pytest.raises(InputError, match=r"unknown environment variable\(s\) \['VLLM_USE_DEEP_GEM'\]; moe-fsm reads: .*VLLM_USE_DEEP_GEMM"):
        select(FP8, platform=SM90, env={"VLLM_USE_DEEP_GEM": "0"})
    assert main(["select", "--platform", "sm90", "--quant", "fp8", "--env", "VLLM_USE_DEEP_GEM=0"]) == 2
    assert "VLLM_USE_DEEP_GEM" in capsys.readouterr().err


def test_os_environ_itself_and_snapshots_stay_lenient(monkeypatch):
    monkeypatch.setenv("VLLM_SOMETHING_ELSE", "1")
    assert select(FP8, platform=SM90, env=os.environ).backend
    assert select(FP8, platform=SM90, env=EnvSnapshot.from_mapping({"PATH": "/bin", "VLLM_USE_DEEP_GEMM": "0"})).backend


@pytest.mark.parametrize("env", [{"VLLM_USE_DEEP_GEMM": 0}, {1: "0"}])
def test_env_names_and_values_must_be_strings(env):
    with pytest.raises(InputError, match="env names and values must be strings"):
        select(FP8, platform=SM90, env=env)


# -- item 4: non-finite numbers never reach a trace ---------------------------------------------------------


@pytest.mark.parametrize("limit", [float("inf"), float("nan"), -1.0, 0.0, "7"])
def test_swiglu_limit_must_be_positive_and_finite(limit):
    with pytest.raises(InputError, match="swiglu_limit must be a positive finite number or None"):
        MoELayer(swiglu_limit=limit)


@pytest.mark.parametrize("text", ["inf", "nan", "-inf", "1e999"])
def test_cli_swiglu_limit_refuses_non_finite_values(text, capsys, tmp_path):
    assert main(["select", "--platform", "sm90", "--no-env", f"--swiglu-limit={text}", "--trace-out", str(tmp_path / "t.json")]) == 2
    assert "is not a positive finite number" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_traces_are_strict_json(tmp_path):
    decision = select(MoELayer(swiglu_limit=7.0), platform=SM90, env={}, trace_path=tmp_path / "t.json")
    text = (tmp_path / "t.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert schema.errors(decision.trace) == []


# -- item 9: wrong types at select()'s boundary and in the frozen inputs ---------------------------------------


@pytest.mark.parametrize("call,message", [
    (lambda: select(FP8, platform="sm90", env={}), "platform must be a PlatformFacts (preset('sm90'), probe()) or None"),
    (lambda: select(None, platform=SM90, env={}), "layer must be a MoELayer, got NoneType"),
    (lambda: select("fp8", platform=SM90, env={}), "layer must be a MoELayer, got str"),
    (lambda: MoELayer(quant="fp8"), "quant must be a QuantScheme"),
    (lambda: select(FP8, parallel="x", platform=SM90, env={}), "parallel must be a ParallelConfig or None, got str"),
    (lambda: select(FP8, platform=SM90, env="VLLM_USE_DEEP_GEMM=0"), "env must be a mapping of variable name to value"),
    (lambda: select(FP8, platform=SM90, env={}, trace_path=""), "trace_path must be a non-empty path"),
    (lambda: select(FP8, platform=SM90, env={}, trace_path=3), "trace_path must be a non-empty path"),
    (lambda: select(FP8, platform=SM90, env={}, trace_path="a\0b.json"), "no NUL character"),  # found by the fuzz test
    (lambda: QuantScheme("fp8"), "FP8 weight key None is not one of"),
    (lambda: QuantScheme("fp9"), "quantization family 'fp9' is not one of"),
    (lambda: QuantScheme.fp8(static_activation="yes"), "static_activation must be True or False"),
    (lambda: QuantScheme.fp8(["block"]), "FP8 weight_scale"),
    (lambda: ParallelConfig(batched_activation_format="no"), "batched_activation_format must be True or False"),
    (lambda: ParallelConfig(all2all=["x"]), "all2all"),
    (lambda: MoELayer(activation=["silu"]), "activation"),
    (lambda: MoELayer(dtype=["bfloat16"]), "dtype"),
    (lambda: BackendRequest(default=3), "a backend request's default must be a backend name"),
    (lambda: BackendRequest(per_family=(("fp8", "triton"),)), "per_family must be a tuple of"),
    (lambda: DecisionInputs(FP8, ParallelConfig(), BackendRequest(), {}, SM90), "env must be a EnvSnapshot"),
    (lambda: decide({"layer": FP8}), "decide() takes DecisionInputs"),
    (lambda: DecisionInputs.from_json({"layer": {}}), "recorded inputs lack 'parallel'"),
    (lambda: DecisionInputs.from_json([]), "recorded inputs must be an object"),
])
def test_type_mistakes_are_input_errors_naming_what_is_accepted(call, message):
    with pytest.raises(InputError, match=re.escape(message)):
        call()


def test_quant_scheme_from_a_family_string_is_validated_like_the_enum():
    assert QuantScheme("unquantized") == QuantScheme.unquantized()
    assert make_inputs(FP8, env={}, platform=SM90).layer.quant == QuantScheme.fp8()


# -- issue 39, item 9: replay, build and the Engine refuse what they cannot use, by name ------------------------


CPU_DECISION = select(MoELayer(), platform=preset("cpu"), env={})


@pytest.mark.parametrize("call,message", [
    (lambda: replay(None), "replay takes a trace document (a dict with the recorded 'inputs'"),
    (lambda: replay({}), "got a dict without 'inputs'"),
    (lambda: replay([]), "trace document (a dict with the recorded 'inputs', as json.load returns a trace file), got list"),
    (lambda: build(None), "build takes the Decision that select() or decide() returned, got NoneType"),
    (lambda: build(CPU_DECISION.trace), "build takes the Decision that select() or decide() returned, got dict"),
    (lambda: build(CPU_DECISION, strict="yes"), "strict must be True or False, got 'yes'"),
    (lambda: Engine([{}]).load(), "layers must be a list of LayerSpec(name, MoELayer), got dict at index 0"),
    (lambda: Engine(5), "layers must be a list of LayerSpec(name, MoELayer), got int"),
    (lambda: Engine([LayerSpec("x", "fp8")]), "layer 'x' must be a MoELayer, got str"),
    (lambda: Engine().load_layer(7, MoELayer()), "a layer's name must be a string"),
    (lambda: Engine(trace_dir=5), "trace_dir must be a directory path (a str or a pathlib.Path), got 5"),
    (lambda: Engine(trace_dir=b"traces"), "trace_dir must be a directory path"),
    (lambda: Engine(strict_build="no"), "strict_build must be True or False, got 'no'"),
    (lambda: build(CPU_DECISION, max_tokens_per_rank=0), "max_tokens_per_rank must be None or a positive integer"),
    (lambda: Engine(max_tokens_per_rank=True), "max_tokens_per_rank must be None or a positive integer (the most "
                                                "tokens any rank passes in one call), got True"),
    (lambda: Engine(max_tokens_per_rank=8.0), "max_tokens_per_rank must be None or a positive integer"),
])
def test_replay_build_and_engine_take_only_what_they_can_use(call, message):
    with pytest.raises(InputError, match=re.escape(message)):
        call()


@pytest.mark.parametrize("rank", ["/../../../evil", "1", True, -1, 1.0])
def test_a_rank_is_a_number_so_no_trace_name_leaves_the_trace_dir(rank, tmp_path):
    trace_dir = tmp_path / "traces"
    with pytest.raises(InputError, match=re.escape(f"rank must be None or an integer >= 0 (this process's rank), got {rank!r}")):
        Engine([LayerSpec("l0", MoELayer())], trace_dir=trace_dir, rank=rank, platform=preset("cpu"), env={}).load()
    assert list(tmp_path.rglob("*")) == []
    loaded = Engine([LayerSpec("l0", MoELayer())], trace_dir=trace_dir, rank=2, platform=preset("cpu"), env={},
                    build=False).load()
    assert loaded[0].trace_path == trace_dir / "layer000-l0.rank2.json" and loaded[0].trace_path.is_file()


@pytest.mark.parametrize("device", ["junk", "cuda:x", "cuda:", "tpu", "cpu ", "CPU", 0])
def test_build_refuses_a_device_it_cannot_run_on_naming_those_it_can(device):
    with pytest.raises(InputError, match=re.escape("device must be None (CUDA when torch sees it, else the CPU), a device "
                                                   "name torch reads ('cpu', 'cuda', 'cuda:N', 'mps', ...) or a "
                                                   f"torch.device; got {device!r}")):
        build(CPU_DECISION, device=device)
    with pytest.raises(InputError, match="device must be None"):
        Engine(device=device)


def test_build_takes_every_device_spelling_it_names():
    import torch

    for device in (None, "cpu", torch.device("cpu")):
        assert type(build(CPU_DECISION, device=device).experts).__name__ == "TorchExperts"
    # the type is what counts: a GPU of any number makes a CUDA-only kernel buildable (here: none is decided)
    assert [runtime.device_type(d) for d in ("cuda", "cuda:3", torch.device("cuda", 1))] == ["cuda"] * 3
    # a device without moe-fsm kernels (a model on Apple's GPU, a meta model) builds the stand-in, as the CPU does
    assert [runtime.device_type(d) for d in ("mps", "meta", torch.device("xpu"))] == ["mps", "meta", "xpu"]
    assert type(build(CPU_DECISION, device="meta").experts).__name__ == "TorchExperts"
