"""The quantization families of vLLM 0.33.0 beyond FP8/NVFP4: keys, schemes, JSON, CLI flags.

Expected keys are written from vLLM 0.33.0's ``quant_utils`` and the quant methods
that call each oracle (moe_wna16.py, auto_awq.py, auto_gptq.py,
compressed_tensors_moe_wna16/_w8a8_int8/_w4a8_fp8/_w4a8_int8.py, mxfp4.py, modelopt.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from moe_fsm.cli.main import main
from moe_fsm.decision import select
from moe_fsm.errors import InputError, NoPolicyError
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.platform import preset
from moe_fsm.inputs.quant import (
    FP8_DYNAMIC_GROUP128, FP8_DYNAMIC_TOKEN, FP8_STATIC_TENSOR, INT4_STATIC_GROUP, INT4_STATIC_GROUP32,
    INT8_DYNAMIC_TENSOR, INT8_DYNAMIC_TOKEN, INT8_DYNAMIC_TOKEN_ASYM, INT8_STATIC_CHANNEL, INT8_STATIC_GROUP,
    INT8_STATIC_TENSOR, MXFP4_DYNAMIC, MXFP4_STATIC, MXFP8_DYNAMIC, MXFP8_STATIC, UINT4_STATIC_GROUP,
    UINT4_STATIC_GROUP32, UINT8_STATIC_GROUP, W4A8_INT8_CHANNEL, W4A8_INT8_GROUP, W4A8_INT8_GROUP32,
    W4A8_INT8_GROUP64, W4A8_INT8_GROUP128, Granularity, QuantFamily, QuantKey, QuantScheme,
)

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "src/moe_fsm/data/trace-schema.json").read_text())

SCHEMES = {
    "mxfp4 (gpt-oss)": (QuantScheme.mxfp4(), MXFP4_STATIC, None),
    "mxfp4 w4a4": (QuantScheme.mxfp4("mxfp4"), MXFP4_STATIC, MXFP4_DYNAMIC),
    "mxfp4 w4a8 mx": (QuantScheme.mxfp4("mxfp8"), MXFP4_STATIC, MXFP8_DYNAMIC),
    "mxfp4 fp8 groups": (QuantScheme.mxfp4("fp8-group"), MXFP4_STATIC, FP8_DYNAMIC_GROUP128),
    "mxfp4 fp8 tensor": (QuantScheme.mxfp4("fp8-tensor"), MXFP4_STATIC, FP8_STATIC_TENSOR),
    "mxfp8": (QuantScheme.mxfp8(), MXFP8_STATIC, MXFP8_DYNAMIC),
    "int8 channel/token": (QuantScheme.int8(), INT8_STATIC_CHANNEL, INT8_DYNAMIC_TOKEN),
    "int8 tensor/tensor": (QuantScheme.int8("tensor", "tensor"), INT8_STATIC_TENSOR, INT8_DYNAMIC_TENSOR),
    "int8 asym token": (QuantScheme.int8(symmetric_activation=False), INT8_STATIC_CHANNEL, INT8_DYNAMIC_TOKEN_ASYM),
    "gptq int4 g128": (QuantScheme.int_wna16(), INT4_STATIC_GROUP, None),
    # MoeWNA16 and compressed-tensors pick kInt4Static32 for 4-bit groups of 32; GPTQ and AWQ do not.
    "moe_wna16 int4 g32": (QuantScheme.int_wna16(4, 32, checkpoint="moe_wna16"), INT4_STATIC_GROUP32, None),
    "gptq int4 g32": (QuantScheme.int_wna16(4, 32, checkpoint="gptq"), INT4_STATIC_GROUP, None),
    # Only compressed-tensors puts zero points in the key (uint4, asymmetric).
    "ct int4 asym g32": (QuantScheme.int_wna16(4, 32, True, "compressed-tensors"), UINT4_STATIC_GROUP32, None),
    "ct int4 asym g128": (QuantScheme.int_wna16(4, 128, True, "compressed-tensors"), UINT4_STATIC_GROUP, None),
    "awq int4 zp": (QuantScheme.int_wna16(4, 128, True, "awq"), INT4_STATIC_GROUP, None),
    "gptq int8": (QuantScheme.int_wna16(8, 128), INT8_STATIC_GROUP, None),
    "ct int8 asym": (QuantScheme.int_wna16(8, 64, True, "compressed-tensors"), UINT8_STATIC_GROUP, None),
    "w4a8 fp8": (QuantScheme.w4a8(), INT4_STATIC_GROUP, FP8_DYNAMIC_TOKEN),
    "w4a8_int8 g128": (QuantScheme.w4a8_int8(128), W4A8_INT8_GROUP128, None),
    "w4a8_int8 g64": (QuantScheme.w4a8_int8(64), W4A8_INT8_GROUP64, None),
    "w4a8_int8 g32": (QuantScheme.w4a8_int8(32), W4A8_INT8_GROUP32, None),
    "w4a8_int8 g256": (QuantScheme.w4a8_int8(256), W4A8_INT8_GROUP, None),
    "w4a8_int8 channel": (QuantScheme.w4a8_int8(-1), W4A8_INT8_CHANNEL, None),
}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_constructors_give_vllms_keys_and_round_trip(name):
    scheme, weight, activation = SCHEMES[name]
    assert (scheme.weight, scheme.activation) == (weight, activation)
    data = json.loads(json.dumps(scheme.to_json()))
    assert QuantScheme.from_json(data) == scheme
    jsonschema.validate(data, {"$defs": SCHEMA["$defs"], "$ref": "#/$defs/quant"})


def test_keys_vllm_tells_apart_stay_apart():
    # kMxfp8Dynamic (E8M0 per 32) is not the FP8 1x128 group key; kInt4Static32 (fp16) is not the W4A8-INT8 bf16 one.
    assert MXFP8_DYNAMIC != FP8_DYNAMIC_GROUP128
    assert INT4_STATIC_GROUP32 != W4A8_INT8_GROUP32
    assert INT8_DYNAMIC_TOKEN != INT8_DYNAMIC_TOKEN_ASYM
    assert len({str(k) for _, (s, w, a) in SCHEMES.items() for k in (w, a) if k}) == len(
        {k for _, (s, w, a) in SCHEMES.items() for k in (w, a) if k})


def test_older_keys_keep_their_recorded_form():
    assert FP8_STATIC_TENSOR.to_json() == {"dtype": "fp8_e4m3", "granularity": "tensor", "static": True}
    assert QuantScheme.nvfp4().to_json().keys() == {"family", "weight", "activation"}
    assert "bias" not in MoELayer().to_json()
    assert MoELayer(bias=True).to_json()["bias"] is True


@pytest.mark.parametrize("make, message", [
    (lambda: QuantScheme.mxfp4("int8"), "MXFP4 activation 'int8' is not one of"),
    (lambda: QuantScheme.int8("block"), "INT8 weight_scale 'block' is not one of"),
    (lambda: QuantScheme.int8(activation_scale="group"), "INT8 activation scale 'group'"),
    (lambda: QuantScheme.int8(static_activation=True), "(static, symmetric) is not one of"),
    (lambda: QuantScheme.int_wna16(bits=3), "bits must be 4 or 8"),
    (lambda: QuantScheme.int_wna16(group_size=0), "group_size must be a positive integer or -1"),
    (lambda: QuantScheme.int_wna16(checkpoint="exl2"), "checkpoint 'exl2' is not one of"),
    (lambda: QuantScheme.int_wna16(8, checkpoint="awq"), "AWQ MoE checkpoints are 4-bit"),
    (lambda: QuantScheme.w4a8(64), "supports group_size 128 only"),
    (lambda: QuantScheme.w4a8_int8(-3), "group_size must be a positive integer or -1"),
    (lambda: QuantScheme(QuantFamily.MXFP4, MXFP8_STATIC), "mxfp4 weight key fp8_e4m3:static:group1x32:e8m0 is not one of"),
    (lambda: QuantScheme(QuantFamily.W4A8, INT4_STATIC_GROUP, FP8_DYNAMIC_TOKEN, 128, zero_point=True), "zero points are a WNA16 option"),
    (lambda: QuantScheme(QuantFamily.INT_WNA16, UINT4_STATIC_GROUP, None, 128, False, "compressed-tensors"), "needs zero_point=True"),
    (lambda: QuantScheme(QuantFamily.INT_WNA16, INT4_STATIC_GROUP32, None, 64, False, "moe_wna16"), "has groups of 32, but group_size is 64"),
    (lambda: QuantScheme(QuantFamily.MXFP8, MXFP8_STATIC, MXFP8_DYNAMIC, group_size=32), "a mxfp8 scheme has none"),
    (lambda: QuantKey("int3", Granularity.GROUP, True), "quantized dtype 'int3' is not one of"),
    (lambda: QuantKey.from_json({"dtype": "int4", "granularity": "group", "static": True, "bits": 4}), "unknown quantization key field"),
    (lambda: MoELayer(quant=QuantScheme.int_wna16(group_size=128), hidden_size=192), "group size (128) must evenly divide"),
    (lambda: MoELayer(quant=QuantScheme.mxfp4(), hidden_size=1024, intermediate_size=48), "group size (32) must evenly divide"),
])
def test_bad_schemes_say_what_is_accepted(make, message):
    with pytest.raises(InputError) as err:
        make()
    assert message in str(err.value)


@pytest.mark.parametrize("name", ["mxfp4 (gpt-oss)", "mxfp8", "int8 asym token", "ct int4 asym g32", "w4a8 fp8", "w4a8_int8 g64"])
def test_a_family_without_policy_fails_clearly_with_its_trace(name, tmp_path):
    scheme = SCHEMES[name][0]
    layer = MoELayer(quant=scheme, hidden_size=256, intermediate_size=128)
    with pytest.raises(NoPolicyError) as err:
        select(layer, platform=preset("sm90"), env={}, trace_path=tmp_path / "t.json")
    assert f"no selection policy for family {scheme.family.value} in profile seeds" in str(err.value)
    assert isinstance(err.value, NotImplementedError)
    written = json.loads((tmp_path / "t.json").read_text())
    jsonschema.validate(written, SCHEMA)
    assert written["outcome"]["error"]["type"] == "NoPolicyError"
    assert QuantScheme.from_json(written["inputs"]["layer"]["quant"]) == scheme


CLI_CASES = {
    "mxfp4": (["--quant", "mxfp4", "--bias", "--activation", "swigluoai", "--swiglu-limit", "7"], QuantScheme.mxfp4()),
    "mxfp4 mxfp8": (["--quant", "mxfp4", "--act-quant", "mxfp8"], QuantScheme.mxfp4("mxfp8")),
    "mxfp8": (["--quant", "mxfp8"], QuantScheme.mxfp8()),
    "int8": (["--quant", "int8"], QuantScheme.int8()),
    "int8 tensor asym": (["--quant", "int8", "--weight-scale", "tensor", "--asym-act"], QuantScheme.int8("tensor", "tensor", False, False)),
    "wna16": (["--quant", "int_wna16"], QuantScheme.int_wna16()),
    "wna16 ct": (["--quant", "int_wna16", "--group-size", "32", "--zero-point", "--checkpoint", "compressed-tensors"],
                 QuantScheme.int_wna16(4, 32, True, "compressed-tensors")),
    "wna16 int8 channel": (["--quant", "int_wna16", "--bits", "8", "--group-size", "-1", "--act-order"],
                           QuantScheme.int_wna16(8, -1, act_order=True)),
    "w4a8": (["--quant", "w4a8"], QuantScheme.w4a8()),
    "w4a8_int8": (["--quant", "w4a8_int8", "--group-size", "64"], QuantScheme.w4a8_int8(64)),
}


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_flags_build_the_scheme_and_replay(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    flags, scheme = CLI_CASES[name]
    code = main(["select", "--platform", "sm90", "--no-env", "--hidden", "256", "--intermediate", "128", *flags,
                 "--trace-out", str(tmp_path / "t.json")])
    out, err = capsys.readouterr()
    assert code != 0 and "no selection policy for family" in err
    trace = json.loads((tmp_path / "t.json").read_text())
    assert QuantScheme.from_json(trace["inputs"]["layer"]["quant"]) == scheme
    assert trace["inputs"]["layer"].get("bias", False) == ("--bias" in flags)
    assert main(["replay", str(tmp_path / "t.json")]) == 0
    assert "byte-identical" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--quant", "mxfp8", "--bits", "4"], "['bits'] do not apply to a mxfp8 layer"),
    (["--quant", "fp8", "--group-size", "128"], "['group_size'] do not apply to an fp8 layer"),
    (["--quant", "nvfp4", "--zero-point"], "['zero_point'] do not apply to an NVFP4 layer"),
    (["--quant", "w4a8", "--group-size", "64"], "supports group_size 128 only"),
    (["--quant", "int8", "--act-scale", "group"], "INT8 activation scale 'group'"),
    (["--zero-point"], "only apply to quantized layers"),
])
def test_cli_rejects_options_of_another_family(flags, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["select", "--platform", "sm90", "--no-env", "--hidden", "256", "--intermediate", "128", *flags])
    err = capsys.readouterr().err
    assert code != 0 and message in err
