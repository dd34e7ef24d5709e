"""TRITON and BATCHED_TRITON experts: the Triton fused-MoE kernels behind the Experts interface.

``TritonExperts`` (Standard format) runs the whole layer in the kernels, the
top-k weighting and sum included, so it declares ``WeightAndReduce.EXPERTS`` and
finalize only copies. ``BatchedTritonExperts`` (Batched format) computes each
expert's slab and leaves weighting and scatter-back to finalize (``BATCHED``).
In both, a router weight on the input was already applied by prepare (the
modular kernel's convention), so the kernels then skip the output weighting.

FP8 layers: prepare quantizes the input with ``input_quantizer`` (the Triton
quantizer, bound to the static ``a1_scale`` for static keys); the intermediate
is re-quantized inside the w1 GEMM's epilogue for 1x128 groups and static scales,
or right after it for dynamic per-token / per-tensor scales.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import Granularity, QuantFamily, QuantScheme
from moe_fsm.kernels.triton_moe import Fp8Spec, fused_experts, fused_experts_batched, max_padded_rows, quantize_activation
from moe_fsm.modular.interfaces import (
    ActivationFormat,
    DynamicFP8RowQuantizer,
    ExpertScales,
    Experts,
    InputQuantizer,
    PreparedTokens,
    WeightAndReduce,
)

_WEIGHT_GRANULARITY = {
    Granularity.TENSOR: "tensor",
    Granularity.CHANNEL: "channel",
    Granularity.BLOCK_128x128: "block",
}
_ACTIVATION_GRANULARITY = {
    Granularity.TENSOR: "tensor",
    Granularity.TOKEN: "token",
    Granularity.GROUP_1x128: "group",
}
_LAYER_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def fp8_spec(scheme: QuantScheme) -> Optional[Fp8Spec]:
    """The kernels' FP8 layout for a scheme; None for unquantized; KernelInputError if they have none."""
    if scheme.family is QuantFamily.UNQUANTIZED:
        return None
    if scheme.family is not QuantFamily.FP8:
        raise KernelInputError(f"the Triton MoE kernels run unquantized and FP8 w8a8 layers; got {scheme.describe()}")
    weight = _WEIGHT_GRANULARITY.get(scheme.weight.granularity)
    activation = _ACTIVATION_GRANULARITY.get(scheme.activation.granularity)
    if weight is None or activation is None:
        raise KernelInputError(f"the Triton MoE kernels have no FP8 layout for {scheme.describe()}")
    return Fp8Spec(weight, activation)


def triton_scheme_supported(layer: MoELayer) -> tuple[bool, str]:
    """Whether these kernels compute ``layer`` (scheme and dtype only; platform checks are the registry's)."""
    if layer.dtype not in _LAYER_DTYPES:
        return False, f"the Triton MoE kernels compute in bfloat16 or float16; the layer is {layer.dtype}"
    try:
        spec = fp8_spec(layer.quant)
    except KernelInputError as exc:
        return False, str(exc)
    if spec is None:
        return True, f"unquantized {layer.dtype}"
    return True, f"FP8 w8a8, {spec.weight} weight scales with {spec.activation} activation scales"


def _static_activation_scales(layer: MoELayer, scales: Optional[ExpertScales]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(a1, a2) static scales for static activation keys, (None, None) for dynamic ones."""
    key = layer.quant.activation
    if key is None or not key.static:
        return None, None
    a1 = scales.a1_scale if scales is not None else None
    a2 = scales.a2_scale if scales is not None else None
    if a1 is None or a2 is None:
        raise KernelInputError(f"the static activation key {key} needs ExpertScales.a1_scale and a2_scale; one is missing")
    return a1, a2


class _TritonExpertsBase(Experts):
    host_sync_free = True  # fused.py: shapes are checked on the host, ids and counts are only read by the kernels

    def __init__(self, layer: MoELayer) -> None:
        supported, reason = triton_scheme_supported(layer)
        if not supported:
            raise KernelInputError(reason)
        self.layer = layer
        self.spec = fp8_spec(layer.quant)
        self.out_dtype = _LAYER_DTYPES[layer.dtype]

    def input_quantizer(self, scales: Optional[ExpertScales] = None) -> Optional[InputQuantizer]:
        if self.spec is None:
            return None
        a1, _ = _static_activation_scales(self.layer, scales)
        granularity = self.spec.activation
        if a1 is None and granularity in ("token", "group"):
            return DynamicFP8RowQuantizer(granularity, lambda hidden: quantize_activation(hidden, granularity))
        return lambda hidden: quantize_activation(hidden, granularity, a1)

    def _kernel_args(self, prepared: PreparedTokens, scales: ExpertScales) -> dict:
        """FP8 arguments of the kernels: scales, and the input's scale when prepare quantized it."""
        quantized = prepared.hidden.dtype == torch.float8_e4m3fn
        if self.spec is None:
            if quantized or prepared.scale is not None:
                raise KernelInputError(f"{self.name} computes an unquantized layer but the prepared tokens are quantized")
            return {}
        if quantized and prepared.scale is None:
            raise KernelInputError("FP8 prepared tokens need their scale (PreparedTokens.scale)")
        a1, a2 = _static_activation_scales(self.layer, scales)
        return {
            "fp8": self.spec,
            "w1_scale": scales.w1_scale,
            "w2_scale": scales.w2_scale,
            "a1_scale": prepared.scale if quantized else a1,
            "a2_scale": a2,
            "out_dtype": self.out_dtype if quantized else None,
        }


class TritonExperts(_TritonExpertsBase):
    """Standard format: ``[M, K]`` rows in, the reduced ``[M, K]`` layer output out."""

    name = "TritonExperts"

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.STANDARD

    @property
    def weight_and_reduce(self) -> WeightAndReduce:
        return WeightAndReduce.EXPERTS

    def workspace_bytes(self, num_tokens: int) -> int:
        """Alignment buffers, the intermediate (plus its scales) and the per-slot output."""
        layer = self.layer
        pairs = num_tokens * layer.top_k
        padded = max_padded_rows(pairs, layer.num_experts, 128)
        out_size = torch.empty((), dtype=self.out_dtype).element_size()
        inter_size = 1 if self.spec is not None else out_size
        scales = pairs * (-(-layer.intermediate_size // 128)) * 4 if self.spec is not None else 0
        return 4 * (layer.num_experts + 2 * pairs + padded) + pairs * layer.intermediate_size * inter_size + scales + pairs * layer.hidden_size * out_size

    def apply(
        self,
        prepared: PreparedTokens,
        w1: torch.Tensor,
        w2: torch.Tensor,
        scales: ExpertScales,
        *,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        """The reduced ``[M, K]`` output; with the router weight on the input, outputs are not weighted again."""
        scales = scales or ExpertScales()
        weights = torch.ones_like(prepared.topk_weights) if apply_router_weight_on_input else prepared.topk_weights
        return fused_experts(
            prepared.hidden,
            w1,
            w2,
            weights,
            prepared.topk_ids,
            activation=self.layer.activation.value,
            swiglu_limit=self.layer.swiglu_limit,
            **self._kernel_args(prepared, scales),
        )


class BatchedTritonExperts(_TritonExpertsBase):
    """Batched format: ``[E_local, max_tokens, K]`` in, the same layout out, unweighted."""

    name = "BatchedTritonExperts"

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.BATCHED

    @property
    def weight_and_reduce(self) -> WeightAndReduce:
        return WeightAndReduce.BATCHED

    def workspace_bytes(self, num_tokens: int) -> int:
        """The intermediate and output slabs, worst case (every pair in one expert's slab height)."""
        layer = self.layer
        rows = layer.num_experts * num_tokens
        out_size = torch.empty((), dtype=self.out_dtype).element_size()
        inter_size = 1 if self.spec is not None else out_size
        return rows * (layer.intermediate_size * inter_size + layer.hidden_size * out_size)

    def apply(
        self,
        prepared: PreparedTokens,
        w1: torch.Tensor,
        w2: torch.Tensor,
        scales: ExpertScales,
        *,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        if prepared.expert_num_tokens is None:
            raise KernelInputError("batched experts need PreparedTokens.expert_num_tokens (a Batched-format prepare)")
        scales = scales or ExpertScales()
        return fused_experts_batched(
            prepared.hidden,
            prepared.expert_num_tokens,
            w1,
            w2,
            activation=self.layer.activation.value,
            swiglu_limit=self.layer.swiglu_limit,
            **self._kernel_args(prepared, scales),
        )
