"""The trimmed FlashInfer build's decisions, checked without nvcc, flashinfer or a GPU.

What is kept (a generated file holding ANY wanted pair; fp8_blockscale_gemm.cu always; dispatch
files per set), which undefined symbols fail a build (those of kept dtype pairs), how -j follows
free memory, and the CLI's refusals. The build itself runs on the GPU machine
(docs/perf/flashinfer.md).
"""

from __future__ import annotations

import pytest

from moe_fsm.cli.main import main as cli
from moe_fsm.experts import flashinfer_build as fb

SM80_GROUP0 = """
template void sm80_generic_fused_moe_gemm_kernelLauncher<cutlass::half_t, cutlass::half_t, 128, 128, 64, 2, X>(...);
template void sm80_generic_fused_moe_gemm_kernelLauncher<cutlass::bfloat16_t, cutlass::bfloat16_t, 128, 128, 64, 2, X>(...);
"""
SM90_FP16 = "INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM(Sm90, half, half, half, X)\n"


def _wanted(*sets):
    return set().union(*(fb.DTYPE_SETS[d] for d in sets))


def test_a_generated_file_is_kept_when_it_holds_any_wanted_pair(tmp_path):
    mixed = tmp_path / "cutlass_kernel_file_gemm_grouped_sm80_M128_group0.generated.cu"
    mixed.write_text(SM80_GROUP0)
    fp16_only = tmp_path / "cutlass_kernel_file_gemm_grouped_sm90_M128_group1.generated.cu"
    fp16_only.write_text(SM90_FP16)
    assert fb.generated_pairs(mixed) == {("sm80", "cutlass::half_t", "cutlass::half_t"),
                                         ("sm80", "cutlass::bfloat16_t", "cutlass::bfloat16_t")}
    assert fb.keep_source(mixed, _wanted("bf16"), ["bf16"])  # measured: dropping it left bf16 launchers undefined
    assert not fb.keep_source(fp16_only, _wanted("bf16", "fp8"), ["bf16", "fp8"])
    assert fb.keep_source(fp16_only, _wanted("fp16"), ["fp16"])


def test_blockscale_source_is_always_kept_and_dispatch_files_follow_the_sets(tmp_path):
    wanted = _wanted("bf16")
    assert fb.keep_source(tmp_path / "fp8_blockscale_gemm.cu", wanted, ["bf16"])
    assert fb.keep_source(tmp_path / "moe_gemm_kernels_bf16_bf16.cu", wanted, ["bf16"])
    assert not fb.keep_source(tmp_path / "moe_gemm_kernels_fp8_fp8.cu", wanted, ["bf16"])
    assert fb.keep_source(tmp_path / "moe_gemm_kernels_bf16_fp8.cu", wanted, ["bf16", "fp8_block"])


@pytest.mark.parametrize(
    "symbol,pair",
    [
        ("void tensorrt_llm::kernels::cutlass_kernels_oss::sm80_generic_fused_moe_gemm_kernelLauncher<cutlass::bfloat16_t, "
         "cutlass::bfloat16_t, 32, 128, 64, 2, tensorrt_llm::cutlass_extensions::EpilogueOpDefaultSilu>(...)", ("bf16", "bf16")),
        ("tensorrt_llm::kernels::cutlass_kernels::MoeGemmRunner<__nv_fp8_e4m3, cutlass::integer_subbyte<4, false>, "
         "__nv_bfloat16, __nv_bfloat16>::moeGemmBiasAct(...)", ("fp8", "int4")),
        ("tensorrt_llm::kernels::fp8_blockscale_gemm::CutlassFp8BlockScaleGemmRunner<__nv_bfloat16, __nv_fp8_e4m3, "
         "__nv_bfloat16>::gemm(...)", ("bf16", "fp8")),
        ("tensorrt_llm::kernels::cutlass_kernels::MoeGemmRunner<half, half, half, half>::getConfigs() const", ("fp16", "fp16")),
        ("tensorrt_llm::common::getSMVersion()", None),
    ],
)
def test_symbol_pair_reads_the_first_dtype_pair(symbol, pair):
    assert fb.symbol_pair(symbol) == pair


def test_undefined_symbols_of_kept_pairs_fail_and_those_of_dropped_pairs_stay():
    symbols = [
        ("_Z1a", "void tensorrt_llm::kernels::cutlass_kernels_oss::sm80_generic_fused_moe_gemm_kernelLauncher"
                 "<cutlass::bfloat16_t, cutlass::bfloat16_t, 32, 128, 64, 2, X>(...)"),
        ("_Z1b", "tensorrt_llm::kernels::cutlass_kernels::MoeGemmRunner<__nv_fp8_e4m3, cutlass::integer_subbyte<4, false>, "
                 "__nv_bfloat16, __nv_bfloat16>::moeGemmBiasAct(...)"),
        ("_Z1c", "tensorrt_llm::common::somethingElse()"),
        ("cudaMalloc", "cudaMalloc"),
    ]
    bf16 = fb.classify_undefined(symbols, ["bf16"])
    assert len(bf16["kept_pair"]) == 1 and "bfloat16_t" in bf16["kept_pair"][0]
    assert len(bf16["dropped_pair"]) == 1 and len(bf16["no_pair"]) == 1
    fp16 = fb.classify_undefined(symbols, ["fp16"])
    assert fp16["kept_pair"] == []


def test_dtype_sets_are_parsed_and_unknown_ones_refused():
    assert fb.parse_dtype_sets("bf16, fp8,bf16") == ["bf16", "fp8"]
    with pytest.raises(ValueError, match="unknown"):
        fb.parse_dtype_sets("bf16,int4")


def test_jobs_follow_free_memory_at_about_5_gb_a_compile(monkeypatch):
    monkeypatch.setattr(fb.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(fb, "meminfo", lambda: {"MemAvailable": int(40e9), "MemTotal": int(128e9)})
    assert fb.default_jobs()[0] == 8
    monkeypatch.setattr(fb, "meminfo", lambda: {"MemAvailable": int(120e9), "MemTotal": int(128e9)})
    assert fb.default_jobs()[0] == 16
    monkeypatch.setattr(fb, "meminfo", lambda: {"MemAvailable": int(1e9), "MemTotal": int(8e9)})
    assert fb.default_jobs()[0] == 1


def test_depfile_paths_are_read_across_continuation_lines(tmp_path):
    data = tmp_path / "flashinfer" / "data"
    (data / "csrc").mkdir(parents=True)
    header = data / "csrc" / "tvm_ffi_utils.h"
    header.write_text("")
    text = f"x.o: {data}/csrc/a/../tvm_ffi_utils.h \\\n  /usr/include/stdio.h\n"
    paths = fb._depfile_paths(text)
    assert fb._data_relative(paths, data) == {"csrc/tvm_ffi_utils.h"}


def test_cli_refuses_bad_flags_with_status_2(capsys):
    assert cli(["flashinfer", "build", "--dtypes", "int4"]) == 2
    assert "unknown" in capsys.readouterr().err
    assert cli(["flashinfer", "build", "--jobs", "0"]) == 2


def test_a_smoke_child_that_dies_fails_its_set_not_the_caller(tmp_path, monkeypatch):
    dying = tmp_path / "python"
    dying.write_text("#!/bin/sh\nkill -SEGV $$\n")
    dying.chmod(0o755)
    monkeypatch.setattr(fb.sys, "executable", str(dying))
    report = fb.smoke_in_child(tmp_path, "bf16", timeout=60)
    assert report["ok"] is False and report["returncode"] < 0
    assert "died" in report["reason"]


def test_a_smoke_child_without_cuda_says_why(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only answer")
    report = fb.smoke_in_child(tmp_path, "bf16", timeout=300)
    assert report["ok"] is False and report["returncode"] == 1
    assert "no CUDA device" in report["reason"]
