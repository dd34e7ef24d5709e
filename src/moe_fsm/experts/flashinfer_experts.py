"""Adapter to FlashInfer's CUTLASS fused MoE (``flashinfer.fused_moe.cutlass_fused_moe``).

The kernel routes, computes and reduces in one call, so the experts declare
``WeightAndReduce.EXPERTS``. FlashInfer wants the gated first GEMM as
[up; gate] where moe-fsm (like vLLM's checkpoints) stores [gate; up], so the
halves are swapped. The adapter runs the unquantized bf16/fp16 path with SiLU;
the FP8 and NVFP4 paths need FlashInfer's own scale layouts (swizzled NVFP4
block scales, pre-multiplied FP8 alphas), which moe-fsm does not produce, so
they are refused at construction with that reason rather than run wrong.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from moe_fsm.errors import BackendUnavailableError
from moe_fsm.inputs.layer import Activation, MoELayer
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.modular.interfaces import ActivationFormat, ExpertScales, Experts, PreparedTokens, WeightAndReduce


def _cutlass_fused_moe():
    try:
        module = importlib.import_module("flashinfer.fused_moe")
    except ImportError as err:
        raise BackendUnavailableError(
            f"FlashInfer CUTLASS MoE needs flashinfer-python (pip install 'moe-fsm[flashinfer]'): {err}"
        ) from None
    return module.cutlass_fused_moe


class FlashInferCutlassExperts(Experts):
    name = "FlashInferExperts"

    def __init__(self, layer: MoELayer) -> None:
        if layer.family is not QuantFamily.UNQUANTIZED:
            raise BackendUnavailableError(
                f"moe-fsm's FlashInfer CUTLASS adapter runs unquantized layers only; {layer.quant.describe()} needs "
                "FlashInfer's swizzled scale layouts, which moe-fsm does not produce"
            )
        if layer.activation is not Activation.SILU or layer.swiglu_limit is not None:
            raise BackendUnavailableError(
                "moe-fsm's FlashInfer CUTLASS adapter runs SiLU without the SwiGLU clamp; "
                f"this layer has {layer.activation.value} with swiglu_limit={layer.swiglu_limit}"
            )
        if layer.dtype not in ("bfloat16", "float16"):
            raise BackendUnavailableError(f"FlashInfer CUTLASS MoE takes bfloat16 or float16, not {layer.dtype}")
        self.layer = layer
        self._fused_moe = _cutlass_fused_moe()

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.STANDARD

    @property
    def weight_and_reduce(self) -> WeightAndReduce:
        return WeightAndReduce.EXPERTS

    def apply(
        self,
        prepared: PreparedTokens,
        w1: torch.Tensor,
        w2: torch.Tensor,
        scales: Optional[ExpertScales],
        *,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        n = self.layer.intermediate_size
        up_then_gate = torch.cat([w1[:, n:], w1[:, :n]], dim=1).contiguous()
        weights = torch.ones_like(prepared.topk_weights) if apply_router_weight_on_input else prepared.topk_weights
        out = self._fused_moe(
            prepared.hidden.contiguous(),
            prepared.topk_ids.to(torch.int32),
            weights.to(torch.float32),
            up_then_gate,
            w2.contiguous(),
            prepared.hidden.dtype,
            quant_scales=[],
        )
        return out[0] if isinstance(out, (list, tuple)) else out
