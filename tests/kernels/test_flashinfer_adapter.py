"""The FlashInfer CUTLASS adapter's CPU-side contract: what it refuses, and how it finds a prebuilt module.

The kernel itself runs only on a GPU (tests/gpu/test_flashinfer_cutlass.py); here the
refusals and the prebuilt-module lookup are checked without flashinfer or CUDA.
"""

from __future__ import annotations

import json

import pytest

from moe_fsm.errors import BackendUnavailableError
from moe_fsm.experts import flashinfer_prebuilt as prebuilt
from moe_fsm.experts.flashinfer_experts import FlashInferCutlassExperts
from moe_fsm.inputs.layer import Activation, MoELayer
from moe_fsm.inputs.quant import QuantScheme

FI, TVM = "0.7.2.post1", "0.1.15.post2"


def _layer(quant=None, **overrides):
    fields = dict(quant=quant or QuantScheme.unquantized(), num_experts=8, top_k=2, hidden_size=256,
                  intermediate_size=128, dtype="bfloat16")
    fields.update(overrides)
    return MoELayer(**fields)


@pytest.mark.parametrize(
    "layer,reason",
    [
        (_layer(QuantScheme.nvfp4()), "runs unquantized and FP8 per-tensor"),
        (_layer(QuantScheme.fp8("tensor", "tensor", static_activation=False)), "runs unquantized and FP8 per-tensor"),
        (_layer(QuantScheme.fp8("channel", "token")), "runs unquantized and FP8 per-tensor"),
        (_layer(QuantScheme.fp8("block", "group"), hidden_size=192), "multiples of 128"),
        (_layer(QuantScheme.fp8("block", "group"), dtype="float16"), "block-FP8 path takes bfloat16"),
        (_layer(activation=Activation.GELU), "runs SiLU without the SwiGLU clamp"),
        (_layer(swiglu_limit=7.0), "runs SiLU without the SwiGLU clamp"),
        (_layer(dtype="float32"), "takes bfloat16 or float16"),
    ],
)
def test_refuses_layouts_it_cannot_run_with_the_reason(layer, reason):
    with pytest.raises(BackendUnavailableError, match=reason):
        FlashInferCutlassExperts(layer)


def _write_prebuilt(directory, **manifest):
    directory.mkdir(parents=True, exist_ok=True)
    fields = {"flashinfer": FI, "tvm_ffi": TVM, "arch": prebuilt.ARCH, "dtype_sets": ["bf16", "fp8"]}
    fields.update(manifest)
    (directory / "manifest.json").write_text(json.dumps(fields))
    (directory / f"{prebuilt.MODULE_NAME}.so").write_bytes(b"\x7fELF")
    return directory


def test_reads_a_matching_prebuilt_module(tmp_path):
    found = prebuilt.read_prebuilt(_write_prebuilt(tmp_path / "m"), FI, TVM)
    assert found.so_path.name == f"{prebuilt.MODULE_NAME}.so"
    assert found.dtype_sets == {"bf16", "fp8"}


def test_missing_module_names_the_build_command_and_the_jit_escape(tmp_path):
    with pytest.raises(BackendUnavailableError) as err:
        prebuilt.read_prebuilt(tmp_path / "empty", FI, TVM)
    message = str(err.value)
    assert "moe-fsm flashinfer build" in message
    assert prebuilt.PREBUILT_ENV in message and prebuilt.ALLOW_JIT_ENV in message


@pytest.mark.parametrize("field,value", [("flashinfer", "0.6.0"), ("tvm_ffi", "0.1.9"), ("arch", "10.0a")])
def test_module_built_for_another_setup_is_refused_naming_the_mismatch(tmp_path, field, value):
    directory = _write_prebuilt(tmp_path / "m", **{field: value})
    with pytest.raises(BackendUnavailableError, match=f"{field} '{value}'"):
        prebuilt.read_prebuilt(directory, FI, TVM)


def test_explicit_directory_wins_over_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _write_prebuilt(prebuilt.default_cache_dir(FI))
    explicit = _write_prebuilt(tmp_path / "explicit", dtype_sets=["fp16"])
    assert prebuilt.find_prebuilt(FI, TVM).dtype_sets == {"bf16", "fp8"}
    monkeypatch.setenv(prebuilt.PREBUILT_ENV, str(explicit))
    assert prebuilt.find_prebuilt(FI, TVM).dtype_sets == {"fp16"}
