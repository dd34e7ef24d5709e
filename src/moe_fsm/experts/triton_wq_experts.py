"""Triton experts for quantized weights with 16-bit activations: MXFP4 (gpt-oss), NVFP4 weight-only and INT4/INT8 WNA16.

All run ``kernels.triton_wq``: the weights stay quantized in memory and are
dequantized tile by tile inside the two grouped GEMMs; biases, the gated
activation (SwiGLU-OAI with its clamp), the router weights and the top-k sum are
fused, so the experts return the reduced ``[M, K]`` output
(``WeightAndReduce.EXPERTS``). A router weight on the input was applied by
prepare, so the kernels then weight the outputs by one.

Weights arrive in moe-fsm's layout (w1 rows gate-then-up) with the scales of
``quantize.weights``: MXFP4 E8M0 exponents [E, R, C/32]; NVFP4 e4m3 block scales
[E, R, C/16] and fp32 global scales [E]; INT group scales and,
for asymmetric checkpoints, zero points [E, R, C/G]; biases in ExpertScales.

Build-time re-layout: 4-bit weights are re-laid once into the kernels' SPLIT nibble
order (``relayout_nibbles``, an exact permutation of the codes inside each 64-column
chunk, rows padded with zero codes to whole chunks where K or N is not a multiple of 64,
as tensor-parallel shards are: gpt-oss-120b's TP2 N = 1440) the first time a weight
tensor is seen, and the copy is kept (keyed by the
tensor's storage and version, the source kept alive so its address cannot be reused),
as vLLM and triton_kernels re-lay MXFP4 weights at load. Activation-ordered checkpoints
(GPTQ ``desc_act``, ``w*_g_idx``) first have each expert's columns sorted by group
(``sort_act_order``, as Marlin sorts them at load), the kernels gathering the activations
through the permutation. ``relayout`` says so for the trace's build section.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.kernels.triton_wq import WeightQuant, fused_wq_experts
from moe_fsm.kernels.triton_wq import prefill
from moe_fsm.kernels.triton_wq.fused import can_split, default_wq_config, relayout_nibbles, sort_act_order, split_columns
from moe_fsm.modular.interfaces import ActivationFormat, ExpertScales, Experts, InputQuantizer, PreparedTokens, WeightAndReduce

_LAYER_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class _TritonWeightQuantExperts(Experts):
    family: QuantFamily
    # MXFP4 only: checkpoint nibble order and Triton's tl.dot_scaled upcast instead of the SPLIT re-layout and the
    # inline-PTX dequant (which of the two is faster on the H100: docs/perf/weight_quantized.md)
    scaled_dot: bool = False

    def __init__(self, layer: MoELayer) -> None:
        if layer.family is not self.family:
            raise KernelInputError(f"{self.name} runs {self.family.value} layers; this layer is {layer.quant.describe()}")
        if layer.dtype not in _LAYER_DTYPES:
            raise KernelInputError(f"{self.name} computes in bfloat16 or float16; the layer is {layer.dtype}")
        self.layer = layer
        self.quant = WeightQuant.for_scheme(layer.quant)
        self.use_scaled_dot = self.scaled_dot and layer.dtype == "bfloat16"
        self.split = not self.use_scaled_dot and can_split(self.quant)
        self._relaid: dict[tuple, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, Optional[torch.Tensor]]]] = {}

    @property
    def relayout(self) -> Optional[str]:
        """The one-time weight re-layout this kernel makes, in words (None: weights are used as given)."""
        steps = []
        if self.quant.act_order:
            steps.append("columns sorted by g_idx once per weight tensor into contiguous groups (activations gathered "
                         "through the permutation)")
        if self.split:
            steps.append("4-bit codes re-laid once per weight tensor into 64-column nibble halves (exact permutation)")
            padded = [f"{name} {cols} -> {split_columns(cols)}" for name, cols in
                      (("K", self.layer.hidden_size), ("N", self.layer.intermediate_size)) if split_columns(cols) != cols]
            if padded:
                steps.append(f"rows padded with zero codes to whole chunks ({', '.join(padded)})")
        return "; ".join(steps) or None

    def _weights(self, w: torch.Tensor, g_idx: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The weight as the kernels read it (sorted by group, SPLIT) and its activation permutation, made once."""
        if not self.split and not self.quant.act_order:
            return w, None
        if self.quant.act_order and g_idx is None:
            raise KernelInputError(f"{self.name}: activation-ordered weights need ExpertScales.w1_g_idx and w2_g_idx")
        sources = (w,) if g_idx is None else (w, g_idx)
        key = tuple((t.data_ptr(), t._version, tuple(t.shape), t.device) for t in sources)
        hit = self._relaid.get(key)
        if hit is None:
            if len(self._relaid) >= 64:
                self._relaid.clear()
            perm = None
            if self.quant.act_order:
                w, perm = sort_act_order(w, g_idx, self.quant)
            hit = self._relaid[key] = (sources, (relayout_nibbles(w) if self.split else w, perm))
        return hit[1]

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.STANDARD

    @property
    def weight_and_reduce(self) -> WeightAndReduce:
        return WeightAndReduce.EXPERTS

    def input_quantizer(self, scales: Optional[ExpertScales] = None) -> Optional[InputQuantizer]:
        return None

    def workspace_bytes(self, num_tokens: int) -> int:
        """Alignment buffers (worst case), the 16-bit intermediate and the per-pair outputs; where the default tile
        takes the bf16 Hopper path (prefill), the 16-bit weight scratch too."""
        layer = self.layer
        pairs = num_tokens * layer.top_k
        padded = pairs + min(layer.num_experts, pairs) * 127
        size = torch.empty((), dtype=_LAYER_DTYPES[layer.dtype]).element_size()
        total = 4 * (layer.num_experts + 2 * pairs + padded) + pairs * (layer.intermediate_size + layer.hidden_size) * size
        if default_wq_config(num_tokens, layer.top_k, layer.num_experts).hopper_bf16:
            total += prefill.scratch_bytes(layer.num_experts, layer.intermediate_size, layer.hidden_size,
                                           layer.bias, size)
        return total

    def apply(
        self,
        prepared: PreparedTokens,
        w1: torch.Tensor,
        w2: torch.Tensor,
        scales: ExpertScales,
        *,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        scales = scales or ExpertScales()
        if prepared.scale is not None:
            raise KernelInputError(f"{self.name} takes 16-bit activations; the prepared tokens are quantized")
        weights = torch.ones_like(prepared.topk_weights) if apply_router_weight_on_input else prepared.topk_weights
        w1, w1_perm = self._weights(w1, scales.w1_g_idx)
        w2, w2_perm = self._weights(w2, scales.w2_g_idx)
        return fused_wq_experts(
            prepared.hidden,
            w1,
            w2,
            weights,
            prepared.topk_ids,
            quant=self.quant,
            w1_scale=scales.w1_scale,
            w2_scale=scales.w2_scale,
            w1_zero_point=scales.w1_zero_point,
            w2_zero_point=scales.w2_zero_point,
            w1_perm=w1_perm,
            w2_perm=w2_perm,
            w1_global_scale=scales.w1_global_scale if self.quant.kind == "nvfp4" else None,
            w2_global_scale=scales.w2_global_scale if self.quant.kind == "nvfp4" else None,
            w1_bias=scales.w1_bias,
            w2_bias=scales.w2_bias,
            activation=self.layer.activation.value,
            swiglu_limit=self.layer.swiglu_limit,
            split=self.split,
            scaled_dot=self.use_scaled_dot,
        )


class TritonMxfp4Experts(_TritonWeightQuantExperts):
    """MXFP4 weights, bf16/fp16 activations (gpt-oss): vLLM's Triton MXFP4 path, in moe-fsm's kernels."""

    name = "TritonMxfp4Experts"
    family = QuantFamily.MXFP4


class TritonWna16Experts(_TritonWeightQuantExperts):
    """INT4/INT8 weights with group scales and zero points, 16-bit activations (GPTQ/AWQ/compressed-tensors)."""

    name = "TritonWna16Experts"
    family = QuantFamily.INT_WNA16


class TritonNvfp4Experts(_TritonWeightQuantExperts):
    """NVFP4 weights with 16-bit activations (weight-only, W4A16): what Marlin runs for NVFP4 on Hopper."""

    name = "TritonNvfp4Experts"
    family = QuantFamily.NVFP4
