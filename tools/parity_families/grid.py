"""Generated parity scenarios for the MX and integer families (the same spec form as tools/parity_grid.py).

Per family and platform, one thing at a time around a base layer (every
backend name either side maps for the family, every env var these oracles
read unset/0/1/garbage, layer and checkpoint variants, parallel layouts,
optional libraries), then seeded random combinations.
"""

from __future__ import annotations

import random
from pathlib import Path

from parity_grid import PARALLEL

TRACES = Path(__file__).resolve().parents[2] / "traces"
GOLDEN = TRACES / "vllm-0.33" / "scenarios"


def use_profile(profile: str) -> None:
    """Read the hand-written golden scenarios of this profile (traces/<profile>/scenarios/<family>.toml)."""
    global GOLDEN
    GOLDEN = TRACES / profile / "scenarios"

GFX1100 = {"vendor": "rocm", "gcn_arch": "gfx1100", "device_name": "AMD Radeon RX 7900 XTX",
           "libraries": ["triton", "torch.ops._rocm_C.moe_gptq_gemm_rdna3"]}
GFX1250 = {"vendor": "rocm", "gcn_arch": "gfx1250", "device_name": "AMD Instinct (gfx1250)", "libraries": ["aiter", "triton"]}
PLATFORMS = (
    "sm80", "sm89", "sm90", "sm90-bare", "sm100", "sm120", "sm121", "rocm-mi300", "rocm-mi355", "xpu", "cpu",
    "cpu-x86", "cpu-x86-amx", "cpu-arm", "cpu-power", "tpu", "oot",
    {"preset": "sm90", "add_libraries": ["humming", "triton_kernels", "quark"]},
    {"preset": "sm100", "add_libraries": ["humming", "triton_kernels"]},
    {"preset": "sm120", "add_libraries": ["b12x", "triton_kernels"]},
    {"preset": "sm100", "remove_libraries": ["flashinfer"]},
    {"preset": "rocm-mi355", "add_libraries": ["triton_kernels", "quark"]},
    {"preset": "cpu-x86-amx", "add_libraries": ["zentorch"]},
    GFX1100, GFX1250,
)

NAMES = ("auto", "triton", "triton_unfused", "marlin", "humming", "cutlass", "deep_gemm", "flashinfer_trtllm",
         "flashinfer_trtllm_afp8", "flashinfer_cutlass", "flashinfer_cutlass_afp8", "b12x", "aiter",
         "aiter_triton_mxfp4_bf16", "aiter_mxfp4_fp8", "aiter_mxfp4_mxfp4", "aiter_triton_mxfp4_mxfp4", "xpu", "cpu",
         "emulation", "rdna3", "flashinfer_moe_ep_cutedsl", "flashinfer_moe_ep_mega_deep_gemm", "no_such_backend")
ENV_VARS = ("VLLM_BATCH_INVARIANT", "VLLM_USE_DEEP_GEMM", "VLLM_ROCM_USE_AITER", "VLLM_ROCM_USE_AITER_MOE",
            "VLLM_B12X_MOE_FP4_FORCE_A16", "VLLM_HUMMING_MOE_GEMM_TYPE", "VLLM_CPU_INT4_W4A8",
            "VLLM_USE_FLASHINFER_MOE_INT4")
ENV_VALUES = ("0", "1", "maybe")
HUMMING_VALUES = ("indexed", "grouped", "grouped_masked", "auto")
ENV_COMBOS = (
    {"VLLM_ROCM_USE_AITER": "1"},
    {"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_MOE": "0"},
    {"VLLM_USE_FLASHINFER_MOE_INT4": "1"},
    {"VLLM_BATCH_INVARIANT": "1", "VLLM_ROCM_USE_AITER": "1"},
    {"VLLM_HUMMING_MOE_GEMM_TYPE": "indexed"},
    {"VLLM_CPU_INT4_W4A8": "0"},
)

GPT_OSS = {"quant": "mxfp4", "bias": True, "activation": "swigluoai", "swiglu_limit": 7.0, "num_experts": 32,
           "top_k": 4, "hidden_size": 2880, "intermediate_size": 2880}
COMMON = ({"activation": "gelu"}, {"lora": True}, {"dtype": "float16"}, {"dtype": "float32"},
          {"num_experts": 1024, "top_k": 8}, {"num_experts": 4096, "top_k": 8})
LAYERS = {
    "mxfp4": (GPT_OSS, COMMON + (
        {"bias": False}, {"activation": "silu", "bias": False, "hidden_size": 3072, "intermediate_size": 1536},
        {"act_quant": "mxfp8"}, {"act_quant": "mxfp4"}, {"act_quant": "fp8-tensor"}, {"act_quant": "fp8-group"},
        {"act_quant": "mxfp8", "activation": "silu", "bias": False, "hidden_size": 3072, "intermediate_size": 1536},
        {"swiglu_limit": None})),
    "mxfp8": ({"quant": "mxfp8", "num_experts": 128, "top_k": 8, "hidden_size": 4096, "intermediate_size": 1536},
              COMMON + ({"activation": "swigluoai"}, {"swiglu_limit": 7.0})),
    "int8": ({"quant": "int8", "num_experts": 64, "top_k": 6, "hidden_size": 2048, "intermediate_size": 1408},
             COMMON + ({"activation": "swigluoai"}, {"weight_scale": "tensor", "act_scale": "tensor"},
                       {"asym_act": True}, {"hidden_size": 2064})),
    "int_wna16": ({"quant": "int_wna16", "bits": 4, "group_size": 128, "checkpoint": "gptq", "num_experts": 128,
                   "top_k": 8, "hidden_size": 2048, "intermediate_size": 768},
                  COMMON + tuple({"checkpoint": c, **v} for c in ("gptq", "awq", "compressed-tensors", "moe_wna16")
                                 for v in ({}, {"zero_point": True}, {"group_size": 32}, {"group_size": 256},
                                           {"act_order": True}, {"bits": 8}, {"group_size": -1}, {"group_size": 6,
                                           "hidden_size": 2052, "intermediate_size": 768})
                                 if not (c == "awq" and v.get("bits") == 8))),
    "w4a8": ({"quant": "w4a8", "num_experts": 64, "top_k": 8, "hidden_size": 4096, "intermediate_size": 1536},
             COMMON + ({"activation": "swigluoai"},)),
    "w4a8_int8": ({"quant": "w4a8_int8", "group_size": 128, "num_experts": 64, "top_k": 8, "hidden_size": 2048,
                   "intermediate_size": 768},
                  COMMON + tuple({"group_size": g} for g in (-1, 32, 64, 256, 16)) + ({"activation": "swigluoai"},)),
}
FAMILIES = tuple(LAYERS)
RANDOM_PER_PLATFORM = 12


def _values(var: str) -> tuple[str, ...]:
    """Unset is the absence; the integer switches get 0, 1 and garbage, Humming's gemm type its words."""
    return HUMMING_VALUES if var == "VLLM_HUMMING_MOE_GEMM_TYPE" else ENV_VALUES


def _layer(base: dict, variant: dict) -> dict:
    layer = {**base, **variant}
    return {k: v for k, v in layer.items() if v is not None}


def family_grid(family: str, rng: random.Random) -> list[dict]:
    base, variants = LAYERS[family]
    out = []

    def add(platform, variant=None, parallel=None, backend="auto", env=None):
        out.append({"platform": platform, "layer": _layer(base, variant or {}), "parallel": dict(parallel or {}),
                    "backend": backend, "env": dict(env or {})})

    for platform in PLATFORMS:
        for name in NAMES:
            add(platform, backend=name)
        for var in ENV_VARS:
            for value in _values(var):
                add(platform, env={var: value})
        for env in ENV_COMBOS:
            add(platform, env=env)
        for variant in variants:
            add(platform, variant)
        for parallel in PARALLEL:
            add(platform, parallel=parallel)
        for _ in range(RANDOM_PER_PLATFORM):
            env = {var: rng.choice(_values(var)) for var in rng.sample(ENV_VARS, rng.choice((0, 1, 2)))}
            if rng.random() < 0.3:
                env.update(rng.choice(ENV_COMBOS))
            variant = rng.choice(variants) if rng.random() < 0.7 else {}
            add(platform, variant, rng.choice(PARALLEL), rng.choice(NAMES + ("auto",) * 8), env)
    return out


def golden_specs(family: str) -> list[dict]:
    """The family's golden scenarios (traces/<profile>/scenarios/<family>.toml), so vLLM also answers for the
    hand-written expectations (branches the one-change-at-a-time grid does not reach)."""
    import tomllib

    path = GOLDEN / f"{family}.toml"
    if not path.exists():
        return []
    rows = tomllib.loads(path.read_text())["scenario"]
    # torch's own 4-bit ops cannot be removed from the torch the harness runs vLLM with
    rows = [row for row in rows if "torch.ops.aten._dyn_quant_matmul_4bit" not in str(row.get("platform"))]
    return [{k: row[k] for k in ("platform", "layer", "parallel", "backend", "env") if k in row} for row in rows]


def grid(families) -> list[dict]:
    rng = random.Random(1133)
    return [s for family in families for s in (*golden_specs(family), *family_grid(family, rng))]
