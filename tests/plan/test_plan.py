"""`moe-fsm plan` on the published config.json of real checkpoints (tests/data/configs/, see its README).

Each expected table is written by hand from the checkpoint's config and the oracles of the policy profile
asked for (``seeds``, or ``vllm-0.33`` for the families only it has): which decoder layers are MoE (DeepSeek's first_k_dense_replace=3, Qwen's
decoder_sparse_step=1), the scheme its quantization_config gives the experts, and
the backend the oracle picks on the platform (e.g. block FP8 on sm90: FlashInfer's
CUTLASS experts, the first in the FP8 priority list that runs on 9.0; on sm80 only
Marlin runs FP8 weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_fsm.cli.main import main
from moe_fsm.inputs.platform import preset
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.plan.model_config import read_model_config
from moe_fsm.plan.plan import layer_ranges, plan_model
from moe_fsm.plan.quant_config import layer_quant
from moe_fsm.plan.quant_fields import Refused, Unmapped

CONFIGS = Path(__file__).parent.parent / "data" / "configs"

FP8_BLOCK = "fp8 w=fp8_e4m3:static:block128x128 a=fp8_e4m3:dynamic:group1x128"
FP8_CHANNEL_TOKEN = "fp8 w=fp8_e4m3:static:channel a=fp8_e4m3:dynamic:token"
FP8_TENSOR_STATIC = "fp8 w=fp8_e4m3:static:tensor a=fp8_e4m3:static:tensor"
NVFP4 = "nvfp4 w=nvfp4:static:group1x16 a=nvfp4:dynamic:group1x16"
EVERY_4TH = ", ".join(str(i) for i in range(3, 48, 4))
NOT_EVERY_4TH = "1-2, " + ", ".join(f"{i}-{i + 2}" for i in range(4, 48, 4))
MXFP4 = "mxfp4 w=fp4_e2m1:static:group1x32:e8m0 a=None"

# (config, platform, backend request[, policy]) -> [(layers, scheme, outcome)], in order of first appearance.
EXPECTED = {
    ("deepseek-v3", "sm90", "auto"): [
        ("3-60", FP8_BLOCK, "FLASHINFER_CUTLASS (FlashInferExperts, via auto_scan, LocalPrepareFinalize)"),
    ],
    ("deepseek-v3", "sm80", "auto"): [
        ("3-60", FP8_BLOCK, "MARLIN (MarlinExperts, via auto_scan, LocalPrepareFinalize)"),
    ],
    ("deepseek-r1-fp4", "sm100", "auto"): [
        ("3-60", NVFP4, "FLASHINFER_TRTLLM (TrtLlmNvFp4ExpertsMonolithic, via auto_scan, LocalPrepareFinalize)"),
    ],
    ("qwen3-30b-a3b", "sm90", "auto"): [
        ("0-47", "unquantized", "TRITON (TritonExperts, via auto_scan, LocalPrepareFinalize)"),
    ],
    ("qwen3-30b-a3b", "cpu", "auto"): [
        ("0-47", "unquantized", "CPU (TorchExperts, via auto_scan, LocalPrepareFinalize)"),
    ],
    ("mixtral-8x7b", "sm90", "auto"): [
        ("0-31", "unquantized", "TRITON (TritonExperts, via auto_scan, LocalPrepareFinalize)"),
    ],
    # gpt-oss under vllm-0.33's MXFP4 oracle (the gpt-oss list; on 9.0 FlashInfer CUTLASS takes MXFP4 x BF16)
    ("gpt-oss-20b", "sm90", "auto", "vllm-0.33"): [
        ("0-23", MXFP4, "FLASHINFER_CUTLASS_MXFP4_BF16 (FlashInferExperts, via auto_scan, LocalPrepareFinalize)")],
    ("gpt-oss-120b", "sm100", "auto", "vllm-0.33"): [
        ("0-35", MXFP4, "FLASHINFER_TRTLLM_MXFP4_BF16 (TrtLlmMxfp4ExpertsMonolithic, via auto_scan, LocalPrepareFinalize)")],
    ("qwen3-30b-a3b-fp8-dynamic", "sm90", "auto"): [
        ("0-47", FP8_CHANNEL_TOKEN, "VLLM_CUTLASS (TritonOrCutlassExperts, via auto_scan, LocalPrepareFinalize)"),
    ],
    ("qwen3-30b-a3b-nvfp4", "sm100", "auto"): [
        ("0-47", NVFP4, "FLASHINFER_TRTLLM (TrtLlmNvFp4ExpertsMonolithic, via auto_scan, LocalPrepareFinalize)"),
    ],
    # PR #43334: one global b12x fails the FP8 layers (and the bf16 one) exactly as vLLM would ...
    ("synthetic-mixed-nvfp4-fp8", "sm121", "flashinfer_b12x"): [
        ("0", "unquantized", "FAILED BackendUnsupportedError: moe_backend='flashinfer_b12x' is not supported for "
         "Unquantized MoE. Expected one of ['triton', 'flashinfer_trtllm', 'flashinfer_cutlass', 'aiter', 'torch_grouped_mm']."),
        (NOT_EVERY_4TH, NVFP4, "FLASHINFER_B12X (FlashInferB12xExperts, via explicit_user_choice, LocalPrepareFinalize)"),
        (EVERY_4TH, FP8_TENSOR_STATIC, "FAILED BackendUnsupportedError: moe_backend='flashinfer_b12x' is not supported "
         "for FP8 MoE. Expected one of ['triton', 'deep_gemm', 'cutlass', 'flashinfer_trtllm', 'flashinfer_cutlass', "
         "'marlin', 'aiter', 'torch_grouped_mm']."),
    ],
    # ... and a per-family request gives the FP8 layers auto.
    ("synthetic-mixed-nvfp4-fp8", "sm121", "nvfp4=flashinfer_b12x"): [
        ("0", "unquantized", "TRITON (TritonExperts, via auto_scan, LocalPrepareFinalize)"),
        (NOT_EVERY_4TH, NVFP4, "FLASHINFER_B12X (FlashInferB12xExperts, via explicit_user_choice, LocalPrepareFinalize)"),
        (EVERY_4TH, FP8_TENSOR_STATIC, "FLASHINFER_CUTLASS (FlashInferExperts, via auto_scan, LocalPrepareFinalize)"),
    ],
}


@pytest.mark.parametrize("case", list(EXPECTED), ids=["-".join(c) for c in EXPECTED])
def test_plan_matches_the_hand_written_table(case, tmp_path):
    name, platform, backend, policy = (*case, "seeds")[:4]
    plan = plan_model(CONFIGS / name, platform=preset(platform), backend=backend, env={}, trace_dir=tmp_path, policy=policy)
    got = [(layer_ranges([r.index for r in rows]), scheme, outcome) for (scheme, outcome), rows in plan.groups()]
    assert got == EXPECTED[case]
    decided = [r for r in plan.layers if r.decision is not None or r.error is not None]
    # one trace per distinct decision (named after the first layer that got it) and a manifest for every layer
    first = {}
    for row in decided:
        first.setdefault(row.group, row)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [r.trace_path.name for r in first.values()] + (["plan.manifest"] if decided else []))
    for row in decided:
        document = json.loads(row.trace_path.read_text())
        assert document["layer_name"] == first[row.group].name and row.trace_path == first[row.group].trace_path
        assert row.decision is None or row.decision.trace["layer_name"] == row.name  # in memory: its own name
    if decided:
        manifest = json.loads((tmp_path / "plan.manifest").read_text())
        assert [(m["index"], m["name"], m["trace"]) for m in manifest["layers"]] == [
            (r.index, r.name, r.trace_path.name if r.trace_path else None) for r in plan.layers]
    assert plan.ok == all(not outcome.startswith(("FAILED", "NOT MAPPED")) for _, _, outcome in EXPECTED[case])


def test_shapes_come_from_each_architectures_spelling():
    ds = read_model_config(CONFIGS / "deepseek-v3" / "config.json")
    assert (ds.num_layers, ds.moe_layers[0], len(ds.moe_layers)) == (61, 3, 58)
    g = ds.geometry
    assert (g.num_experts, g.top_k, g.hidden_size, g.intermediate_size, g.shared_experts) == (256, 8, 7168, 2048, 1)
    mixtral = read_model_config(CONFIGS / "mixtral-8x7b")
    assert (mixtral.geometry.num_experts, mixtral.geometry.intermediate_size) == (8, 14336)
    assert mixtral.experts_module(5) == "model.layers.5.block_sparse_moe.experts"
    oss = read_model_config(CONFIGS / "gpt-oss-120b")
    assert (oss.geometry.num_experts, oss.geometry.top_k, oss.geometry.swiglu_limit, oss.geometry.activation.value) == (128, 4, 7.0, "swigluoai")


def test_quantization_readers_follow_vllms_rules():
    experts = "model.layers.7.mlp.experts"
    # fp8: ignored_layers / modules_to_not_convert name a whole module exactly (is_layer_skipped, "exact")
    exact = {"quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": [experts]}
    assert layer_quant(exact, experts).scheme == QuantScheme.unquantized()
    parent = {**exact, "modules_to_not_convert": ["model.layers.7.mlp"]}
    assert layer_quant(parent, experts).scheme == QuantScheme.fp8("tensor", "tensor")
    assert isinstance(layer_quant({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]}, experts), Unmapped)
    assert layer_quant({"quant_method": "fp8", "activation_scheme": "static"}, experts).scheme == QuantScheme.fp8("tensor", "tensor", True)
    refused = layer_quant({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, experts)
    assert isinstance(refused, Refused) and "block-wise quantization only supports dynamic" in refused.reason
    # modelopt: flat or nested, wildcards, W4A16
    flat = {"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["model.layers.7.mlp*"]}
    assert "excluded by 'model.layers.7.mlp*'" in layer_quant(flat, experts).source
    nested = {"quant_algo": "W4A16_NVFP4", "group_size": 16, "kv_cache_quant_algo": None, "exclude_modules": []}
    w4a16 = layer_quant({"quant_method": "modelopt", "quantization": nested}, experts).scheme
    assert w4a16.family.value == "nvfp4" and w4a16.activation is None
    del nested["kv_cache_quant_algo"]  # the hf_quant_config.json form must name all three (ModelOptNvFp4Config)
    missing = layer_quant({"quant_method": "modelopt", "quantization": nested}, experts)
    assert missing.reason == "NVFP4 quantization requires the following fields in hf_quant_config.json: ['kv_cache_quant_algo']"
    # compressed-tensors: ignore by regex, projections split across groups with different args
    ct = json.loads((CONFIGS / "qwen3-30b-a3b-fp8-dynamic" / "config.json").read_text())["quantization_config"]
    mapped = layer_quant(ct, experts)
    assert mapped.allow_vllm_cutlass and mapped.scheme == QuantScheme.fp8("channel", "token")
    assert layer_quant({**ct, "ignore": ["re:.*experts.*"]}, experts).scheme == QuantScheme.unquantized()
    group = ct["config_groups"]["group_0"]
    split = {**ct, "config_groups": {**ct["config_groups"], "down": {**group, "targets": ["re:.*down_proj$"], "weights": {
        **group["weights"], "strategy": "tensor"}}}}
    assert layer_quant(split, experts).reason == "All MoE projections need to have same quantization scheme but found multiple"
    same_args = {**ct, "config_groups": {**ct["config_groups"], "down": {**group, "targets": ["re:.*down_proj$"]}}}
    assert layer_quant(same_args, experts).scheme == QuantScheme.fp8("channel", "token")  # equal args: one scheme
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}
    assert layer_quant(int4, experts).scheme == QuantScheme.int_wna16(4, 128, False, "compressed-tensors")
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    assert layer_quant(gptq, experts).scheme == QuantScheme.int_wna16(4, 128, False, "gptq")
    bnb = layer_quant({"quant_method": "bitsandbytes", "load_in_4bit": True}, experts)
    assert isinstance(bnb, Refused) and bnb.reason.startswith("Unknown quantization method: bitsandbytes. Must be one of [")


def test_cli_prints_the_grouped_table_and_exits_1_when_a_layer_fails(tmp_path, capsys):
    code = main(["plan", str(CONFIGS / "synthetic-mixed-nvfp4-fp8"), "--platform", "sm121", "--no-env", "--policy", "seeds",
                 "--backend", "flashinfer_b12x", "--trace-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert "48 MoE layer(s), 3 distinct outcome(s):" in out
    assert f"[3] 12 x layers {EVERY_4TH}: {FP8_TENSOR_STATIC} -> FAILED BackendUnsupportedError" in out
    assert "[3]    47     model.layers.47.mlp.experts  FAILED" in out
    code = main(["plan", str(CONFIGS / "deepseek-v3" / "config.json"), "--platform", "sm90", "--no-env", "--policy", "seeds",
                 "--trace-dir", str(tmp_path / "ds"), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and len(data["layers"]) == 58 and data["profile"]["name"] == "seeds"
    assert {row["backend"] for row in data["layers"]} == {"FLASHINFER_CUTLASS"}


def test_cli_bad_config_is_one_line(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}')
    assert main(["plan", str(tmp_path), "--platform", "sm90"]) == 2
    assert "names no expert count" in capsys.readouterr().err


def test_plan_needs_no_torch(tmp_path):
    """plan is decision core: the whole command runs where torch cannot even be imported."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from moe_fsm.cli.main import main\n"
        f"sys.exit(main(['plan', {str(CONFIGS / 'synthetic-mixed-nvfp4-fp8')!r}, '--platform', 'sm121', '--no-env', "
        f"'--policy', 'seeds', '--backend', 'nvfp4=flashinfer_b12x', '--json', '--trace-dir', {str(tmp_path)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    backends = {row["backend"] for row in json.loads(done.stdout)["layers"]}
    assert backends == {"TRITON", "FLASHINFER_B12X", "FLASHINFER_CUTLASS"}
    assert len(list(tmp_path.glob("*.json"))) == 3  # one trace per distinct decision, plan.manifest for the 48 layers


# -- issue 41 item 4: the manifest hint, one meaning of --layer, --json as its help says, flags in messages --------------


def test_the_explain_hint_is_printed_only_when_a_manifest_was_written(tmp_path, capsys):
    assert main(["plan", str(CONFIGS / "llama-4-maverick-fp8"), "--platform", "sm90", "--policy", "vllm-0.33", "--no-env",
                 "--trace-dir", str(tmp_path / "traces")]) == 1
    out = capsys.readouterr().out
    assert "REFUSED  -" in out and "moe-fsm explain" not in out
    assert out.rstrip().endswith("traces: none written (no layer was decided, so there is no plan.manifest)")
    assert not (tmp_path / "traces").exists()


def test_layer_n_is_the_decoder_layer_in_run_and_plan_manifests(tmp_path, capsys):
    """DeepSeek-V3's MoE layers start at decoder layer 3: `--layer 3` is model.layers.3 in both manifests, and both
    name its trace file layer003-... (a run numbered it by MoE position: layer000-model.layers.3...)."""
    assert main(["run", "--preset", "deepseek-v3", "--layers", "2", "--tokens", "4", "--device", "cpu",
                 "--trace-dir", str(tmp_path / "run")]) == 0
    assert main(["plan", str(CONFIGS / "deepseek-v3"), "--platform", "sm90", "--policy", "seeds", "--no-env",
                 "--trace-dir", str(tmp_path / "plan")]) == 0
    capsys.readouterr()
    for folder, manifest in (("run", "run.manifest"), ("plan", "plan.manifest")):
        assert (tmp_path / folder / "layer003-model.layers.3.mlp.experts.json").is_file()
        assert main(["explain", str(tmp_path / folder / manifest), "--layer", "3"]) == 0
        assert "MoE layer (model.layers.3.mlp.experts)" in capsys.readouterr().out.splitlines()[0], folder
    run_manifest = json.loads((tmp_path / "run" / "run.manifest").read_text())
    assert [(row["index"], row["name"]) for row in run_manifest["layers"]] == [
        (3, "model.layers.3.mlp.experts"), (4, "model.layers.4.mlp.experts")]


def test_plan_json_is_the_object_its_help_describes(tmp_path, capsys):
    """plan --json's help promised "one object per layer"; it prints one object whose "layers" holds them."""
    assert main(["plan", "--help"]) == 0
    assert "print the plan as one JSON object" in " ".join(capsys.readouterr().out.split())
    assert main(["plan", str(CONFIGS / "qwen3-30b-a3b-gptq-int4"), "--platform", "sm90", "--policy", "vllm-0.33",
                 "--no-env", "--json", "--trace-dir", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"config", "platform", "parallel", "request", "profile", "quant_method", "layers"} <= set(data)
    assert data["quant_method"] == "auto_gptq" and len(data["layers"]) == 48
    assert data["layers"][0]["vllm_method"] == "AutoGPTQMoEMethod" and data["layers"][0]["config_says"] == "gptq 4-bit group 128"


def test_a_parallel_layout_error_names_the_flags(tmp_path, capsys):
    assert main(["plan", str(CONFIGS / "qwen3-30b-a3b"), "--platform", "sm90", "--dp", "8", "--ep", "8", "--all2all",
                 "deepep_low_latency", "--no-env", "--trace-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "set --batched" in err and "--all2all 'deepep_low_latency'" in err and "batched_activation_format" not in err
