"""plan under sglang-0.5.23 reads a checkpoint's quantization_config by SGLang 0.5.23's rules
(plan/sglang_quant_config.py), not vLLM's: its method registry per platform, its overrides, its refusals in its
own words, and the MoE method each config class builds (which the profile's create_moe_runner rules are keyed by)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import preset
from moe_fsm.plan.plan import plan_model
from moe_fsm.plan.quant_config import QuantReader
from moe_fsm.plan.quant_fields import LayerContext, Mapped, Refused, Unmapped
from moe_fsm.plan.sglang_quant_config import SGLANG_0_5_23_CONFIG_RULES, registered

SGLANG = "sglang-0.5.23"
CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def plan(name, platform="sm90", policy=SGLANG, tmp=None, **kw):
    return plan_model(CONFIGS / name, platform=preset(platform), env={}, policy=policy, trace_dir=tmp, **kw)


def read(config: dict, platform="sm90", **kw) -> object:
    ctx = LayerContext(platform=preset(platform), hidden_size=2048, intermediate_size=768,
                       config_rules=SGLANG_0_5_23_CONFIG_RULES, **kw)
    return QuantReader(config, ctx).layer("model.layers.0.mlp.experts")


def test_fbgemm_fp8_is_an_unknown_method_to_sglang_not_a_deprecated_one(tmp_path):
    """SGLang 0.5.23 has no fbgemm_fp8 class and no override claims it (configs/model_config.py)."""
    sglang = plan("llama-4-maverick-fp8", tmp=tmp_path / "s").layers[0].quant
    assert isinstance(sglang, Refused) and sglang.by == "SGLang 0.5.23"
    assert sglang.reason.startswith("Unknown quantization method: fbgemm_fp8. Must be one of ['fp8', 'mxfp8', ")
    assert "vLLM" not in sglang.reason
    vllm = plan("llama-4-maverick-fp8", policy="vllm-0.33", tmp=tmp_path / "v").layers[0].quant
    assert vllm.by == "vLLM" and "deprecated" in vllm.reason


def test_the_registry_differs_by_platform():
    """mxfp4 is registered on CUDA, CPUs and gfx95x, not on MI300; gptq only on CPUs (and XPU)."""
    assert "mxfp4" in registered(LayerContext(platform=preset("sm90")))
    assert "mxfp4" not in registered(LayerContext(platform=preset("rocm-mi300")))
    assert "mxfp4" in registered(LayerContext(platform=preset("rocm-mi355")))
    assert "gptq" in registered(LayerContext(platform=preset("cpu"))) and "gptq" not in registered(
        LayerContext(platform=preset("sm90")))
    gpt_oss = read({"quant_method": "mxfp4"}, "rocm-mi300")
    assert isinstance(gpt_oss, Refused) and gpt_oss.reason.startswith("Unknown quantization method: mxfp4.")
    assert isinstance(read({"quant_method": "mxfp4"}, "rocm-mi355"), Mapped)


def test_gptq_is_served_by_marlin_on_cuda_and_refused_or_unmodelled_elsewhere(tmp_path):
    cuda = plan("qwen3-30b-a3b-gptq-int4", tmp=tmp_path / "c").layers[0]
    assert cuda.quant.engine_method == "gptq_marlin" and cuda.decision.backend == "MARLIN"
    assert cuda.decision.trace["inputs"]["layer"]["model"]["layer_method"] == "gptq_marlin"
    rocm = plan("qwen3-30b-a3b-gptq-int4", "rocm-mi300", tmp=tmp_path / "r").layers[0].quant
    assert rocm == Refused("gptq_marlin quantization is currently not supported in ROCm.", by="SGLang 0.5.23")
    cpu = plan("qwen3-30b-a3b-gptq-int4", "cpu-x86-amx", tmp=tmp_path / "x").layers[0].quant
    assert isinstance(cpu, Unmapped) and "CPUGPTQConfig" in cpu.reason


def test_an_amx_cpu_takes_only_sglang_s_cpu_methods(tmp_path):
    row = plan("deepseek-r1-fp4", "cpu-x86-amx", tmp=tmp_path).layers[0]
    assert isinstance(row.quant, Refused)
    assert row.quant.reason.startswith("Invalid quantization method on CPU: modelopt_fp4. Available methods on CPU: ")
    assert row.outcome.startswith("REFUSED by SGLang 0.5.23 (ValueError)")


def test_modelopt_checkpoints_are_named_by_their_quant_algo(tmp_path):
    """_parse_modelopt_quant_config: NVFP4 -> modelopt_fp4 (config.json or hf_quant_config.json); MIXED_PRECISION
    with NVFP4 layers -> modelopt_mixed, whose FP8 layers get ModelOptFp8MoEMethod."""
    for name in ("deepseek-r1-fp4", "deepseek-r1-fp4-hf-quant-config"):
        row = plan(name, "sm100", tmp=tmp_path / name).layers[0]
        assert row.quant.engine_method == "modelopt_fp4" and row.decision.backend == "FLASHINFER_TRTLLM"
    mixed = plan("synthetic-mixed-nvfp4-fp8", tmp=tmp_path / "m")
    methods = {row.index: row.quant.engine_method for row in mixed.layers}
    assert methods[0] == "unquantized" and methods[1] == "modelopt_fp4" and methods[3] == "modelopt_fp8"
    assert mixed.quant_method == "modelopt_mixed"


def test_awq_falls_back_to_moe_wna16_where_marlin_s_moe_check_fails(tmp_path):
    """AWQMarlinConfig.get_quant_method: check_moe_marlin_supports_layer (768 / 8 = 96 per rank is no multiple of
    128) -> MoeWNA16Config's method, which builds the Triton runner; at TP 1 AWQMoEMethod runs Marlin."""
    tp8 = plan("qwen3-30b-a3b-awq", tmp=tmp_path / "a", parallel=ParallelConfig(tp_size=8)).layers[0]
    assert tp8.quant.engine_method == "moe_wna16" and tp8.decision.backend == "TRITON"
    tp1 = plan("qwen3-30b-a3b-awq", tmp=tmp_path / "b").layers[0]
    assert tp1.quant.engine_method == "awq_marlin" and tp1.decision.backend == "MARLIN"


def test_compressed_tensors_follows_sglang_s_moe_scheme_dispatch():
    w8a8_int8 = {"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"],
                 "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
                 "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}}
    refused = read(w8a8_int8)
    assert refused == Refused("The W8A8Int8 Fused MoE scheme is implemented only for NPU for now.",
                              "NotImplementedError", by="SGLang 0.5.23")
    # group activation order: vLLM refuses it, SGLang's WNA16 Marlin method takes it
    act_order = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                           "symmetric": True, "actorder": "group"}}}}
    mapped = read(act_order)
    assert isinstance(mapped, Mapped) and mapped.scheme.act_order and mapped.engine_method == "compressed-tensors"
    assert isinstance(QuantReader(act_order, LayerContext(platform=preset("sm90"))).layer("model.layers.0.mlp.experts"),
                      Refused)


def test_fp8_ignored_layers_match_by_module_path():
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["layers.0.mlp"]}
    skipped = read(config)
    assert isinstance(skipped, Mapped) and skipped.engine_method == "unquantized"
    assert read({**config, "modules_to_not_convert": ["layers.0.mlp.gate"]}).engine_method == "fp8"
    bad = read({**config, "activation_scheme": "sometimes"})
    assert bad == Refused("Unsupported activation scheme sometimes", by="SGLang 0.5.23")


def test_a_gpu_under_the_class_s_minimum_capability_is_refused_in_sglang_s_words():
    """model_loader/loader.py, with ModelOptFp8Config's get_min_capability (89): an A100 is refused."""
    refused = read({"quant_method": "modelopt", "quant_algo": "FP8"}, "sm80")
    assert refused == Refused("The quantization method modelopt_fp8 is not supported for the current GPU. Minimum "
                              "capability: 89. Current capability: 80.", by="SGLang 0.5.23")
    assert isinstance(read({"quant_method": "modelopt", "quant_algo": "FP8"}, "sm89"), Mapped)


@pytest.mark.parametrize("platform", ["sm90", "sm100", "cpu", "cpu-x86-amx", "rocm-mi300", "rocm-mi355", "xpu"])
def test_no_fixture_reads_in_vllm_s_words_under_sglang(platform, tmp_path):
    """Every fixture, every layer: decided, or refused / not mapped with a reason that is SGLang's or moe-fsm's."""
    for config in sorted(p for p in CONFIGS.iterdir() if (p / "config.json").is_file()):
        result = plan(config.name, platform, tmp=tmp_path / config.name)
        for row in result.layers:
            text = " ".join(str(x) for x in (row.outcome, row.error, getattr(row.quant, "source", "")))
            assert "vLLM" not in text and "vllm" not in text.lower().replace("allow_vllm_cutlass", ""), \
                (config.name, row.index, text)
            assert row.decision is not None or row.error or isinstance(row.quant, (Refused, Unmapped)), config.name
