"""Every branch of vLLM's select_unquantized_moe_backend (seed 002), through the FSM."""

import pytest

from moe_fsm.inputs.parallel import ParallelConfig

EP = ParallelConfig(tp_size=2, ep_size=2)
DP_EP = ParallelConfig(dp_size=2, ep_size=2)


@pytest.mark.parametrize(
    "platform, env, expected",
    [
        ("sm90", {}, "TRITON"),
        ("sm100", {}, "TRITON"),  # FlashInfer only when VLLM_USE_FLASHINFER_MOE_FP16=1
        ("rocm-mi300", {}, "TRITON"),
        ("rocm-mi300", {"VLLM_ROCM_USE_AITER": "1"}, "AITER"),
        ("xpu", {}, "XPU"),
        ("cpu", {}, "CPU"),
        ("tpu", {}, "TPU"),
        ("oot", {}, "OOT"),
    ],
)
def test_platform_defaults(pick, platform, env, expected):
    assert pick("bf16", platform, env=env).backend == expected


def test_flashinfer_fp16_prefers_trtllm_on_blackwell(pick):
    decision = pick("bf16", "sm100", env={"VLLM_USE_FLASHINFER_MOE_FP16": "1"})
    assert (decision.backend, decision.via) == ("FLASHINFER_TRTLLM", "flashinfer_preference")


def test_flashinfer_fp16_throughput_skips_trtllm_and_cutlass_needs_ep_without_dp(pick):
    env = {"VLLM_USE_FLASHINFER_MOE_FP16": "1", "VLLM_FLASHINFER_MOE_BACKEND": "throughput"}
    assert pick("bf16", "sm100", env=env, parallel=EP).backend == "FLASHINFER_CUTLASS"
    assert pick("bf16", "sm100", env=env).backend == "TRITON"
    decision = pick("bf16", "sm90", env=env, parallel=DP_EP)
    assert decision.backend == "TRITON"
    rejected = [e for e in decision.trace["events"] if e["event"] == "candidate" and not e["supported"]]
    assert "expert parallelism without data parallelism" in rejected[0]["reason"]


def test_flashinfer_fp16_zero_is_plain_auto(pick):
    decision = pick("bf16", "sm100", env={"VLLM_USE_FLASHINFER_MOE_FP16": "0"})
    assert decision.trace["path"] == ["start", "auto_scan", "selected"]


def test_explicit_choices(pick):
    assert pick("bf16", "sm90", backend="triton").backend == "TRITON"
    assert pick("bf16", "sm90", backend="Flashinfer-Cutlass", parallel=EP).backend == "FLASHINFER_CUTLASS"
    with pytest.raises(ValueError, match=r"^FlashInfer TRTLLM MoE backend is not available for this configuration: needs compute capability 10\.x, this is 9\.0\.$"):
        pick("bf16", "sm90", backend="flashinfer_trtllm")
    with pytest.raises(ValueError, match=r"^ROCm AITer MoE backend is not available for this configuration"):
        pick("bf16", "sm90", backend="aiter")
    with pytest.raises(ValueError, match=r"moe_backend='deep_gemm' is not supported for Unquantized MoE\. Expected one of \['triton', 'flashinfer_trtllm', 'flashinfer_cutlass', 'aiter', 'torch_grouped_mm'\]"):
        pick("bf16", "sm90", backend="deep_gemm")


def test_unknown_family_mapping_for_unquantized_defaults_to_auto(pick):
    assert pick("bf16", "sm90", backend={"fp8": "deep_gemm"}).via == "auto_scan"
