"""The vllm-0.33 profile: the changes vLLM 0.33.0 made to the oracles, each checked against its source.

Every expectation names the place in vLLM 0.33.0 it comes from (see docs/vllm-0.33-oracles.md);
tools/vllm_parity.py compares the whole profile with vLLM's own functions.
"""

from __future__ import annotations

import pytest

from moe_fsm import MoELayer, ParallelConfig, QuantScheme, preset, select
from moe_fsm.errors import BackendUnsupportedError, EnvVarError, NoBackendError
from moe_fsm.inputs.platform import Library, with_libraries

POLICY = "vllm-0.33"


def decide(layer=None, parallel=None, platform="sm90", env=None, backend="auto"):
    facts = preset(platform) if isinstance(platform, str) else platform
    return select(layer or MoELayer(), parallel, backend=backend, env=env or {}, platform=facts, policy=POLICY)


def events(decision, kind):
    return [e for e in decision.trace["events"] if e["event"] == kind]


def test_flashinfer_env_vars_of_the_seeds_are_not_read():
    """oracle/fp8.py and nvfp4.py read no VLLM_USE_FLASHINFER_MOE_* / VLLM_FLASHINFER_MOE_BACKEND any more."""
    layer = MoELayer(quant=QuantScheme.fp8())
    plain = decide(layer, platform="sm100")
    forced = decide(layer, platform="sm100", env={"VLLM_USE_FLASHINFER_MOE_FP8": "0", "VLLM_FLASHINFER_MOE_BACKEND": "throughput",
                                                 "VLLM_TEST_FORCE_FP8_MARLIN": "1"})
    assert plain.backend == forced.backend == "FLASHINFER_TRTLLM"
    assert forced.trace["path"] == plain.trace["path"]


def test_fp8_has_no_lora_shortcut():
    """FP8 LoRA is a kernel check: on Blackwell the FlashInfer kernels refuse LoRA and TRITON wins the scan."""
    decision = decide(MoELayer(quant=QuantScheme.fp8(), lora=True), platform="sm100")
    assert (decision.backend, decision.outcome["via"]) == ("TRITON", "auto_scan")
    assert "lora_shortcut" not in decision.trace["path"]


def test_unquantized_tries_flashinfer_first_on_cuda_but_not_on_hopper():
    """_get_priority_backends: FlashInfer TRTLLM/CUTLASS first on CUDA, moved to the back on SM90."""
    assert decide(platform="sm100").kernel == "TrtLlmBf16ExpertsMonolithic"
    assert decide(platform="sm120").backend == "FLASHINFER_CUTLASS"
    hopper = decide(platform="sm90")
    assert hopper.backend == "TRITON" and events(hopper, "reordered")[0]["to"] == "back"


@pytest.mark.parametrize("intermediate, kernel", [(768, "TrtLlmBf16LoRAExperts"), (192, "TritonExperts")])
def test_unquantized_lora_step(intermediate, kernel):
    """LoRA: TrtLlmBf16LoRAExperts where it runs and the per-partition intermediate is a multiple of 128, else TRITON."""
    decision = decide(MoELayer(lora=True, intermediate_size=intermediate), platform="sm100", backend="flashinfer_cutlass")
    assert decision.kernel == kernel and decision.outcome["via"] == "lora_shortcut"


def test_more_nvfp4_backends_apply_the_swiglu_clamp():
    """NVFP4_BACKENDS_WITH_CLAMP now holds Marlin, VLLM_CUTLASS, CuTe DSL, emulation..., not CuTe DSL batched."""
    layer = MoELayer(quant=QuantScheme.nvfp4(), swiglu_limit=7.0, hidden_size=2048)
    assert decide(layer, platform="sm90").backend == "MARLIN"
    assert decide(layer, platform="sm100", backend="cutlass").backend == "VLLM_CUTLASS"
    with pytest.raises(BackendUnsupportedError, match="does not apply the SwiGLU clamp"):
        decide(layer, platform="sm100", backend="flashinfer_b12x")


def test_humming_goes_ahead_of_marlin_on_hopper():
    """prioritize_humming: on SM90 HUMMING moves just ahead of MARLIN (humming absent here, so MARLIN still wins)."""
    decision = decide(MoELayer(quant=QuantScheme.nvfp4()), platform="sm90")
    scan = events(decision, "scan")[0]["candidates"]
    assert scan.index("HUMMING") == scan.index("MARLIN") - 1 and decision.backend == "MARLIN"
    humming = with_libraries(preset("sm90"), add={Library.HUMMING})
    assert decide(MoELayer(quant=QuantScheme.nvfp4()), platform=humming).backend == "HUMMING"


def test_deep_gemm_runs_on_sm12x():
    """is_deep_gemm_supported: capability 9.0, 10.x or 12.x."""
    sm120 = with_libraries(preset("sm120"), add={Library.DEEP_GEMM})
    decision = decide(MoELayer(quant=QuantScheme.fp8()), platform=sm120, env={"VLLM_USE_DEEP_GEMM": "1"})
    assert (decision.backend, decision.outcome["via"]) == ("DEEPGEMM", "deep_gemm_override")


def test_fp8_on_a_cpu_without_amx_is_none():
    """CPU_W8A8 and CPU come first on CPUs but need AMX; the oracle returns NONE off CUDA/ROCm."""
    decision = decide(MoELayer(quant=QuantScheme.fp8()), platform="cpu")
    assert decision.backend == "NONE"
    assert events(decision, "scan")[0]["candidates"][:2] == ["CPU_W8A8", "CPU"]


def test_batch_invariant_pins_triton():
    """VLLM_BATCH_INVARIANT=1: only classes with _supports_batch_invariance (Triton) remain."""
    assert decide(platform="sm100", env={"VLLM_BATCH_INVARIANT": "1"}).backend == "TRITON"
    with pytest.raises(NoBackendError):
        decide(platform="cpu", env={"VLLM_BATCH_INVARIANT": "1"})


def test_trtllm_fp8_experts_take_silu_only():
    """TrtLlmFp8Experts accept SILU and the packed SWIGLUOAI_UNINTERLEAVE, not interleaved swigluoai."""
    decision = decide(MoELayer(quant=QuantScheme.fp8(), activation="swigluoai"), platform="sm100")
    assert decision.backend != "FLASHINFER_TRTLLM"


def test_cutlass_fp4_allows_expert_parallelism():
    decision = decide(MoELayer(quant=QuantScheme.nvfp4()), ParallelConfig(tp_size=2, ep_size=2), platform="sm100",
                      backend="cutlass")
    assert decision.kernel == "CutlassExpertsFp4"


def test_trtllm_modular_runs_under_flashinfer_all2all():
    parallel = ParallelConfig(dp_size=2, ep_size=2, all2all="flashinfer_all2allv")
    decision = decide(MoELayer(quant=QuantScheme.fp8()), parallel, platform="sm100")
    assert decision.kernel == "TrtLlmFp8ExpertsModular"


def test_env_values_parse_as_vllm_parses_them():
    """bool(int(...)) for VLLM_USE_DEEP_GEMM; AITER switches are true for 1/true in any case, else false."""
    with pytest.raises(EnvVarError, match="VLLM_USE_DEEP_GEMM"):
        decide(MoELayer(quant=QuantScheme.fp8()), env={"VLLM_USE_DEEP_GEMM": "maybe"})
    layer = MoELayer(quant=QuantScheme.fp8())
    on = decide(layer, platform="rocm-mi300", env={"VLLM_ROCM_USE_AITER": "TRUE"})
    off = decide(layer, platform="rocm-mi300", env={"VLLM_ROCM_USE_AITER": "yes"})
    assert on.backend == "AITER" and off.backend == "TRITON"


def test_unquantized_passes_quantization_only_names_through():
    """'humming' and 'marlin' fall through to auto for an unquantized layer (e.g. an MTP draft)."""
    assert decide(platform="sm100", backend="marlin").outcome["via"] == "auto_scan"
    with pytest.raises(BackendUnsupportedError, match="is not supported for Unquantized MoE"):
        decide(platform="sm100", backend="deep_gemm")
