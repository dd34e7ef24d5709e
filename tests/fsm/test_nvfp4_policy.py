"""Every branch of vLLM's select_nvfp4_moe_backend (seed 000), through the FSM."""

import pytest

from moe_fsm.errors import BackendUnsupportedError, NoBackendError
from moe_fsm.inputs.parallel import AllToAllKind, ParallelConfig

BATCHED = ParallelConfig(dp_size=2, ep_size=2, batched_activation_format=True, all2all=AllToAllKind.DEEPEP_LOW_LATENCY)


@pytest.mark.parametrize(
    "platform, backend, expected",
    [
        ("sm100", "FLASHINFER_TRTLLM", None),
        ("sm90", "MARLIN", None),
        ("sm120", "FLASHINFER_CUTLASS", None),
        ("cpu", "EMULATION", None),
    ],
)
def test_auto_scan_walks_the_priority_list(pick, platform, backend, expected):
    decision = pick("nvfp4", platform)
    assert decision.backend == backend
    assert decision.trace["path"] == ["start", "auto_scan", "selected"]


def test_b12x_is_never_auto_selected_on_sm121(pick):
    decision = pick("nvfp4", "sm121")
    assert decision.backend == "FLASHINFER_CUTLASS"
    scanned = next(e for e in decision.trace["events"] if e["event"] == "scan")["candidates"]
    assert "FLASHINFER_B12X" not in scanned


def test_explicit_choice_selects_without_scanning(pick):
    decision = pick("nvfp4", "sm121", backend="flashinfer_b12x")
    assert (decision.backend, decision.kernel, decision.via) == ("FLASHINFER_B12X", "FlashInferB12xExperts", "explicit_user_choice")


def test_explicit_cutedsl_is_rewritten_to_batched_variant(pick):
    decision = pick("nvfp4", "sm100", backend="flashinfer_cutedsl", parallel=BATCHED)
    assert decision.backend == "FLASHINFER_CUTEDSL_BATCHED"
    assert any(e["event"] == "rewritten" for e in decision.trace["events"])


def test_explicit_unsupported_choice_raises_value_error_without_fallback(pick):
    with pytest.raises(ValueError, match=r"NvFp4 MoE backend 'FLASHINFER_TRTLLM' does not support the deployment configuration since needs compute capability 10\.x, this is 9\.0\.") as info:
        pick("nvfp4", "sm90", backend="flashinfer_trtllm")
    assert isinstance(info.value, BackendUnsupportedError)
    assert info.value.trace["path"] == ["start", "explicit_user_choice", "failed"]


def test_explicit_unknown_name_lists_the_accepted_ones(pick):
    with pytest.raises(ValueError, match=r"moe_backend='triton' is not supported for NvFp4 MoE\. Expected one of \['cutlass'"):
        pick("nvfp4", "sm100", backend="triton")


def test_explicit_choice_that_ignores_the_swiglu_clamp_is_refused(pick):
    with pytest.raises(ValueError, match=r"Model sets swiglu_limit=7\.0, but the explicitly requested moe_backend='flashinfer_cutlass' does not apply the SwiGLU clamp\. Use 'flashinfer_trtllm' instead\."):
        pick("nvfp4", "sm100", backend="flashinfer_cutlass", swiglu_limit=7.0)


def test_swiglu_limit_keeps_only_clamping_backends_in_auto(pick):
    assert pick("nvfp4", "sm100", swiglu_limit=7.0).backend == "FLASHINFER_TRTLLM"
    with pytest.raises(NotImplementedError, match=r"^No NvFp4 MoE backend supports the deployment configuration\."):
        pick("nvfp4", "sm90", swiglu_limit=7.0)


def test_fp4_env_zero_prunes_flashinfer(pick):
    decision = pick("nvfp4", "sm100", env={"VLLM_USE_FLASHINFER_MOE_FP4": "0"})
    assert decision.backend == "VLLM_CUTLASS"
    assert decision.trace["path"] == ["start", "flashinfer_preference", "auto_scan", "selected"]


@pytest.mark.parametrize(
    "platform, fi_backend, expected",
    [
        ("sm100", "throughput", "FLASHINFER_CUTLASS"),
        ("sm100", "latency", "FLASHINFER_TRTLLM"),
        ("sm120", "latency", "FLASHINFER_CUTLASS"),  # latency means TRTLLM only on SM100
        ("sm100", "masked_gemm", "FLASHINFER_CUTEDSL"),
    ],
)
def test_fp4_env_with_pinned_flashinfer_family(pick, platform, fi_backend, expected):
    env = {"VLLM_USE_FLASHINFER_MOE_FP4": "1", "VLLM_FLASHINFER_MOE_BACKEND": fi_backend}
    decision = pick("nvfp4", platform, env=env)
    assert (decision.backend, decision.via) == (expected, "flashinfer_preference")


def test_pinned_flashinfer_family_must_apply_the_clamp(pick):
    env = {"VLLM_USE_FLASHINFER_MOE_FP4": "1", "VLLM_FLASHINFER_MOE_BACKEND": "throughput"}
    with pytest.raises(ValueError, match=r"selected via VLLM_FLASHINFER_MOE_BACKEND \(FLASHINFER_CUTLASS\) does not apply the SwiGLU clamp"):
        pick("nvfp4", "sm100", env=env, swiglu_limit=7.0)


def test_fp4_env_one_tries_flashinfer_then_gives_up(pick):
    assert pick("nvfp4", "sm120", env={"VLLM_USE_FLASHINFER_MOE_FP4": "1"}).backend == "FLASHINFER_CUTLASS"
    with pytest.raises(NotImplementedError, match=r"^Found VLLM_USE_FLASHINFER_MOE_FP4=1, but no FlashInfer NVFP4 MoE backend supports the configuration\.") as info:
        pick("nvfp4", "sm90", env={"VLLM_USE_FLASHINFER_MOE_FP4": "1"})
    assert isinstance(info.value, NoBackendError)
    assert "FLASHINFER_TRTLLM (needs compute capability 10.x, this is 9.0)" in info.value.message


def test_forced_marlin(pick):
    decision = pick("nvfp4", "sm100", env={"VLLM_TEST_FORCE_FP8_MARLIN": "1"})
    assert (decision.backend, decision.via) == ("MARLIN", "forced_marlin")
    with pytest.raises(ValueError, match="NvFp4 MoE backend 'MARLIN' does not support"):
        pick("nvfp4", "cpu", env={"VLLM_TEST_FORCE_FP8_MARLIN": "true"})
