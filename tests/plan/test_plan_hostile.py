"""`moe-fsm plan` on hostile or broken config.json files (issue 24): one clear line, exit 2, nothing written.

Bytes that are not UTF-8, sizes no real model has (``num_hidden_layers: 1000000`` once wrote 176,904
traces in a minute), wrong types anywhere plan reads, and name lists long enough to make a per-layer
scan quadratic.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

from moe_fsm.cli.main import main
from moe_fsm.errors import InputError
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.plan import name_matching
from moe_fsm.plan.model_config import LIMITS, read_model_config
from moe_fsm.plan.quant_config import QuantReader, layer_quant
from moe_fsm.plan.quant_fields import LayerContext

CONFIGS = Path(__file__).parent.parent / "data" / "configs"
QWEN = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())


def _plan(tmp_path, config, capsys, raw: bytes | None = None) -> tuple[int, str]:
    path = tmp_path / "config.json"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text(json.dumps(config))
    code = main(["plan", str(path), "--platform", "sm90", "--no-env", "--policy", "seeds",
                 "--trace-dir", str(tmp_path / "traces")])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.err


@pytest.mark.parametrize("raw, says", [
    (b"\xff\xfe{\x00}\x00", "UTF-16 text"),
    (b"\xfe\xff\x00{\x00}", "UTF-16 text"),
    (b'{"num_experts": 8, "name": "\x80\x81"}', "is not UTF-8 text (byte 28)"),
    (b"\x00\x01\x02binary", "is not valid JSON"),
])
def test_a_config_that_is_not_utf8_json_is_one_line(tmp_path, capsys, raw, says):
    code, err = _plan(tmp_path, None, capsys, raw)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "traces").exists()


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(QWEN).encode())
    assert read_model_config(tmp_path).geometry.num_experts == 128


@pytest.mark.parametrize("key, value, says", [
    ("num_hidden_layers", 1_000_000, "num_hidden_layers must be an integer in 1..1024"),
    ("num_hidden_layers", 0, "num_hidden_layers must be an integer in 1..1024"),
    ("num_hidden_layers", "48", "num_hidden_layers must be an integer in 1..1024"),
    ("num_hidden_layers", True, "num_hidden_layers must be an integer"),
    ("num_hidden_layers", 48.0, "num_hidden_layers must be an integer"),
    ("num_experts", 1_000_000_000_000, "num_experts must be an integer in 1..4096"),
    ("num_experts", -8, "num_experts must be an integer in 1..4096"),
    ("num_experts_per_tok", 129, "num_experts_per_tok must be an integer in 1..128"),
    ("num_experts_per_tok", 200 - 64, "num_experts_per_tok must be an integer in 1..128"),
    ("hidden_size", 10**9, "hidden_size must be an integer in 1..262144"),
    ("moe_intermediate_size", [768], "moe_intermediate_size must be an integer in 1..262144"),
    ("decoder_sparse_step", "1", "decoder_sparse_step must be an integer in 1..48"),
    ("mlp_only_layers", "0,1", "mlp_only_layers must be a list of layer indices"),
    ("hidden_act", ["silu"], "hidden_act must be one of"),
    ("hidden_act", "relu", "hidden_act 'relu' is not one of"),
    ("torch_dtype", "float8_e4m3fn", "torch_dtype must be one of"),
    ("architectures", "Qwen3MoeForCausalLM", "architectures must be a list of architecture names"),
    ("architectures", [{"a": 1}], "architectures must be a list of architecture names"),
    ("text_config", [], "text_config must be an object"),
    ("quantization_config", ["fp8"], "quantization_config must be an object"),
    ("swiglu_limit", float("inf"), "swiglu_limit must be a positive finite number"),
    ("n_shared_experts", 10**6, "n_shared_experts must be an integer in 0..64"),
])
def test_implausible_sizes_and_wrong_types_name_the_field_and_what_is_accepted(tmp_path, capsys, key, value, says):
    code, err = _plan(tmp_path, {**QWEN, key: value}, capsys)
    assert code == 2, err
    assert says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "traces").exists()  # refused before any layer was decided


def test_top_k_above_the_expert_count_names_both(tmp_path, capsys):
    code, err = _plan(tmp_path, {**QWEN, "num_experts": 4, "num_experts_per_tok": 8}, capsys)
    assert code == 2 and "top-k 8 exceeds the expert count 4" in err


def test_the_largest_accepted_sizes_are_read():
    high = {key: LIMITS[key][1] for key in LIMITS}
    assert high["layers"] >= 8 * 126 and high["experts"] >= 8 * 512  # Llama-3.1-405B's depth, Qwen3-Next's experts


def test_the_range_boundaries(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN, "num_hidden_layers": 1024, "num_experts": 4096, "num_experts_per_tok": 128,
                                "mlp_only_layers": [], "decoder_sparse_step": 1}))
    model = read_model_config(path)
    assert (model.num_layers, len(model.moe_layers), model.geometry.num_experts) == (1024, 1024, 4096)
    path.write_text(json.dumps({**QWEN, "num_hidden_layers": 1025}))
    with pytest.raises(InputError, match=r"1\.\.1024"):
        read_model_config(path)


@pytest.mark.parametrize("quantization, says", [
    ({"quant_method": "fp8", "weight_block_size": "128x128"}, "weight_block_size must be a list of positive numbers"),
    ({"quant_method": "fp8", "modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list of module names"),
    ({"quant_method": "fp8", "activation_scheme": 1}, "activation_scheme must be 'dynamic' or 'static'"),
    ({"quant_method": "modelopt", "quant_algo": ["NVFP4"]}, "quant_algo must be a quant_algo name"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": [1, 2]}, "exclude_modules must be a list"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": []}, "quantized_layers must be an object"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
      "quantized_layers": {"model.layers.0.mlp.experts.0.up_proj": "NVFP4"}}, "quantized_layers['model.layers.0.mlp.experts.0.up_proj'] must be an object"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": ["Linear"]}}, "config_groups['g'] must be an object"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": "Linear"}}}, "config_groups['g'].targets must be a list"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": 8}}}, "config_groups['g'].weights must be an object"),
    ({"quant_method": "compressed-tensors", "ignore": ["re:(unclosed"]}, "is not a regular expression"),
    ({"quant_method": "gptq", "bits": "4", "group_size": 128, "desc_act": False, "sym": True}, "bits must be an integer"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True, "dynamic": ["-:.*"]},
     "dynamic must be an object of module regexes"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": "yes"}, "zero_point must be true or false"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "type": "int", "num_bits": 4, "strategy": "group"}}}}, "weights.group_size must be a positive integer"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "type": "int", "num_bits": 4, "strategy": "tiles"}}}}, "weights.strategy must be one of"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "type": "float", "num_bits": 8, "strategy": "token"}}}}, "'token' only with dynamic: true"),
])
def test_wrongly_typed_quantization_fields_are_named(tmp_path, capsys, quantization, says):
    code, err = _plan(tmp_path, {**QWEN, "num_hidden_layers": 4, "quantization_config": quantization}, capsys)
    assert code == 2 and "quantization_config: " in err and says in err, err


FP8_PER_TENSOR_ARGS = {"type": "float", "num_bits": 8, "strategy": "tensor"}
CT_FP8 = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
    "type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}, "input_activations": FP8_PER_TENSOR_ARGS}}}


def _ct_fp8(weights: dict | None = None, **activations) -> dict:
    group = CT_FP8["config_groups"]["group_0"]
    return {**CT_FP8, "config_groups": {"group_0": {**group, "weights": {**group["weights"], **(weights or {})},
                                                    "input_activations": {**FP8_PER_TENSOR_ARGS, **activations}}}}


@pytest.mark.parametrize("quantization, says", [
    # vLLM's Fp8Config: activation_scheme required, exactly one of ACTIVATION_SCHEMES (a ValueError otherwise)
    ({"quant_method": "fp8", "activation_scheme": "Dynamic"}, "activation_scheme must be 'dynamic' or 'static', in lower case"),
    ({"quant_method": "fp8", "activation_scheme": "banana"}, "activation_scheme must be 'dynamic' or 'static', in lower case"),
    ({"quant_method": "fp8", "activation_scheme": None}, "got None"),
    ({"quant_method": "fp8"}, "activation_scheme is missing; vLLM's fp8 reader requires it"),
    # compressed-tensors' QuantizationArgs: strings other than "local" are not its DynamicType, null is neither type
    (_ct_fp8(dynamic="false"), "config_groups['group_0'].input_activations.dynamic must be true or false"),
    (_ct_fp8(dynamic="true"), "input_activations.dynamic must be true or false (JSON booleans, not strings)"),
    (_ct_fp8(dynamic=None), "input_activations.dynamic must be"),
    (_ct_fp8(dynamic=2), "input_activations.dynamic must be"),
    (_ct_fp8(dynamic="local"), "or \"local\" with strategy tensor_group, got 'local'"),
    (_ct_fp8(weights={"dynamic": "false"}), "config_groups['group_0'].weights.dynamic must be true or false"),
])
def test_values_vllm_refuses_are_refused_by_name(tmp_path, capsys, quantization, says):
    code, err = _plan(tmp_path, {**QWEN, "num_hidden_layers": 4, "quantization_config": quantization}, capsys)
    assert code == 2 and "quantization_config: " in err and says in err, err
    assert not (tmp_path / "traces").exists()


@pytest.mark.parametrize("activations, static", [
    ({}, True), ({"dynamic": False}, True), ({"dynamic": 0}, True),  # absent reads false, as compressed-tensors' default
    ({"dynamic": True}, False), ({"dynamic": 1}, False), ({"dynamic": 1.0}, False),  # pydantic's bool takes 0/1
])
def test_compressed_tensors_dynamic_reads_as_vllm_reads_it(activations, static):
    """Per-tensor FP8 weights: static per-tensor activations, or dynamic ones, which vLLM's
    CompressedTensorsW8A8Fp8MoEMethod keys kFp8Dynamic128Sym (groups of 128)."""
    group = {**CT_FP8["config_groups"]["group_0"], "input_activations": {**FP8_PER_TENSOR_ARGS, **activations}}
    mapped = layer_quant({**CT_FP8, "config_groups": {"group_0": group}}, "model.layers.0.mlp.experts")
    assert mapped.scheme == (QuantScheme.fp8("tensor", "tensor", static_activation=True) if static
                             else QuantScheme.fp8("tensor", "group"))


def test_local_dynamic_goes_with_the_tensor_group_strategy():
    nvfp4 = {"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16}
    config = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {**nvfp4, "dynamic": False}, "input_activations": {**nvfp4, "dynamic": "LOCAL"}}}}
    assert layer_quant(config, "model.layers.0.mlp.experts").scheme == QuantScheme.nvfp4()


def _plan_in_a_process(tmp_path, quantization: dict) -> subprocess.CompletedProcess:
    """plan in its own process, so that a match that never ends fails the test instead of hanging the suite."""
    (tmp_path / "config.json").write_text(json.dumps({**QWEN, "num_hidden_layers": 4, "quantization_config": quantization}))
    return subprocess.run([sys.executable, "-m", "moe_fsm", "plan", str(tmp_path / "config.json"), "--platform", "sm90",
                           "--no-env", "--policy", "seeds", "--trace-dir", str(tmp_path / "traces")],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("where", ["ignore", "targets"])
def test_a_pattern_that_backtracks_without_end_is_matched_at_once(tmp_path, where):
    """re:(.|.)*Z took 2^40 steps against a 40-character module name under re.match; plan hung."""
    config = _ct_fp8()
    if where == "ignore":
        config["ignore"] = ["re:(.|.)*Z"]
    else:
        config["config_groups"]["group_0"]["targets"] = ["re:(.|.)*Z"]
    done = _plan_in_a_process(tmp_path, config)
    assert done.returncode == 0, done.stderr
    if where == "ignore":  # no module name holds a Z: nothing is ignored, and the group quantizes the experts
        assert "compressed-tensors: ignored" not in done.stdout and "compressed-tensors FP8" in done.stdout, done.stdout
    else:
        assert "compressed-tensors: no config group targets the experts" in done.stdout, done.stdout


def test_a_pattern_still_running_after_the_bound_is_one_line_naming_it(tmp_path):
    done = _plan_in_a_process(tmp_path, {**_ct_fp8(), "ignore": ["lm_head", "re:(.|.)*\\d{3}"]})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "ignore pattern 're:(.|.)*\\\\d{3}' was still matching module " \
        f"'model.layers.0.mlp.experts.0.gate_proj' after {name_matching.REGEX_TIMEOUT_S} s" in done.stderr, done.stderr
    assert not (tmp_path / "traces").exists()  # every layer's quantization is read before any is decided


CT_PATTERNS = ["re:.*mlp.gate$", "re:.*experts.*", "re:.*down_proj$", "re:model.layers.[0-9]+.mlp.experts.*",
               r"re:^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up)_proj$", "re:(?i).*EXPERTS.0.UP.*", "re:.*layers.1[0-9]\\.",
               "re:(?:model|lm)", "re:.*\\bgate", "re:.*(?<!up)_proj$", "re:.*experts\\.0\\.(?=down)"]
CT_NAMES = [f"model.layers.{i}.mlp.experts.0.{proj}" for i in (0, 7, 12) for proj in ("gate_proj", "up_proj", "down_proj")]


def test_regex_patterns_match_as_vllms_re_match_does():
    """The bounded matcher answers as vLLM's ``re.match(pattern, name)`` does, pattern by pattern and in list order."""
    for pattern in CT_PATTERNS:
        targets = name_matching.VllmRegex([pattern], "ignore")
        for name in CT_NAMES:
            assert (targets.first(name) == pattern) == bool(re.match(pattern[3:], name)), (pattern, name)
    ordered = name_matching.VllmRegex(CT_PATTERNS, "ignore")
    for name in CT_NAMES:
        assert ordered.first(name) == next((p for p in CT_PATTERNS if re.match(p[3:], name)), None), name


@pytest.mark.parametrize("pattern", ["re:\\p{L}", "re:a(?i)b", "re:(unclosed"])
def test_a_pattern_re_refuses_is_refused_though_regex_takes_it(pattern):
    with pytest.raises(InputError, match=r"ignore pattern .* is not a regular expression"):
        QuantReader({"quant_method": "compressed-tensors", "ignore": [pattern]})


def test_pattern_lists_are_capped_and_plain_names_are_not():
    plain = [f"model.layers.{i}.self_attn.o_proj" for i in range(50_000)]
    reader = QuantReader({"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": plain + ["lm_head"]})
    assert reader.layer("model.layers.3.mlp.experts").scheme.family.value == "nvfp4"
    wild = [f"model.layers.{i}.self_attn*" for i in range(name_matching.MAX_PATTERNS + 1)]
    with pytest.raises(InputError, match="wildcard patterns; moe-fsm takes at most 4096"):
        QuantReader({"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": wild})
    with pytest.raises(InputError, match="groups; moe-fsm takes at most 256"):
        QuantReader({"quant_method": "compressed-tensors",
                     "config_groups": {str(i): {"targets": ["Linear"]} for i in range(257)}})


def _naive_modelopt_exclusion(experts, patterns):
    """The rule as a plain scan, to compare the indexed reader with."""
    for pattern in patterns:
        if fnmatch(experts, pattern) or (pattern != experts and pattern and pattern in experts):
            return pattern
        if pattern.endswith("*") and fnmatch(experts + ".", pattern):
            return pattern
    return None


def test_indexed_name_lists_answer_as_a_scan_would():
    patterns = ["", "lm_head", "model.layers.1*", "layers.2.mlp", "model.layers.3.mlp.experts", "*.5.mlp.*",
                "model.layers.?.mlp", "model.layers.1", "experts", "model.layers.[7].mlp.experts"]
    for order in (patterns, patterns[::-1]):
        reader = QuantReader({"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": order})
        for i in range(12):
            experts = f"model.layers.{i}.mlp.experts"
            got = reader.layer(experts)
            want = _naive_modelopt_exclusion(experts, order)
            assert (got.source == f"modelopt: excluded by {want!r}") if want else got.source == "modelopt NVFP4"
    mixed = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "model.layers.1.self_attn.q_proj": {"quant_algo": "FP8"},
        "model.layers.1.mlp.experts.0.up_proj": {"quant_algo": "NVFP4"},
        "model.layers.2.mlp.gate_proj": {"quant_algo": "FP8"},
        "model.layers.10.mlp.experts.3.down_proj": {"quant_algo": "FP8"},
    }}
    got = {i: QuantReader(mixed).layer(f"model.layers.{i}.mlp.experts") for i in (1, 2, 3, 10)}
    assert "NVFP4 (model.layers.1.mlp.experts.0.up_proj)" in got[1].source
    assert "FP8 (model.layers.2.mlp.gate_proj)" in got[2].source
    assert got[3].source == "modelopt MIXED_PRECISION: not in quantized_layers"
    assert "FP8 (model.layers.10.mlp.experts.3.down_proj)" in got[10].source
    # AWQ's modules_to_not_convert: a substring of the experts module's name (is_layer_skipped, "substring")
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
    context = LayerContext(hidden_size=2048, intermediate_size=768)
    for patterns, hit in ((["model.layers.4.mlp"], True), (["layers.4.ml"], True), (["*.4.mlp"], False),
                          (["model.layers.4.mlp.experts.0"], False), (["gate"], False)):
        source = layer_quant({**awq, "modules_to_not_convert": patterns}, "model.layers.4.mlp.experts", context)
        assert source.source.startswith("awq: not converted") == hit, patterns


def test_a_malformed_entry_of_a_late_layer_is_refused_before_any_trace_is_written(tmp_path, capsys):
    """Found by the plan fuzz driver: the last layer's quantized_layers entry was checked only when its turn came."""
    config = json.loads((CONFIGS / "synthetic-mixed-nvfp4-fp8" / "config.json").read_text())
    config["quantization_config"]["quantized_layers"]["model.layers.47.mlp.experts.0.gate_proj"] = "FP8"
    code, err = _plan(tmp_path, config, capsys)
    assert code == 2 and "quantized_layers['model.layers.47.mlp.experts.0.gate_proj'] must be an object" in err
    assert not (tmp_path / "traces").exists()
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8}}, "h": {"targets": ["x"], "weights": []}}}
    code, err = _plan(tmp_path, config, capsys)
    assert code == 2 and "config_groups['h'].weights must be an object" in err
    assert not (tmp_path / "traces").exists()


# -- issue 24 item 4: one trace per distinct decision, and a manifest that explain and replay read ----------------------


def test_plan_writes_one_trace_per_distinct_decision_and_explain_reads_the_manifest(tmp_path, capsys):
    config = CONFIGS / "synthetic-mixed-nvfp4-fp8"
    argv = ["plan", str(config), "--platform", "sm121", "--no-env", "--policy", "seeds", "--backend", "flashinfer_b12x",
            "--trace-dir", str(tmp_path)]
    assert main(argv) == 1  # the FP8 and bf16 layers fail under b12x
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "layer000-model.layers.0.mlp.experts.json", "layer001-model.layers.1.mlp.experts.json",
        "layer003-model.layers.3.mlp.experts.json", "plan.manifest"]
    manifest = tmp_path / "plan.manifest"
    assert main(["explain", str(manifest), "--layer", "47"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Decision for a fp8 MoE layer (model.layers.47.mlp.experts)")
    assert "layer003-model.layers.3.mlp.experts.json, shared by 12 layer(s): 3, 7, 11" in out
    assert main(["explain", str(manifest)]) == 0
    assert capsys.readouterr().out.count("Decision for a ") == 3
    assert main(["replay", str(manifest)]) == 0
    assert capsys.readouterr().out.count("byte-identical") == 3
    # the trace file itself still explains and replays on its own
    assert main(["replay", str(tmp_path / "layer001-model.layers.1.mlp.experts.json")]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("edit, says", [
    (lambda m: m.update(layers="x"), "has no list of layers"),
    (lambda m: m["layers"][0].update(trace="../../etc/passwd"), "not a file beside the manifest"),
    (lambda m: m["layers"][0].update(index="0"), "needs an integer index and a name"),
    (lambda m: m["layers"][5].update(trace="nowhere.json"), "does not exist"),
])
def test_a_broken_manifest_is_one_line(tmp_path, capsys, edit, says):
    assert main(["plan", str(CONFIGS / "qwen3-30b-a3b"), "--platform", "sm90", "--no-env", "--policy", "seeds",
                 "--trace-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    manifest = json.loads((tmp_path / "plan.manifest").read_text())
    edit(manifest)
    (tmp_path / "plan.manifest").write_text(json.dumps(manifest))
    assert main(["explain", str(tmp_path / "plan.manifest"), "--layer", "5"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_layer_needs_a_manifest(tmp_path, capsys):
    assert main(["plan", str(CONFIGS / "qwen3-30b-a3b"), "--platform", "sm90", "--no-env", "--trace-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    trace = next(tmp_path.glob("*.json"))
    assert main(["explain", str(trace), "--layer", "3"]) == 2
    assert "--layer picks a layer of a plan.manifest or run.manifest" in capsys.readouterr().err


ESCAPES = "\x1b[31mred\x1b]0;title\x07\x9b2J\nforged line\tx"


def test_strings_from_the_config_are_shown_escaped(tmp_path, capsys):
    """Escape sequences in architectures, model_type and the quantization_config are shown, not obeyed (as explain)."""
    mixed = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
             "quantized_layers": {"model.layers.0.mlp.experts.0.up_proj" + ESCAPES: {"quant_algo": "FP8"}}}
    out = ""
    for name, config, code in (("mixed", {**QWEN, "architectures": ["Qwen3" + ESCAPES], "model_type": "m" + ESCAPES,
                                          "quantization_config": mixed}, 0),
                               ("method", {**QWEN, "quantization_config": {"quant_method": "q" + ESCAPES}}, 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
        # exit 1 for the unknown quant_method: vLLM refuses it, every layer is a REFUSED row
        assert main(["plan", str(tmp_path / name), "--platform", "sm90", "--no-env", "--trace-dir", str(tmp_path / "t")]) == code
        out += capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\x9b\t"), out
    assert not any(line.startswith("forged line") for line in out.splitlines()), out
    shown = r"\x1b[31mred\x1b]0;title\x07\x9b2J\nforged line\tx"
    for what in (f"moe-fsm plan: Qwen3{shown} (m{shown})", f"quantization_config: q{shown}",
                 f"FP8 (model.layers.0.mlp.experts.0.up_proj{shown})", "Unknown quantization method: q\\x1b[31m"):
        assert what in out, (what, out)


def test_the_explain_hint_is_a_command_the_shell_reads_as_printed(tmp_path, capsys):
    trace_dir = tmp_path / "it's a dir; with $(spaces)"
    assert main(["plan", str(CONFIGS / "qwen3-30b-a3b"), "--platform", "sm90", "--no-env", "--policy", "seeds",
                 "--trace-dir", str(trace_dir)]) == 0
    hint = capsys.readouterr().out.rsplit("`", 2)[1]
    assert shlex.split(hint) == ["moe-fsm", "explain", str(trace_dir / "plan.manifest"), "--layer", "N"]
    assert (trace_dir / "plan.manifest").is_file()
