"""Issue 12, items 2, 3, 4 and 9: the library refuses what the CLI refuses, with a message naming what is accepted."""

from __future__ import annotations

import json
import os
import re

import pytest

from moe_fsm import (
    BackendRequest, DecisionInputs, EnvSnapshot, InputError, MoELayer, ParallelConfig, QuantScheme, decide, make_inputs,
    preset, select,
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
    (lambda: select(FP8, platform=SM90, env={}, trace_path=""), "trace_path must be a non-empty path or None"),
    (lambda: select(FP8, platform=SM90, env={}, trace_path=3), "trace_path must be a non-empty path or None"),
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
