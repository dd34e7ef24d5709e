"""Every branch of vLLM's select_fp8_moe_backend (seed 001, plus the --moe-backend step), through the FSM."""

import pytest

from moe_fsm.inputs.parallel import AllToAllKind, ParallelConfig

BATCHED = ParallelConfig(dp_size=2, ep_size=2, batched_activation_format=True, all2all=AllToAllKind.DEEPEP_LOW_LATENCY)


@pytest.mark.parametrize(
    "scheme, platform, expected",
    [
        ("fp8_block", "sm90", "FLASHINFER_CUTLASS"),  # FI CUTLASS takes block FP8 on exactly 9.0
        ("fp8_block", "sm100", "FLASHINFER_TRTLLM"),
        ("fp8_block", "sm90-bare", "TRITON"),  # no flashinfer, no deep_gemm
        ("fp8_block", "sm80", "MARLIN"),  # no FP8 tensor cores: weight-only Marlin
        ("fp8_block", "rocm-mi300", "TRITON"),  # AITER is off unless VLLM_ROCM_USE_AITER=1
        ("fp8_tensor", "sm120", "FLASHINFER_CUTLASS"),
        ("fp8_channel", "sm90", "TRITON"),  # vLLM CUTLASS is pruned without allow_vllm_cutlass
    ],
)
def test_auto_scan(pick, scheme, platform, expected):
    assert pick(scheme, platform).backend == expected


def test_allow_vllm_cutlass_keeps_vllm_cutlass_in_the_scan(pick):
    assert pick("fp8_channel", "sm90", allow_vllm_cutlass=True).backend == "VLLM_CUTLASS"


@pytest.mark.parametrize("platform, kernel", [("cpu", "TorchExperts"), ("tpu", None), ("xpu", None), ("oot", None)])
def test_off_cuda_and_rocm_an_exhausted_scan_returns_none(pick, platform, kernel):
    decision = pick("fp8_channel", platform)
    assert (decision.status, decision.backend, decision.kernel) == ("fallback_none", "NONE", None)
    assert decision.runner == kernel  # the platform's own path; on a CPU moe-fsm builds its torch emulation
    assert decision.trace["path"][-1] == "fallback_none"


def test_xpu_has_its_own_fp8_kernel(pick):
    assert pick("fp8_tensor_dyn", "xpu").backend == "XPU"


def test_on_cuda_an_exhausted_scan_raises(pick):
    with pytest.raises(NotImplementedError, match=r"^No FP8 MoE backend supports the deployment configuration\. Rejected: "):
        pick("fp8_block", "sm80", env={"VLLM_TEST_FORCE_FP8_MARLIN": "0"}, lora=False, activation="swigluoai", parallel=ParallelConfig(dp_size=2, ep_size=2, all2all=AllToAllKind.FLASHINFER_ALL2ALLV))


def test_lora_shortcut_goes_straight_to_triton(pick):
    decision = pick("fp8_block", "sm100", lora=True, env={"VLLM_USE_FLASHINFER_MOE_FP8": "1"})
    assert (decision.backend, decision.via) == ("TRITON", "lora_shortcut")
    assert decision.trace["path"] == ["start", "lora_shortcut", "selected"]


def test_lora_shortcut_is_validated(pick):
    with pytest.raises(ValueError, match="FP8 MoE backend TRITON does not support the deployment configuration since needs a cuda or rocm device"):
        pick("fp8_block", "cpu", lora=True)


def test_explicit_choice_with_batched_rewrite(pick):
    assert pick("fp8_block", "sm90", backend="triton", parallel=BATCHED).backend == "BATCHED_TRITON"
    assert pick("fp8_block", "sm90", backend="deep_gemm", parallel=BATCHED).backend == "BATCHED_DEEPGEMM"


def test_explicit_vllm_cutlass_needs_allow_vllm_cutlass(pick):
    with pytest.raises(ValueError, match=r"^vLLM CUTLASS FP8 MoE backend is disabled for this configuration\.$"):
        pick("fp8_channel", "sm90", backend="cutlass")
    assert pick("fp8_channel", "sm90", backend="cutlass", allow_vllm_cutlass=True).backend == "VLLM_CUTLASS"


def test_the_pr_43334_failure_and_its_fix(pick):
    with pytest.raises(ValueError, match=r"moe_backend='flashinfer_b12x' is not supported for FP8 MoE\. Expected one of \['triton', 'deep_gemm', 'cutlass', 'flashinfer_trtllm', 'flashinfer_cutlass', 'marlin', 'aiter', 'torch_grouped_mm'\]\."):
        pick("fp8_tensor", "sm121", backend="flashinfer_b12x")
    mapping = {"nvfp4": "flashinfer_b12x", "fp8": "flashinfer_cutlass"}
    assert pick("fp8_tensor", "sm121", backend=mapping).backend == "FLASHINFER_CUTLASS"
    assert pick("nvfp4", "sm121", backend=mapping).backend == "FLASHINFER_B12X"
    assert pick("fp8_tensor", "sm121", backend={"nvfp4": "flashinfer_b12x"}).via == "auto_scan"


def test_fp8_env_zero_prunes_both_flashinfer_backends(pick):
    decision = pick("fp8_block", "sm100", env={"VLLM_USE_FLASHINFER_MOE_FP8": "0"})
    assert decision.backend == "DEEPGEMM"
    pruned = next(e for e in decision.trace["events"] if e["event"] == "pruned")
    assert pruned["backends"] == ["FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS"]


@pytest.mark.parametrize("value, expected", [("latency", "FLASHINFER_TRTLLM"), ("throughput", "FLASHINFER_CUTLASS")])
def test_fp8_env_pinned(pick, value, expected):
    env = {"VLLM_USE_FLASHINFER_MOE_FP8": "1", "VLLM_FLASHINFER_MOE_BACKEND": value}
    assert pick("fp8_tensor", "sm100", env=env).backend == expected


def test_fp8_env_pinned_backend_is_validated_without_fallback(pick):
    env = {"VLLM_USE_FLASHINFER_MOE_FP8": "1", "VLLM_FLASHINFER_MOE_BACKEND": "throughput"}
    with pytest.raises(ValueError, match=r"^FP8 MoE backend FLASHINFER_CUTLASS does not support the deployment configuration since kernel does not support quantization scheme fp8_e4m3:static:block128x128 x fp8_e4m3:dynamic:group1x128\.$"):
        pick("fp8_block", "sm100", env=env)


def test_fp8_env_pinned_masked_gemm_is_refused(pick):
    env = {"VLLM_USE_FLASHINFER_MOE_FP8": "1", "VLLM_FLASHINFER_MOE_BACKEND": "masked_gemm"}
    with pytest.raises(ValueError, match=r"^FlashInfer MaskedGEMM not supported for FP8$"):
        pick("fp8_block", "sm100", env=env)


def test_fp8_env_one_tries_trtllm_then_cutlass(pick):
    decision = pick("fp8_block", "sm90", env={"VLLM_USE_FLASHINFER_MOE_FP8": "1"})
    assert (decision.backend, decision.via) == ("FLASHINFER_CUTLASS", "flashinfer_preference")
    with pytest.raises(NotImplementedError, match=r"^Found VLLM_USE_FLASHINFER_MOE_FP8=1, but no FlashInfer FP8 MoE backend supports the configuration\."):
        pick("fp8_block", "sm80", env={"VLLM_USE_FLASHINFER_MOE_FP8": "1"})


def test_deep_gemm_set_forces_deep_gemm(pick):
    decision = pick("fp8_block", "sm90", env={"VLLM_USE_DEEP_GEMM": "1"})
    assert (decision.backend, decision.via) == ("DEEPGEMM", "deep_gemm_override")
    assert pick("fp8_block", "sm90", env={"VLLM_MOE_USE_DEEP_GEMM": "1"}, parallel=BATCHED).backend == "BATCHED_DEEPGEMM"
    with pytest.raises(ValueError, match="FP8 MoE backend DEEPGEMM does not support the deployment configuration since needs compute capability 9.0 or 10.x, this is 8.0"):
        pick("fp8_block", "sm80", env={"VLLM_USE_DEEP_GEMM": "1"})


@pytest.mark.parametrize("env", [{"VLLM_USE_DEEP_GEMM": "0"}, {"VLLM_MOE_USE_DEEP_GEMM": "0"}, {"VLLM_USE_DEEP_GEMM": "1", "VLLM_MOE_USE_DEEP_GEMM": "0"}])
def test_deep_gemm_off_prunes_it(pick, env):
    decision = pick("fp8_block", "sm100", env={"VLLM_USE_FLASHINFER_MOE_FP8": "0", **env})
    assert decision.backend == "TRITON"
    assert decision.trace["path"] == ["start", "flashinfer_preference", "deep_gemm_override", "auto_scan", "selected"]


def test_forced_marlin_comes_after_deep_gemm_and_before_aiter(pick):
    env = {"VLLM_TEST_FORCE_FP8_MARLIN": "1", "VLLM_ROCM_USE_AITER": "1"}
    assert pick("fp8_block", "sm90", env=env).backend == "MARLIN"
    assert pick("fp8_block", "sm90", env={**env, "VLLM_USE_DEEP_GEMM": "1"}).backend == "DEEPGEMM"


def test_aiter_env(pick):
    decision = pick("fp8_block", "rocm-mi300", env={"VLLM_ROCM_USE_AITER": "1"})
    assert (decision.backend, decision.via) == ("AITER", "aiter_override")
    decision = pick("fp8_block", "rocm-mi300", env={"VLLM_ROCM_USE_AITER_MOE": "0"})
    assert decision.backend == "TRITON"
    assert decision.trace["path"] == ["start", "aiter_override", "auto_scan", "selected"]
    with pytest.raises(ValueError, match="FP8 MoE backend AITER does not support the deployment configuration since needs a rocm device"):
        pick("fp8_block", "sm90", env={"VLLM_ROCM_USE_AITER": "1", "VLLM_USE_DEEP_GEMM": "0"})


def test_both_env_overrides_are_entered_when_both_rules_apply(pick):
    env = {"VLLM_USE_DEEP_GEMM": "0", "VLLM_ROCM_USE_AITER": "0"}
    decision = pick("fp8_block", "sm90", env=env)
    assert decision.trace["path"] == ["start", "deep_gemm_override", "aiter_override", "auto_scan", "selected"]
