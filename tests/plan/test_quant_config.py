"""vLLM's config path, family by family: which MoE method a quantization_config gets, and the scheme its oracle sees.

Each expectation is read from vLLM 0.33.0's quantization configs (docs/vllm-config-path.md names the file and
function); the release differences from 0.31.0 / 0.32.0 are tested where they change an answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_fsm.cli.main import main
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import PlatformFacts, Vendor, preset
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.plan.model_config import read_model_config
from moe_fsm.plan.plan import plan_model
from moe_fsm.plan.quant_config import layer_quant, resolve_method
from moe_fsm.plan.quant_fields import LayerContext, Mapped, Refused, Unmapped

CONFIGS = Path(__file__).parent.parent / "data" / "configs"
EXPERTS = "model.layers.5.mlp.experts"
QWEN = LayerContext(model_type="qwen3_moe", hidden_size=2048, intermediate_size=768, platform=preset("sm90"))
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def _ctx(**changes) -> LayerContext:
    fields = {**QWEN.__dict__, **changes}
    return LayerContext(**fields)


# -- which config class --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, platform, model_type, method", [
    (GPTQ, "sm90", "qwen3_moe", "auto_gptq"),
    ({**GPTQ, "quant_method": "GPTQ"}, "sm90", "qwen3_moe", "auto_gptq"),  # vLLM lower-cases quant_method
    (AWQ, "sm90", "qwen3_moe", "auto_awq"),
    (AWQ, "cpu-x86-amx", "qwen3_moe", "awq"),  # AutoAWQConfig does not override on CPUs; "awq" is the same class
    ({"quant_method": "mxfp4"}, "sm90", "gpt_oss", "gpt_oss_mxfp4"),
    ({"quant_method": "mxfp4"}, "sm90", "deepseek_v3", "mxfp4"),
    ({"quant_method": "compressed_tensors"}, "sm90", "qwen3_moe", "compressed-tensors"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "sm90", "x", "modelopt"),
    ({"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"}, "sm90", "x", "modelopt"),  # no override: as written
    ({"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"}, "sm90", "x", "modelopt_fp4"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, "sm90", "x", "modelopt_mixed"),
    ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}, "sm90", "x", "modelopt_fp4"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "sm90", "deepseek_v4", "deepseek_v4_fp8"),
    ({"bits": 4}, "sm90", "x", None),  # no quant_method: vLLM reads the checkpoint as unquantized
])
def test_vllm_picks_the_config_class_by_method_and_overrides(config, platform, model_type, method):
    assert resolve_method(config, _ctx(platform=preset(platform), model_type=model_type)) == method


@pytest.mark.parametrize("config, platform, says", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "sm90", "Unknown quantization method: bitsandbytes. Must be one of"),
    ({"quant_method": "hqq"}, "sm90", "Unknown quantization method: hqq."),
    ({"quant_method": "fbgemm_fp8", "modules_to_not_convert": [], "activation_scale_ub": 1200.0}, "sm90",
     "The quantization method fbgemm_fp8 is deprecated and will be removed in future versions of vLLM. To bypass, set "
     "`--allow-deprecated-quantization`."),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "xpu", "modelopt_fp4 quantization is currently not supported in xpu."),
    ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "INT4_AWQ"}}, "sm90", "Unknown ModelOpt quant algo: INT4_AWQ"),
])
def test_what_vllm_refuses_for_the_checkpoint_carries_its_message(config, platform, says):
    refused = layer_quant(config, EXPERTS, _ctx(platform=preset(platform)))
    assert isinstance(refused, Refused) and refused.error == "ValueError" and refused.reason.startswith(says), refused


def test_a_gpu_below_the_classs_minimum_capability_is_refused():
    turing = PlatformFacts(vendor=Vendor.CUDA, capability=(7, 5), device_name="NVIDIA T4")
    refused = layer_quant({"quant_method": "mxfp4"}, EXPERTS, _ctx(model_type="gpt_oss", platform=turing))
    assert refused.reason == ("The quantization method gpt_oss_mxfp4 is not supported for the current GPU. Minimum "
                              "capability: 80. Current capability: 75.")


# -- GPTQ, AWQ, MoeWNA16 -----------------------------------------------------------------------------------------------


def test_gptq_takes_its_marlin_method_where_marlins_shape_rule_holds_else_moe_wna16():
    assert layer_quant(GPTQ, EXPERTS, QWEN) == Mapped(QuantScheme.int_wna16(4, 128, False, "gptq"), "gptq 4-bit group 128",
                                                      method="AutoGPTQMoEMethod")
    # TP 4: 768 / 4 = 192 is no multiple of 128 (check_moe_marlin_supports_layer with tile padding)
    tp4 = layer_quant(GPTQ, EXPERTS, _ctx(parallel=ParallelConfig(tp_size=4)))
    assert tp4.method == "MoeWNA16Method" and tp4.scheme == QuantScheme.int_wna16(4, 128, False, "moe_wna16")
    # ... but with EP the experts are whole, and the rule holds again
    assert layer_quant(GPTQ, EXPERTS, _ctx(parallel=ParallelConfig(tp_size=4, ep_size=4))).method == "AutoGPTQMoEMethod"
    # Marlin takes groups of -1/32/64/128 only, and never runs on ROCm
    assert layer_quant({**GPTQ, "group_size": 256}, EXPERTS, _ctx(intermediate_size=1024)).method == "MoeWNA16Method"
    assert layer_quant(GPTQ, EXPERTS, _ctx(platform=preset("rocm-mi300"))).method == "MoeWNA16Method"
    assert layer_quant({**GPTQ, "bits": 8}, EXPERTS, QWEN).scheme == QuantScheme.int_wna16(8, 128, False, "gptq")


def test_gptq_act_order_and_asymmetry_are_refused_with_vllms_words():
    refused = layer_quant({**GPTQ, "desc_act": True}, EXPERTS, QWEN)
    assert refused.reason.startswith("GPTQ group activation ordering (desc_act=True) is no longer supported.")
    # per channel, act-order is a no-op: accepted (TheBloke's Mixtral GPTQ main branch)
    assert layer_quant({**GPTQ, "desc_act": True, "group_size": -1}, EXPERTS, QWEN).scheme == QuantScheme.int_wna16(
        4, -1, False, "gptq")
    assert layer_quant({**GPTQ, "sym": False}, EXPERTS, QWEN).reason == "Unsupported quantization config: bits=4, sym=False"
    assert layer_quant({**GPTQ, "bits": 3}, EXPERTS, QWEN).reason == "Unsupported quantization config: bits=3, sym=True"
    assert layer_quant({k: v for k, v in GPTQ.items() if k != "sym"}, EXPERTS, QWEN).reason == \
        "Cannot find any of ['sym'] in the model's quantization config."


def test_gptq_dynamic_rules_skip_or_override_a_module_first_match_wins():
    dynamic = {r"-:.*\.5\.mlp\.experts": {}, r"+:.*\.(6|7)\.mlp.*": {"bits": 8, "group_size": 64}, r".*\.7\..*": {"bits": 4}}
    config = {**GPTQ, "dynamic": dynamic}
    assert layer_quant(config, EXPERTS, QWEN).scheme == QuantScheme.unquantized()
    assert layer_quant(config, "model.layers.6.mlp.experts", QWEN).scheme == QuantScheme.int_wna16(8, 64, False, "gptq")
    assert layer_quant(config, "model.layers.7.mlp.experts", QWEN).scheme == QuantScheme.int_wna16(8, 64, False, "gptq")
    assert layer_quant(config, "model.layers.8.mlp.experts", QWEN).scheme == QuantScheme.int_wna16(4, 128, False, "gptq")
    # a rule that turns act-order on with groups is refused when the config is read
    refused = layer_quant({**GPTQ, "dynamic": {r".*": {"desc_act": True}}}, EXPERTS, QWEN)
    assert "is enabled by dynamic rule '.*'" in refused.reason
    # the MoeWNA16 fallback reads the base config only: the skip rule does not apply there
    fallback = layer_quant(config, EXPERTS, _ctx(platform=preset("rocm-mi300")))
    assert fallback.method == "MoeWNA16Method"


def test_awq_reads_its_keys_and_skips_modules_by_substring():
    mapped = layer_quant(AWQ, EXPERTS, QWEN)
    assert mapped.method == "AutoAWQMoEMethod" and mapped.scheme == QuantScheme.int_wna16(4, 128, True, "awq")
    assert layer_quant({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": False}, EXPERTS,
                       QWEN).scheme == QuantScheme.int_wna16(4, 64, False, "awq")
    assert layer_quant({**AWQ, "modules_to_not_convert": ["mlp.experts"]}, EXPERTS, QWEN).scheme == QuantScheme.unquantized()
    assert layer_quant({**AWQ, "bits": 8}, EXPERTS, QWEN).reason.startswith("Unsupported num_bits = 8. Supported: 4.")
    fallback = layer_quant(AWQ, EXPERTS, _ctx(parallel=ParallelConfig(tp_size=4)))
    assert fallback.method == "MoeWNA16Method" and fallback.scheme == QuantScheme.int_wna16(4, 128, True, "moe_wna16")


# -- fp8, modelopt ----------------------------------------------------------------------------------------------------


def test_fp8_blocks_are_fitted_to_the_tp_shard_as_vllm_fits_them():
    block = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    context = _ctx(hidden_size=4096, intermediate_size=1536)
    assert layer_quant(block, EXPERTS, context).scheme == QuantScheme.fp8("block", "group")
    assert layer_quant(block, EXPERTS, _ctx(hidden_size=4096, intermediate_size=1536,
                                            parallel=ParallelConfig(tp_size=4))).scheme == QuantScheme.fp8("block", "group")
    refined = layer_quant(block, EXPERTS, _ctx(hidden_size=4096, intermediate_size=1536, parallel=ParallelConfig(tp_size=8)))
    assert isinstance(refined, Unmapped) and "weight blocks [64, 64] (refined from [128, 128]" in refined.reason


def test_fp8_batch_invariance_keys_per_token_activations_from_0_33_on():
    tensor = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    assert layer_quant(tensor, EXPERTS, _ctx(batch_invariant=True)).scheme == QuantScheme.fp8("tensor", "token")
    assert layer_quant(tensor, EXPERTS, _ctx(batch_invariant=True, release=(0, 32))).scheme == QuantScheme.fp8("tensor", "tensor")


def test_modelopt_fp8_algos_are_static_per_tensor_unless_mixed():
    """ModelOptFp8MoEMethod keys every FP8 algo kFp8StaticTensorSym; MIXED_PRECISION sends FP8_PB_WO to Fp8MoEMethod."""
    for algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"):
        mapped = layer_quant({"quant_method": "modelopt", "quant_algo": algo}, EXPERTS, QWEN)
        assert mapped.method == "ModelOptFp8MoEMethod" and mapped.scheme == QuantScheme.fp8("tensor", "tensor", True)
    mixed = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
             "quantized_layers": {f"{EXPERTS}.0.up_proj": {"quant_algo": "FP8_PB_WO"}}}
    assert layer_quant(mixed, EXPERTS, QWEN).scheme == QuantScheme.fp8("block", "group")
    two_blocks = {**mixed, "quantized_layers": {**mixed["quantized_layers"], "x": {"quant_algo": "FP8_PB_WO", "group_size": 64}}}
    assert "to use one group_size, got [64, 128]" in layer_quant(two_blocks, EXPERTS, QWEN).reason


def test_modelopt_flat_exclude_modules_is_read_from_0_33_on():
    config = {"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["model.layers.5.mlp*"]}
    assert layer_quant(config, EXPERTS, QWEN).scheme == QuantScheme.unquantized()
    assert layer_quant(config, EXPERTS, _ctx(release=(0, 32))).scheme == QuantScheme.nvfp4()


# -- compressed-tensors --------------------------------------------------------------------------------------------------


def _ct(weights: dict, inputs: dict | None = None, fmt: str = "pack-quantized", **extra) -> dict:
    group = {"targets": ["Linear"], "weights": weights, **({"input_activations": inputs} if inputs else {})}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}, **extra}


INT = {"type": "int", "strategy": "group", "symmetric": True}


@pytest.mark.parametrize("weights, inputs, fmt, scheme, method", [
    ({**INT, "num_bits": 4, "group_size": 32}, None, "pack-quantized",
     QuantScheme.int_wna16(4, 32, False, "compressed-tensors"), "CompressedTensorsWNA16MoEMethod"),
    ({**INT, "num_bits": 4, "group_size": 64, "symmetric": False}, None, "pack-quantized",
     QuantScheme.int_wna16(4, 64, True, "compressed-tensors"), "CompressedTensorsWNA16MoEMethod"),
    ({**INT, "num_bits": 8, "group_size": 128}, None, "pack-quantized",
     QuantScheme.int_wna16(8, 128, False, "compressed-tensors"), "CompressedTensorsWNA16MoEMethod"),
    ({"type": "int", "num_bits": 4, "strategy": "channel"}, None, "pack-quantized",
     QuantScheme.int_wna16(4, -1, False, "compressed-tensors"), "CompressedTensorsWNA16MoEMethod"),
    ({"type": "int", "num_bits": 8, "strategy": "channel"}, {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True},
     "int-quantized", QuantScheme.int8("channel", "token"), "CompressedTensorsW8A8Int8MoEMethod"),
    ({"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 128]},
     {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 128, "dynamic": True}, "float-quantized",
     QuantScheme.fp8("block", "group"), "CompressedTensorsW8A8Fp8MoEMethod"),
    ({"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16},
     {"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16, "dynamic": "local"},
     "nvfp4-pack-quantized", QuantScheme.nvfp4(), "CompressedTensorsW4A4Nvfp4MoEMethod"),
    ({"type": "float", "num_bits": 8, "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"},
     {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 32, "dynamic": True}, "mxfp8-quantized",
     QuantScheme.mxfp8(), "CompressedTensorsW8A8Mxfp8MoEMethod"),
    ({**INT, "num_bits": 4, "group_size": 128}, {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True},
     "int-quantized", QuantScheme.w4a8(128), "CompressedTensorsW4A8Fp8MoEMethod"),
    ({**INT, "num_bits": 4, "group_size": 64}, {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True},
     "int-quantized", QuantScheme.w4a8_int8(64), "CompressedTensorsW4A8Int8MoEMethod"),
])
def test_compressed_tensors_schemes_pick_vllms_moe_method(weights, inputs, fmt, scheme, method):
    mapped = layer_quant(_ct(weights, inputs, fmt), EXPERTS, QWEN)
    assert (mapped.scheme, mapped.method) == (scheme, method), mapped


@pytest.mark.parametrize("weights, inputs, fmt, says", [
    ({"type": "float", "num_bits": 8, "strategy": "channel"}, None, "float-quantized",
     "For Fused MoE layers, only format: pack-quantized and bits: [2, 3, 4, 5, 6, 7, 8] is supported"),
    ({**INT, "num_bits": 4, "group_size": 128, "actorder": "group"}, None, "pack-quantized",
     "Compressed-tensors group/dynamic activation ordering (actorder='group') is no longer supported."),
    ({"type": "int", "num_bits": 8, "strategy": "tensor"}, {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True},
     "int-quantized", "For INT8 Fused MoE layers, we require channelwise, dynamic per token quantization."),
    ({"type": "float", "num_bits": 8, "strategy": "channel"}, {"type": "float", "num_bits": 8, "strategy": "tensor"},
     "float-quantized", "CompressedTensorsW8A8Fp8MoEMethod asserts block weights"),
    ({"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16},
     {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}, "nvfp4-pack-quantized",
     "For NVFP4 weights, input quantization must also be NVFP4 format or None for NVFP4A16"),
])
def test_compressed_tensors_schemes_vllm_refuses(weights, inputs, fmt, says):
    refused = layer_quant(_ct(weights, inputs, fmt), EXPERTS, QWEN)
    assert isinstance(refused, Refused) and refused.reason.startswith(says), refused


def test_compressed_tensors_matches_the_models_own_expert_names_from_0_32_on():
    """Mixtral's experts are w1/w3/w2: a group targeting them by name quantizes Mixtral's experts in 0.32+, while
    0.31 matched gate_proj/up_proj/down_proj whatever the model and left them unquantized."""
    config = {**_ct({**INT, "num_bits": 4, "group_size": 128}), "config_groups": {"g": {
        "targets": ["re:.*experts\\.\\d+\\.w[123]$"], "weights": {**INT, "num_bits": 4, "group_size": 128}}}}
    mixtral = _ctx(projections=("w1", "w3", "w2"), hidden_size=4096, intermediate_size=14336)
    experts = "model.layers.5.block_sparse_moe.experts"
    assert layer_quant(config, experts, mixtral).method == "CompressedTensorsWNA16MoEMethod"
    assert layer_quant(config, experts, _ctx(projections=("w1", "w3", "w2"), release=(0, 31))).scheme == QuantScheme.unquantized()


def test_compressed_tensors_mxfp4_is_not_modelled_with_the_reason():
    mx = _ct({"type": "float", "num_bits": 4, "strategy": "group", "group_size": 32}, None, "mxfp4-pack-quantized")
    assert "CompressedTensorsW4A4Mxfp4MoEMethod picks its experts outside the MXFP4 oracle" in layer_quant(mx, EXPERTS, QWEN).reason


# -- quark, mxfp4 ----------------------------------------------------------------------------------------------------------


def test_quark_mxfp4_and_fp8_pick_the_mxfp4_and_fp8_oracles():
    config = json.loads((CONFIGS / "deepseek-r1-mxfp4-quark" / "config.json").read_text())["quantization_config"]
    mapped = layer_quant(config, EXPERTS, QWEN)
    assert (mapped.scheme, mapped.method) == (QuantScheme.mxfp4("mxfp4"), "QuarkOCP_MX_MoEMethod")
    weights_only = {**config, "global_quant_config": {**config["global_quant_config"], "input_tensors": None}}
    assert layer_quant(weights_only, EXPERTS, QWEN).scheme == QuantScheme.mxfp4()
    fp8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True}
    fp8_config = {**config, "global_quant_config": {"weight": fp8, "input_tensors": fp8, "output_tensors": None, "bias": None}}
    assert layer_quant(fp8_config, EXPERTS, QWEN).scheme == QuantScheme.fp8("tensor", "tensor", True)
    excluded = {**config, "exclude": [f"{EXPERTS}.3.down_proj"]}  # a child excluded excludes the whole layer
    assert layer_quant(excluded, EXPERTS, QWEN).scheme == QuantScheme.unquantized()
    assert layer_quant({**config, "export": None}, EXPERTS, QWEN).reason.startswith("The export key should be included")


def test_gpt_oss_mxfp4_ignores_modules_to_not_convert_for_the_experts():
    config = {"quant_method": "mxfp4", "modules_to_not_convert": [EXPERTS, "model.layers.*.mlp"]}
    mapped = layer_quant(config, EXPERTS, _ctx(model_type="gpt_oss"))
    assert (mapped.scheme, mapped.method) == (QuantScheme.mxfp4(), "GptOssMxfp4MoEMethod")


# -- the model side: module names, dense layers, expert names, hf_quant_config.json ---------------------------------------


def test_architectures_give_vllms_module_names_and_moe_layers():
    scout = read_model_config(CONFIGS / "llama-4-scout-fp8-dynamic")
    assert scout.experts_module(0) == "language_model.model.layers.0.feed_forward.experts"
    assert (len(scout.moe_layers), scout.geometry.router_weight_on_input, scout.geometry.top_k) == (48, True, 1)
    maverick = read_model_config(CONFIGS / "llama-4-maverick-fp8")
    assert maverick.moe_layers == tuple(range(1, 48, 2)) and maverick.geometry.num_experts == 128
    glm = read_model_config(CONFIGS / "glm-4.5-air-fp8")
    assert glm.moe_layers == tuple(range(1, 46)) and glm.geometry.intermediate_size == 1408
    oss = read_model_config(CONFIGS / "gpt-oss-120b").geometry
    assert (oss.bias, oss.activation.value, oss.swiglu_limit) == (True, "swigluoai", 7.0)
    assert read_model_config(CONFIGS / "mixtral-8x7b-awq").projections == ("w1", "w3", "w2")


def test_hf_quant_config_json_beside_config_json_is_read(tmp_path):
    model = read_model_config(CONFIGS / "deepseek-r1-fp4-hf-quant-config")
    assert model.quantization["quantization"]["quant_algo"] == "NVFP4"
    assert model.quantization_file.endswith("hf_quant_config.json")
    plan = plan_model(CONFIGS / "deepseek-r1-fp4-hf-quant-config", platform=preset("sm100"), env={}, trace_dir=tmp_path,
                      policy="vllm-0.33")
    assert plan.quant_method == "modelopt_fp4" and {r.decision.backend for r in plan.layers} == {"FLASHINFER_TRTLLM"}


def test_a_broken_hf_quant_config_json_is_one_line_naming_it(tmp_path, capsys):
    config = json.loads((CONFIGS / "deepseek-r1-fp4-hf-quant-config" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf_quant_config.json").write_text("{not json")
    assert main(["plan", str(tmp_path), "--platform", "sm100", "--policy", "vllm-0.33", "--no-env",
                 "--trace-dir", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "hf_quant_config.json" in err and len(err.strip().splitlines()) == 1


# -- end to end: the issue's repros -----------------------------------------------------------------------------------------


def test_plan_decides_gpt_oss_as_select_does(tmp_path, capsys):
    """Issue 41: plan refused every gpt-oss layer ("the MXFP4 family is not mapped yet") while select decided it."""
    assert main(["plan", str(CONFIGS / "gpt-oss-20b"), "--platform", "sm90", "--policy", "vllm-0.33", "--no-env",
                 "--trace-dir", str(tmp_path / "plan"), "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    assert {row["backend"] for row in layers} == {"FLASHINFER_CUTLASS_MXFP4_BF16"} and len(layers) == 24
    assert layers[0]["layer"]["bias"] is True and layers[0]["layer"]["activation"] == "swigluoai"
    assert main(["select", "--quant", "mxfp4", "--bias", "--activation", "swigluoai", "--swiglu-limit", "7", "--experts",
                 "32", "--top-k", "4", "--hidden", "2880", "--intermediate", "2880", "--platform", "sm90", "--no-env",
                 "--policy", "vllm-0.33", "--trace-out", str(tmp_path / "select.json")]) == 0
    assert json.loads((tmp_path / "select.json").read_text())["outcome"]["backend"] == "FLASHINFER_CUTLASS_MXFP4_BF16"


@pytest.mark.parametrize("name, platform, method, backend", [
    ("qwen3-30b-a3b-gptq-int4", "sm90", "AutoGPTQMoEMethod", "MARLIN"),
    ("mixtral-8x7b-awq", "sm90", "AutoAWQMoEMethod", "MARLIN"),
    ("kimi-k2-thinking", "sm100", "CompressedTensorsWNA16MoEMethod", "MARLIN"),
    ("qwen3-30b-a3b-gptq-int4", "rocm-mi300", "MoeWNA16Method", "TRITON"),
])
def test_plan_decides_the_int4_checkpoints_the_issue_names(tmp_path, name, platform, method, backend):
    plan = plan_model(CONFIGS / name, platform=preset(platform), env={}, trace_dir=tmp_path, policy="vllm-0.33")
    assert plan.ok and {(r.quant.method, r.decision.backend) for r in plan.layers} == {(method, backend)}


# -- found by the config-path parity run (tools/vllm_parity.py --config-path) -----------------------------------------------


def test_an_activation_format_without_activations_needs_float_weights():
    """compressed-tensors' reader asserts float weights (W8A16 FP8) for a group whose format quantizes activations."""
    refused = layer_quant(_ct({**INT, "num_bits": 4, "group_size": 128}, None, "int-quantized"), EXPERTS, QWEN)
    assert isinstance(refused, Refused) and refused.error == "AssertionError"


def test_channelwise_compressed_tensors_int4_runs_on_marlin_only(tmp_path):
    """CompressedTensorsWNA16MoEMethod asserts group scales once its oracle chose any backend but Marlin."""
    config = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())
    config["quantization_config"] = _ct({"type": "int", "num_bits": 4, "strategy": "channel"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    on_gpu = plan_model(tmp_path, platform=preset("sm90"), env={}, trace_dir=tmp_path / "a", policy="vllm-0.33")
    assert on_gpu.ok and {r.decision.backend for r in on_gpu.layers} == {"MARLIN"}
    on_xpu = plan_model(tmp_path, platform=preset("xpu"), env={}, trace_dir=tmp_path / "b", policy="vllm-0.33")
    assert not on_xpu.ok and on_xpu.layers[0].error.startswith("AssertionError: CompressedTensorsWNA16MoEMethod asserts")
    assert on_xpu.layers[0].error.endswith("(its oracle chose XPU)") and on_xpu.layers[0].status == "failed"


def test_the_config_classes_read_the_normalised_quant_method():
    """vLLM lower-cases quant_method in the dict its classes read: GPTQ's MoeWNA16 fallback takes "GPTQ" as gptq."""
    fallback = layer_quant({**GPTQ, "quant_method": "GPTQ"}, EXPERTS, _ctx(parallel=ParallelConfig(tp_size=4)))
    assert fallback.method == "MoeWNA16Method"
