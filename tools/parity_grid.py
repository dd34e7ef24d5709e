"""The generated scenario grid of the vLLM parity harness (tools/vllm_parity.py).

A scenario is a spec in the form ``moe-fsm select --input`` and the golden
scenario files read (platform preset, layer, parallel, backend, env), so a
disagreement can be replayed with ``moe-fsm select``. Per family and platform
the grid varies one thing at a time around a base layer (every backend name,
every env var unset/0/1/garbage, every layer variant, every parallel layout)
and then adds seeded random combinations of all of them.

A family is added with a ``LAYERS`` entry (its base layer and variants).
"""

from __future__ import annotations

import random

PLATFORMS = ("sm80", "sm89", "sm90", "sm90-bare", "sm100", "sm120", "sm121", "rocm-mi300", "rocm-mi355",
             "xpu", "cpu", "tpu", "oot",
             # the CPU kinds vLLM's CPU experts tell apart (architecture, AMX tiles; zentorch on an AMD x86 CPU)
             "cpu-x86", "cpu-x86-amx", "cpu-arm", "cpu-power", {"preset": "cpu-x86", "add_libraries": ["zentorch"]},
             # Blackwell Ultra (B300): compute capability 10.3, the SM100 family
             {"vendor": "cuda", "capability": [10, 3], "device_name": "NVIDIA B300", "libraries": [
                 "deep_gemm", "flashinfer", "flashinfer.b12x_moe", "flashinfer.cutedsl_moe",
                 "flashinfer.cutlass_fused_moe", "flashinfer.trtllm_fused_moe", "torch._grouped_mm",
                 "torch._scaled_grouped_mm", "triton", "vllm._custom_ops"]},
             # libraries no preset has: Tencent's hpc-ops on SM90, DeepGEMM on SM12x
             {"preset": "sm90", "add_libraries": ["hpc"]},
             {"preset": "sm120", "add_libraries": ["deep_gemm"]})

# Every name either side maps, plus one nobody does.
BACKEND_NAMES = ("auto", "triton", "batched_triton", "deep_gemm", "cutlass", "flashinfer_trtllm", "flashinfer_cutlass",
                 "flashinfer_cutedsl", "flashinfer_moe_ep_cutedsl", "flashinfer_b12x", "b12x", "marlin", "humming",
                 "aiter", "hpc", "emulation", "no_such_backend")

ENV_VARS = ("VLLM_BATCH_INVARIANT", "VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM", "VLLM_ROCM_USE_AITER",
            "VLLM_ROCM_USE_AITER_MOE", "VLLM_B12X_MOE_FP4_FORCE_A16", "VLLM_USE_FLASHINFER_MOE_FP16",
            "VLLM_USE_FLASHINFER_MOE_FP8", "VLLM_USE_FLASHINFER_MOE_FP4", "VLLM_FLASHINFER_MOE_BACKEND",
            "VLLM_TEST_FORCE_FP8_MARLIN")
ENV_VALUES = ("0", "1", "maybe")
ENV_COMBOS = (
    {"VLLM_ROCM_USE_AITER": "1"},
    {"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_MOE": "0"},
    {"VLLM_ROCM_USE_AITER": "true", "VLLM_ROCM_USE_AITER_MOE": "TRUE"},
    {"VLLM_USE_DEEP_GEMM": "1", "VLLM_MOE_USE_DEEP_GEMM": "0"},
    {"VLLM_USE_DEEP_GEMM": "0", "VLLM_MOE_USE_DEEP_GEMM": "1"},
    {"VLLM_BATCH_INVARIANT": "1", "VLLM_ROCM_USE_AITER": "1"},
    {"VLLM_BATCH_INVARIANT": "1", "VLLM_USE_DEEP_GEMM": "1"},
    {"VLLM_FLASHINFER_MOE_BACKEND": "throughput", "VLLM_USE_FLASHINFER_MOE_FP8": "1"},
    {"VLLM_FLASHINFER_MOE_BACKEND": "latency", "VLLM_USE_FLASHINFER_MOE_FP16": "1"},
    {"VLLM_FLASHINFER_MOE_BACKEND": "masked_gemm", "VLLM_USE_FLASHINFER_MOE_FP4": "1"},
)

# moe-fsm's ParallelConfig: the user's sizes (tp, dp; with EP, ep = tp * dp). The harness turns them into
# the FusedMoEParallelConfig vLLM's FusedMoEParallelConfig.make builds (TP flattened across DP; with EP,
# ep = tp * dp and tp = 1).
PARALLEL = (
    {},
    {"tp_size": 2},
    {"tp_size": 2, "ep_size": 2},
    {"dp_size": 2},
    {"tp_size": 2, "dp_size": 2},
    {"dp_size": 2, "ep_size": 2, "all2all": "allgather_reducescatter"},
    {"dp_size": 2, "ep_size": 2, "all2all": "torch_all2all"},
    {"dp_size": 2, "ep_size": 2, "all2all": "deepep_high_throughput"},
    {"dp_size": 2, "ep_size": 2, "all2all": "deepep_low_latency", "batched_activation_format": True},
    {"dp_size": 2, "ep_size": 2, "all2all": "flashinfer_all2allv"},
    {"tp_size": 2, "dp_size": 2, "ep_size": 4, "all2all": "allgather_reducescatter"},
)

COMMON_VARIANTS = (
    {"activation": "swigluoai"},
    {"activation": "gelu"},
    {"lora": True},
    {"lora": True, "intermediate_size": 192},
    {"dtype": "float16"},
    {"dtype": "float32"},
    {"num_experts": 1024, "top_k": 8},
    {"num_experts": 4096, "top_k": 8},
    {"swiglu_limit": 7.0},
    {"swiglu_limit": 7.0, "activation": "swigluoai"},
    {"hidden_size": 2880, "intermediate_size": 2880},
)

FP8_SCHEMES = (
    {"weight_scale": "block", "act_scale": "group"},
    {"weight_scale": "channel", "act_scale": "token"},
    {"weight_scale": "tensor", "act_scale": "tensor", "static_act": True},
    {"weight_scale": "tensor", "act_scale": "tensor"},
    {"weight_scale": "tensor", "act_scale": "token"},
    {"weight_scale": "channel", "act_scale": "tensor", "static_act": True},
    {"weight_scale": "block", "act_scale": "token"},
)

LAYERS = {
    "unquantized": ({"quant": "unquantized"}, COMMON_VARIANTS),
    "fp8": ({"quant": "fp8", "weight_scale": "block", "act_scale": "group"},
            COMMON_VARIANTS + tuple({"quant": "fp8", **s} for s in FP8_SCHEMES[1:])
            + ({"allow_vllm_cutlass": True}, {"allow_vllm_cutlass": True, "weight_scale": "channel", "act_scale": "token"})),
    "nvfp4": ({"quant": "nvfp4"}, COMMON_VARIANTS + ({"weight_only": True}, {"weight_only": True, "swiglu_limit": 7.0})),
}

RANDOM_PER_PLATFORM = 45


def _layer(base: dict, variant: dict) -> dict:
    layer = {"num_experts": 64, "top_k": 4, "hidden_size": 2048, "intermediate_size": 768, **base, **variant}
    if layer.get("quant") == "fp8" and "weight_scale" in variant and "static_act" not in variant:
        layer.pop("static_act", None)
    return layer


def family_grid(family: str, rng: random.Random) -> list[dict]:
    base, variants = LAYERS[family]
    out = []

    def add(platform, variant=None, parallel=None, backend="auto", env=None):
        out.append({"platform": platform, "layer": _layer(base, variant or {}), "parallel": dict(parallel or {}),
                    "backend": backend, "env": dict(env or {})})

    for platform in PLATFORMS:
        for name in BACKEND_NAMES:
            add(platform, backend=name)
            add(platform, parallel={"tp_size": 2, "ep_size": 2}, backend=name)
        for var in ENV_VARS:
            for value in ENV_VALUES:
                add(platform, env={var: value})
        for env in ENV_COMBOS:
            add(platform, env=env)
        for variant in variants:
            add(platform, variant)
        for parallel in PARALLEL:
            add(platform, parallel=parallel)
        for _ in range(RANDOM_PER_PLATFORM):
            env = {}
            for var in rng.sample(ENV_VARS, rng.choice((0, 0, 1, 2))):
                env[var] = rng.choice(ENV_VALUES + ("true", "latency", "throughput"))
            if rng.random() < 0.2:
                env.update(rng.choice(ENV_COMBOS))
            variant = rng.choice(variants) if rng.random() < 0.6 else {}
            add(platform, variant, rng.choice(PARALLEL), rng.choice(BACKEND_NAMES + ("auto",) * 6), env)
    return out


def grid(families: list[str]) -> list[dict]:
    rng = random.Random(33)
    scenarios = []
    for family in families:
        scenarios.extend(family_grid(family, rng))
    return scenarios
