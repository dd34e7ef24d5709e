"""Adapter to FlashInfer's CUTLASS fused MoE (``flashinfer.fused_moe.cutlass_fused_moe``).

The kernel routes, computes and reduces in one call, so the experts declare
``WeightAndReduce.EXPERTS``. FlashInfer wants the gated first GEMM as [up; gate] where moe-fsm
(like vLLM's checkpoints) stores [gate; up]; the halves are swapped once per weight tensor and
cached, not on every call.

Two layouts run: unquantized bf16/fp16, and FP8 e4m3 with per-tensor weight scales and static
per-tensor activation scales (the layout vLLM's FlashInferExperts feeds it: FP8 input quantized
by prepare, and the four scales [w1_scale*a1_scale, 1/a2_scale, w2_scale*a2_scale, a1_scale]).
Others (NVFP4's swizzled block scales, 128-block FP8, dynamic activation scales, other
activations) are refused at construction with the reason, never run wrong.

On Hopper the module comes from a prebuilt, trimmed build (``flashinfer_prebuilt``); FlashInfer's
own 48-minute JIT build is never started behind the caller's back.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from moe_fsm.errors import BackendUnavailableError, KernelInputError
from moe_fsm.experts import flashinfer_prebuilt
from moe_fsm.inputs.layer import Activation, MoELayer
from moe_fsm.inputs.quant import Granularity, QuantFamily
from moe_fsm.modular.interfaces import (
    ActivationFormat,
    ExpertScales,
    Experts,
    InputQuantizer,
    PreparedTokens,
    WeightAndReduce,
)
from moe_fsm.quantize.activations import input_quantizer

_DTYPE_SET = {"bfloat16": "bf16", "float16": "fp16"}


def _is_fp8_per_tensor_static(layer: MoELayer) -> bool:
    quant = layer.quant
    return (
        quant.family is QuantFamily.FP8
        and quant.weight is not None
        and quant.weight.granularity is Granularity.TENSOR
        and quant.activation is not None
        and quant.activation.granularity is Granularity.TENSOR
        and quant.activation.static
    )


def _refusal(layer: MoELayer) -> Optional[str]:
    """Why the adapter cannot run ``layer``; None when it can."""
    if layer.family is not QuantFamily.UNQUANTIZED and not _is_fp8_per_tensor_static(layer):
        return (
            f"moe-fsm's FlashInfer CUTLASS adapter runs unquantized and FP8 per-tensor (static activation scale) "
            f"layers; {layer.quant.describe()} needs FlashInfer's other scale layouts, which moe-fsm does not produce"
        )
    if layer.activation is not Activation.SILU or layer.swiglu_limit is not None:
        return (
            "moe-fsm's FlashInfer CUTLASS adapter runs SiLU without the SwiGLU clamp; "
            f"this layer has {layer.activation.value} with swiglu_limit={layer.swiglu_limit}"
        )
    if layer.dtype not in _DTYPE_SET:
        return f"FlashInfer CUTLASS MoE takes bfloat16 or float16 activations, not {layer.dtype}"
    return None


def _cutlass_fused_moe(dtype_set: str):
    try:
        module = importlib.import_module("flashinfer.fused_moe")
    except ImportError as err:
        raise BackendUnavailableError(
            f"FlashInfer CUTLASS MoE needs flashinfer-python (pip install 'moe-fsm[flashinfer]'): {err}"
        ) from None
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        prebuilt = flashinfer_prebuilt.install_sm90_module()
        if prebuilt is not None and dtype_set not in prebuilt.dtype_sets:
            raise BackendUnavailableError(
                f"the prebuilt FlashInfer module at {prebuilt.so_path} holds {sorted(prebuilt.dtype_sets)}, not {dtype_set}; "
                f"rebuild it with `{flashinfer_prebuilt.BUILD_COMMAND} --dtypes {dtype_set},...`"
            )
    return module.cutlass_fused_moe


class FlashInferCutlassExperts(Experts):
    name = "FlashInferExperts"

    def __init__(self, layer: MoELayer) -> None:
        reason = _refusal(layer)
        if reason is not None:
            raise BackendUnavailableError(reason)
        self.layer = layer
        self.fp8 = layer.family is QuantFamily.FP8
        self.out_dtype = getattr(torch, layer.dtype)
        self._fused_moe = _cutlass_fused_moe("fp8" if self.fp8 else _DTYPE_SET[layer.dtype])
        self._swapped: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.STANDARD

    @property
    def weight_and_reduce(self) -> WeightAndReduce:
        return WeightAndReduce.EXPERTS

    def input_quantizer(self, scales: Optional[ExpertScales] = None) -> Optional[InputQuantizer]:
        return input_quantizer(self.layer.quant, scales) if self.fp8 else None

    def _up_then_gate(self, w1: torch.Tensor) -> torch.Tensor:
        key = (w1.data_ptr(), w1._version)
        swapped = self._swapped.get(key)
        if swapped is None:
            n = self.layer.intermediate_size
            swapped = torch.cat([w1[:, n:], w1[:, :n]], dim=1).contiguous()
            self._swapped = {key: swapped}
        return swapped

    def _fp8_scales(self, prepared: PreparedTokens, scales: ExpertScales) -> list[torch.Tensor]:
        if prepared.hidden.dtype != torch.float8_e4m3fn or prepared.scale is None:
            raise KernelInputError(f"{self.name} takes FP8 tokens quantized by prepare, with their per-tensor scale")
        if scales.a2_scale is None or scales.w1_scale is None or scales.w2_scale is None:
            raise KernelInputError(f"{self.name} needs w1_scale, w2_scale and the static a2_scale")
        a1 = prepared.scale.to(torch.float32).reshape(())
        a2 = scales.a2_scale.to(torch.float32).max()
        return [
            (scales.w1_scale.to(torch.float32) * a1).contiguous(),
            (1.0 / a2).reshape(()),
            (scales.w2_scale.to(torch.float32) * a2).contiguous(),
            a1,
        ]

    def apply(
        self,
        prepared: PreparedTokens,
        w1: torch.Tensor,
        w2: torch.Tensor,
        scales: Optional[ExpertScales],
        *,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        weights = torch.ones_like(prepared.topk_weights) if apply_router_weight_on_input else prepared.topk_weights
        quant_scales = self._fp8_scales(prepared, scales or ExpertScales()) if self.fp8 else []
        out = self._fused_moe(
            prepared.hidden.contiguous(),
            prepared.topk_ids.to(torch.int32),
            weights.to(torch.float32),
            self._up_then_gate(w1),
            w2.contiguous(),
            self.out_dtype,
            quant_scales=quant_scales,
        )
        return out[0] if isinstance(out, (list, tuple)) else out
