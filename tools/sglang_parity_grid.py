"""The scenarios tools/sglang_parity.py runs: moe-fsm input specs (the spec language of moe_fsm.inputs.spec)
across SGLang's quantization methods, architectures, platforms, --moe-runner-backend choices, all-to-all
backends, parallel layouts, DeepEP modes, env settings, --quantization flags and draft layers.

Each part of the grid sweeps a few dimensions in full with the others at a plain value; a seeded random part
mixes them all. Duplicates are dropped.
"""

from __future__ import annotations

import json
import random

from moe_fsm.profiles.sglang_0_5_23.pipeline import RUNNER_CHOICES

SHAPE = {"experts": 8, "top_k": 2, "hidden": 1024, "intermediate": 512}

# name -> layer spec words (SGLang's method as the checkpoint declares it in quant_method)
LAYERS = {
    "bf16": {"quant": "unquantized"},
    "bf16-oai": {"quant": "unquantized", "activation": "swigluoai", "swiglu_limit": 7.0, "bias": True},
    "bf16-unaligned": {"quant": "unquantized", "intermediate": 320},
    "fp8-block": {"quant": "fp8", "weight_scale": "block", "quant_method": "fp8"},
    "fp8-channel": {"quant": "fp8", "weight_scale": "channel", "quant_method": "fp8"},
    "fp8-tensor-static": {"quant": "fp8", "weight_scale": "tensor", "act_scale": "tensor", "static_act": True,
                          "quant_method": "fp8"},
    "fp8-ct-channel": {"quant": "fp8", "weight_scale": "channel", "quant_method": "compressed-tensors"},
    "fp8-ct-block": {"quant": "fp8", "weight_scale": "block", "quant_method": "compressed-tensors"},
    "fp8-modelopt": {"quant": "fp8", "weight_scale": "tensor", "act_scale": "tensor", "static_act": True,
                     "quant_method": "modelopt"},
    "mxfp8": {"quant": "mxfp8", "quant_method": "mxfp8"},
    "nvfp4-modelopt": {"quant": "nvfp4", "quant_method": "modelopt"},
    "nvfp4-ct": {"quant": "nvfp4", "quant_method": "compressed-tensors"},
    "nvfp4-ct-w4a16": {"quant": "nvfp4", "weight_only": True, "quant_method": "compressed-tensors"},
    "mxfp4": {"quant": "mxfp4", "activation": "swigluoai", "swiglu_limit": 7.0, "bias": True, "quant_method": "mxfp4"},
    "wna16-ct-g128": {"quant": "int_wna16", "checkpoint": "compressed-tensors", "group_size": 128,
                      "quant_method": "compressed-tensors"},
    "wna16-ct-g32": {"quant": "int_wna16", "checkpoint": "compressed-tensors", "group_size": 32,
                     "quant_method": "compressed-tensors"},
    "wna16-ct-zp": {"quant": "int_wna16", "checkpoint": "compressed-tensors", "group_size": 128, "zero_point": True,
                    "quant_method": "compressed-tensors"},
    "wna16-ct-actorder": {"quant": "int_wna16", "checkpoint": "compressed-tensors", "group_size": 128,
                          "act_order": True, "quant_method": "compressed-tensors"},
    "wna16-gptq": {"quant": "int_wna16", "checkpoint": "gptq", "group_size": 128, "quant_method": "gptq"},
    "wna16-awq": {"quant": "int_wna16", "checkpoint": "awq", "group_size": 128, "zero_point": True,
                  "quant_method": "awq"},
    "wna16-moe": {"quant": "int_wna16", "checkpoint": "moe_wna16", "group_size": 128, "quant_method": "moe_wna16"},
    "w4a8": {"quant": "w4a8", "quant_method": "w4afp8"},
}
PLATFORMS = ["sm80", "sm90", {"preset": "sm90", "add_libraries": ["triton_kernels"]}, "sm90-bare", "sm100",
             {"preset": "sm100", "add_libraries": ["triton_kernels"]}, "sm120", "rocm-mi300", "rocm-mi355", "cpu",
             "cpu-x86-amx", "xpu"]
ARCHS = [None, "GptOssForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM", "Llama4ForCausalLM",
         "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration", "LongcatFlashForCausalLM", "Qwen2MoeForCausalLM",
         "NemotronHForCausalLM"]
RUNNERS = [*RUNNER_CHOICES, "bogus"]
A2AS = [None, "deepep", "deepep_v2", "mooncake", "nixl", "mori", "pplx", "flashinfer", "megamoe", "flashinfer_megamoe",
        "ascend_tp"]
PARALLEL = [{"tp": 1}, {"tp": 4}, {"tp": 4, "ep": 2}, {"tp": 4, "dp": 4}, {"tp": 8, "ep": 8, "dp": 8}]
ENVS = [{}, {"SGLANG_USE_AITER": "1"}, {"SGLANG_ENABLE_JIT_DEEPGEMM": "0"}, {"SGLANG_INT4_WEIGHT": "1"},
        {"SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16": "1"}, {"SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION": "1"},
        {"SGLANG_USE_AITER": "yes"}, {"SGLANG_ENABLE_JIT_DEEPGEMM": "maybe"}]
# --quantization values that make sense for a layer's method (None: not given)
QUANTIZATION = {"fp8": ["fp8"], "mxfp8": ["mxfp8"], "nvfp4": ["modelopt_fp4", "nvfp4_online"],
                "mxfp4": ["mxfp4"], "w4a8": ["w4afp8"], "int_wna16": [], "unquantized": []}


def scenario(layer="bf16", platform="sm90", backend="auto", architecture=None, a2a=None, parallel=None,
             deepep_mode="auto", env=None, quantization=None, draft=False) -> dict:
    words = {**SHAPE, **LAYERS[layer]}
    if architecture is not None:
        words["architecture"] = architecture
    if quantization is not None:
        words["quantization"] = quantization
    if draft:
        words["draft"] = True
    par = dict(parallel or {"tp": 1})
    if a2a is not None:
        par["a2a_backend"] = a2a
    if deepep_mode != "auto":
        par["deepep_mode"] = deepep_mode
    return {"name": layer, "layer": words, "parallel": par, "backend": backend, "env": dict(env or {}),
            "platform": platform}


def grid(seed: int = 0, random_count: int = 1200) -> list[dict]:
    out = []
    main_platforms = ["sm80", "sm90", "sm100", "sm120", "rocm-mi300", "rocm-mi355", "cpu", "xpu"]
    for layer in LAYERS:  # every method x platform x runner
        for platform in main_platforms:
            for backend in RUNNERS:
                out.append(scenario(layer, platform, backend))
    for layer in ("bf16", "fp8-block", "fp8-ct-channel", "mxfp8", "nvfp4-modelopt", "mxfp4", "wna16-ct-g128", "w4a8"):
        for platform, architecture in (("sm90", None), ("sm100", None), ("sm100", "DeepseekV3ForCausalLM")):
            for a2a in A2AS:  # all-to-all x runner x parallel (DeepSeek V3: validated for DeepEP v2 and MegaMOE)
                for backend in ("auto", "deep_gemm", "triton", "flashinfer_trtllm", "flashinfer_cutlass",
                                "flashinfer_cutedsl", "marlin", "flashinfer_megamoe", "flashinfer_mxfp4"):
                    for parallel in (PARALLEL[3], PARALLEL[4]):
                        flag = {"mxfp8": "mxfp8", "nvfp4-modelopt": "modelopt_fp4"}.get(layer)
                        for quantization in (None, flag) if flag else (None,):
                            out.append(scenario(layer, platform, backend, architecture=architecture, a2a=a2a,
                                                parallel=parallel, quantization=quantization))
    for architecture in ARCHS:  # model overrides x platform
        for layer in ("bf16", "bf16-oai", "fp8-block", "nvfp4-modelopt", "mxfp4", "wna16-ct-g32", "fp8-modelopt"):
            for platform in PLATFORMS:
                for backend in ("auto", "triton_kernel", "flashinfer_trtllm"):
                    for parallel in (PARALLEL[0], PARALLEL[2]):
                        out.append(scenario(layer, platform, backend, architecture=architecture, parallel=parallel))
    for env in ENVS:  # env x platform
        for layer in ("bf16", "bf16-unaligned", "bf16-oai", "fp8-block", "fp8-channel", "fp8-ct-channel", "mxfp4",
                      "nvfp4-modelopt"):
            for platform in ("sm90", "sm100", "rocm-mi300", "rocm-mi355"):
                for backend in ("auto", "aiter"):
                    for a2a in (None, "deepep"):
                        out.append(scenario(layer, platform, backend, env=env, a2a=a2a, parallel=PARALLEL[1]))
    for layer, flags in (("fp8-block", ["fp8"]), ("mxfp8", ["mxfp8"]), ("nvfp4-modelopt", ["modelopt_fp4"]),
                         ("nvfp4-ct", ["modelopt_fp4"]), ("mxfp4", ["mxfp4"]), ("w4a8", ["w4afp8"])):
        for quantization in flags:  # --quantization x runner x platform
            for platform in ("sm90", "sm100", "sm120", "rocm-mi355"):
                for backend in RUNNERS:
                    out.append(scenario(layer, platform, backend, quantization=quantization))
    for platform in ("sm80", "sm90", "sm120", "rocm-mi300"):  # nvfp4_online is refused off SM100 before any layer
        out.append(scenario("nvfp4-modelopt", platform, quantization="nvfp4_online"))
    for architecture in ARCHS:  # draft layers
        for a2a in (None, "deepep", "deepep_v2", "flashinfer_megamoe"):
            for backend in ("auto", "flashinfer_megamoe", "deep_gemm"):
                for layer in ("bf16", "fp8-block", "mxfp8", "nvfp4-modelopt"):
                    out.append(scenario(layer, "sm100", backend, architecture=architecture, a2a=a2a,
                                        parallel=PARALLEL[3], draft=True,
                                        quantization="mxfp8" if layer == "mxfp8" else None))
    rng = random.Random(seed)
    for _ in range(random_count):  # everything mixed
        layer = rng.choice(list(LAYERS))
        family = LAYERS[layer]["quant"]
        flags = [None, *[q for q in QUANTIZATION.get(family, []) if q != "nvfp4_online"]]
        out.append(scenario(layer, rng.choice(PLATFORMS), rng.choice(RUNNERS), architecture=rng.choice(ARCHS),
                            a2a=rng.choice(A2AS), parallel=rng.choice(PARALLEL),
                            deepep_mode=rng.choice(("auto", "normal", "low_latency")), env=rng.choice(ENVS),
                            quantization=rng.choice(flags), draft=rng.random() < 0.15))
    unique, seen = [], set()
    for item in out:
        key = json.dumps(item, sort_keys=True)
        if key not in seen:
            seen.add(key)
            unique.append(item)
    return unique
