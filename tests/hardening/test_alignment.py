"""Issue 12, item 5: alignment conditions as requirement data (seeds profile).

Block FP8 (128x128 weight blocks) kernels that take whole blocks only:
DeepGEMM (vLLM's ``_valid_deep_gemm_shape``: N and K multiples of 128),
FlashInfer CUTLASS and TRTLLM (``prepare_deepseek_fp8_x_sf``: K divisible by
128). NVFP4 scales every 16 values along each GEMM's reduction, so both sizes
must be multiples of 16.
"""

from __future__ import annotations

import pytest

from moe_fsm import BackendUnsupportedError, InputError, MoELayer, QuantScheme, preset, select

SIZES_OFF = [(100, 2048), (7168, 100), (7168, 200)]


def _block_fp8(hidden, intermediate):
    return MoELayer(quant=QuantScheme.fp8("block", "group"), num_experts=256, top_k=8, hidden_size=hidden,
                    intermediate_size=intermediate)


@pytest.mark.parametrize("platform,env,backend", [
    ("sm90", {"VLLM_USE_DEEP_GEMM": "1"}, "deep_gemm"),
    ("sm90", {}, "flashinfer_cutlass"),
    ("sm100", {}, "flashinfer_trtllm"),
])
@pytest.mark.parametrize("hidden,intermediate", SIZES_OFF)
def test_block_fp8_kernels_need_128_aligned_sizes(platform, env, backend, hidden, intermediate):
    aligned = select(_block_fp8(7168, 2048), platform=preset(platform), env=env, backend=backend)
    assert aligned.backend == backend.upper().replace("DEEP_GEMM", "DEEPGEMM")
    with pytest.raises(BackendUnsupportedError, match="needs sizes that are multiples of 128") as caught:
        select(_block_fp8(hidden, intermediate), platform=preset(platform), env=env, backend=backend)
    assert f"{'hidden_size' if hidden % 128 else 'intermediate_size'} {hidden if hidden % 128 else intermediate}" in str(caught.value)


@pytest.mark.parametrize("platform,env", [("sm90", {"VLLM_USE_DEEP_GEMM": "1", "VLLM_MOE_USE_DEEP_GEMM": "1"}),
                                          ("sm90", {}), ("sm100", {})])
def test_auto_falls_back_to_triton_for_unaligned_block_fp8(platform, env):
    if env:
        with pytest.raises(BackendUnsupportedError):  # VLLM_USE_DEEP_GEMM=1 forces DeepGEMM, which cannot run it
            select(_block_fp8(100, 2048), platform=preset(platform), env=env)
        return
    assert select(_block_fp8(100, 2048), platform=preset(platform), env=env).backend == "TRITON"


def test_triton_and_other_schemes_are_not_constrained():
    layer = MoELayer(quant=QuantScheme.fp8("tensor", "tensor", static_activation=True), hidden_size=100, intermediate_size=100)
    assert select(layer, platform=preset("sm90"), env={}).backend == "FLASHINFER_CUTLASS"


@pytest.mark.parametrize("intermediate", [24, 33, 40])
def test_nvfp4_intermediate_sizes_must_be_multiples_of_16(intermediate):
    with pytest.raises(InputError, match=f"NVFP4 needs intermediate_size divisible by 16 .* got {intermediate}"):
        MoELayer(quant=QuantScheme.nvfp4(), intermediate_size=intermediate)
    assert MoELayer(quant=QuantScheme.nvfp4(), intermediate_size=48).intermediate_size == 48
