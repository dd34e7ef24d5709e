"""The vllm-0.31 profile: what vLLM 0.31.0's oracles do differently from 0.32.0's, each as vLLM 0.31.0 answered it.

Every scenario here is one the parity harness (tools/vllm_parity.py --vllm-version 0.31.0) ran through vLLM 0.31.0's
own select_*_moe_backend: under vllm-0.32's rules moe-fsm answered otherwise; under vllm-0.31 it answers as 0.31.0.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from moe_fsm import profiles
from moe_fsm.decision import decide, inputs_from_spec
from moe_fsm.errors import BackendUnsupportedError, NoBackendError
from moe_fsm.inputs.quant import QuantFamily

GPT_OSS = {"quant": "mxfp4", "activation": "swigluoai", "bias": True, "swiglu_limit": 7.0, "num_experts": 32,
           "top_k": 4, "hidden_size": 2880, "intermediate_size": 2880}
NVFP4 = {"quant": "nvfp4", "hidden_size": 2048, "intermediate_size": 768, "num_experts": 64, "top_k": 4}
WNA16 = {"quant": "int_wna16", "bits": 4, "checkpoint": "gptq", "group_size": 128, "hidden_size": 2048,
         "intermediate_size": 768, "num_experts": 128, "top_k": 8}
MXFP8 = {"quant": "mxfp8", "hidden_size": 4096, "intermediate_size": 1536, "num_experts": 128, "top_k": 8}
SM90_HUMMING = {"preset": "sm90", "add_libraries": ["humming", "triton_kernels", "quark"]}
SM120_TRITON = {"preset": "sm120", "add_libraries": ["b12x", "triton_kernels"]}


def _decide(policy: str, platform, layer, backend="auto", parallel=None, env=None):
    spec = {"platform": platform, "layer": layer, "backend": backend, "parallel": parallel or {}, "env": env or {}}
    return decide(replace(inputs_from_spec(spec), profile=profiles.ProfileChoice(policy, "test")))


# (platform, layer, backend, parallel, env) -> vLLM 0.31.0's answer, and 0.32.0's (moe-fsm under vllm-0.32)
CASES = [
    ("wna16-sm90-humming", SM90_HUMMING, WNA16, "auto", None, None, "MARLIN", "HUMMING"),
    ("mxfp8-sm90-humming", SM90_HUMMING, MXFP8, "auto", None, None, "MARLIN", "HUMMING"),
    ("mxfp4-mxfp8-act-sm90", "sm90", {**GPT_OSS, "act_quant": "mxfp8"}, "auto", None, None,
     NoBackendError, "FLASHINFER_CUTLASS_MXFP4_BF16"),
    ("mxfp4-mxfp4-act-sm100", "sm100", {**GPT_OSS, "act_quant": "mxfp4"}, "auto", None, None,
     NoBackendError, "CUTLASS_MXFP4_MXFP4"),
    ("mxfp4-sm120-explicit-triton", SM120_TRITON, GPT_OSS, "triton", None, None, BackendUnsupportedError, "TRITON"),
    ("nvfp4-cutlass-ep", "sm100", NVFP4, "cutlass", {"tp_size": 2, "ep_size": 2}, None,
     BackendUnsupportedError, "VLLM_CUTLASS"),
    ("nvfp4-moe-ep-cutedsl", "sm100", NVFP4, "flashinfer_moe_ep_cutedsl", {"tp_size": 2, "ep_size": 2}, None,
     BackendUnsupportedError, "FLASHINFER_MOE_EP_CUTEDSL"),
]


@pytest.mark.parametrize("name, platform, layer, backend, parallel, env, v031, v032", CASES, ids=[c[0] for c in CASES])
def test_vllm_0_31_answers_as_vllm_0_31_0(name, platform, layer, backend, parallel, env, v031, v032):
    if isinstance(v031, str):
        assert _decide("vllm-0.31", platform, layer, backend, parallel, env).backend == v031
    else:
        with pytest.raises(v031):
            _decide("vllm-0.31", platform, layer, backend, parallel, env)
    assert _decide("vllm-0.32", platform, layer, backend, parallel, env).backend == v032


def test_an_installed_vllm_0_31_picks_vllm_0_31():
    assert profiles.choose_for_vllm("0.31.0").name == "vllm-0.31"
    assert profiles.choose_for_vllm("0.31.3").name == "vllm-0.31"
    assert profiles.choose_for_vllm("0.30.2").name == "seeds"


def test_vllm_0_31_lists_only_its_differences_from_vllm_0_32():
    v031, v032 = profiles.get("vllm-0.31"), profiles.get("vllm-0.32")
    assert v031.vllm_version == (0, 31)
    for family in (QuantFamily.UNQUANTIZED, QuantFamily.INT8, QuantFamily.W4A8, QuantFamily.W4A8_INT8):
        assert v031.policies[family] is v032.policies[family]
    changed = {"OAITritonMxfp4ExpertsMonolithic", "OAITritonExperts", "UnfusedOAITritonExperts",
               "CutlassExpertsFp4", "CutlassExpertsMxfp4"}
    assert {k for k in v031.kernels if v031.kernels[k] is not v032.kernels.get(k)} == changed
    assert set(v032.kernels) - set(v031.kernels) == {"FlashInferMoeEpExperts"}
