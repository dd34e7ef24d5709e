"""Adapter to FlashInfer's CUTLASS fused MoE (``flashinfer.fused_moe.cutlass_fused_moe``).

The kernel routes, computes and reduces in one call, so the experts declare
``WeightAndReduce.EXPERTS``. FlashInfer wants the gated first GEMM as [up; gate] where moe-fsm
(like vLLM's checkpoints) stores [gate; up]; the halves are swapped once per weight tensor and
cached, not on every call.

Three layouts run: unquantized bf16/fp16; FP8 e4m3 with per-tensor weight scales and static
per-tensor activation scales (the layout vLLM's FlashInferExperts feeds it: FP8 input quantized
by prepare, and the four scales [w1_scale*a1_scale, 1/a2_scale, w2_scale*a2_scale, a1_scale]);
and DeepSeek's block FP8 (128x128 weight blocks, dynamic 1x128 activation groups: FlashInfer's
``use_deepseek_fp8_block_scale`` path, which takes bf16 input and quantizes it inside, with the
two block-scale tensors [w1_scale, w2_scale], as vLLM passes them). Others (NVFP4's swizzled
block scales, dynamic per-tensor activation scales, other activations) are refused at
construction with the reason, never run wrong.

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


def _is_fp8_block(layer: MoELayer) -> bool:
    quant = layer.quant
    return (
        quant.family is QuantFamily.FP8
        and quant.weight is not None
        and quant.weight.granularity is Granularity.BLOCK_128x128
        and quant.activation is not None
        and quant.activation.granularity is Granularity.GROUP_1x128
        and not quant.activation.static
    )


def _refusal(layer: MoELayer) -> Optional[str]:
    """Why the adapter cannot run ``layer``; None when it can."""
    if layer.family is not QuantFamily.UNQUANTIZED and not (_is_fp8_per_tensor_static(layer) or _is_fp8_block(layer)):
        return (
            f"moe-fsm's FlashInfer CUTLASS adapter runs unquantized and FP8 per-tensor (static activation scale) "
            f"layers, and FP8 128x128-block ones (dynamic 1x128 activation groups); {layer.quant.describe()} needs "
            "FlashInfer's other scale layouts, which moe-fsm does not produce"
        )
    if _is_fp8_block(layer) and (layer.hidden_size % 128 or layer.intermediate_size % 128):
        return (
            "FlashInfer's DeepSeek block-FP8 path needs hidden and intermediate sizes that are multiples of 128; "
            f"this layer has {layer.hidden_size} and {layer.intermediate_size}"
        )
    if layer.activation is not Activation.SILU or layer.swiglu_limit is not None:
        return (
            "moe-fsm's FlashInfer CUTLASS adapter runs SiLU without the SwiGLU clamp; "
            f"this layer has {layer.activation.value} with swiglu_limit={layer.swiglu_limit}"
        )
    if layer.dtype not in _DTYPE_SET:
        return f"FlashInfer CUTLASS MoE takes bfloat16 or float16 activations, not {layer.dtype}"
    if _is_fp8_block(layer) and layer.dtype != "bfloat16":
        return f"FlashInfer's DeepSeek block-FP8 path takes bfloat16 activations, not {layer.dtype}"
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
            failed = (f" ({dtype_set} was built but failed the build's smoke call: see {prebuilt.so_path.parent}"
                      "/manifest.json)" if dtype_set in prebuilt.failed_smoke else "")
            raise BackendUnavailableError(
                f"the prebuilt FlashInfer module at {prebuilt.so_path} holds {sorted(prebuilt.dtype_sets)}, not "
                f"{dtype_set}{failed}; rebuild it with `{flashinfer_prebuilt.BUILD_COMMAND} --dtypes {dtype_set},...`"
            )
    return module.cutlass_fused_moe


class FlashInferCutlassExperts(Experts):
    name = "FlashInferExperts"

    def __init__(self, layer: MoELayer) -> None:
        reason = _refusal(layer)
        if reason is not None:
            raise BackendUnavailableError(reason)
        self.layer = layer
        self.block = _is_fp8_block(layer)
        self.fp8 = layer.family is QuantFamily.FP8 and not self.block  # FP8 per tensor
        self.out_dtype = getattr(torch, layer.dtype)
        self.dtype_set = "fp8_block" if self.block else ("fp8" if self.fp8 else _DTYPE_SET[layer.dtype])
        self._fused_moe = _cutlass_fused_moe(self.dtype_set)
        self._swapped: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.STANDARD

    @property
    def weight_and_reduce(self) -> WeightAndReduce:
        return WeightAndReduce.EXPERTS

    def input_quantizer(self, scales: Optional[ExpertScales] = None) -> Optional[InputQuantizer]:
        return input_quantizer(self.layer.quant, scales) if self.fp8 else None

    def _up_then_gate(self, w1: torch.Tensor, slot: str = "w1") -> torch.Tensor:
        """[gate; up] rows -> [up; gate], once per tensor (and version) per slot (weights, block scales)."""
        key = (w1.data_ptr(), w1._version)
        cached = self._swapped.get(slot)
        if cached is None or cached[0] != key:
            half = w1.shape[1] // 2
            cached = (key, torch.cat([w1[:, half:], w1[:, :half]], dim=1).contiguous())
            self._swapped[slot] = cached
        return cached[1]

    def _block_scales(self, scales: ExpertScales) -> list[torch.Tensor]:
        if scales.w1_scale is None or scales.w2_scale is None:
            raise KernelInputError(f"{self.name} needs the 128x128 block scales w1_scale and w2_scale")
        e, n, k = self.layer.num_experts, self.layer.intermediate_size, self.layer.hidden_size
        expected = ((e, 2 * n // 128, k // 128), (e, k // 128, n // 128))
        got = (tuple(scales.w1_scale.shape), tuple(scales.w2_scale.shape))
        if got != expected:
            raise KernelInputError(f"{self.name}: block scales of shapes {got}, expected {expected}")
        return [self._up_then_gate(scales.w1_scale.to(torch.float32), "w1_scale"),
                scales.w2_scale.to(torch.float32).contiguous()]

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
        extra = {}
        if self.block:
            if prepared.hidden.dtype != torch.bfloat16:
                raise KernelInputError(f"{self.name} (block FP8) takes bfloat16 tokens; FlashInfer quantizes them")
            quant_scales = self._block_scales(scales or ExpertScales())
            extra["use_deepseek_fp8_block_scale"] = True
        else:
            quant_scales = self._fp8_scales(prepared, scales or ExpertScales()) if self.fp8 else []
        out = self._fused_moe(
            prepared.hidden.contiguous(),
            prepared.topk_ids.to(torch.int32),
            weights.to(torch.float32),
            self._up_then_gate(w1),
            w2.contiguous(),
            self.out_dtype,
            quant_scales=quant_scales,
            **extra,
        )
        return out[0] if isinstance(out, (list, tuple)) else out
