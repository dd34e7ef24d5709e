"""Experts that run on any torch device: unquantized math, and FP8 / NVFP4 emulation.

The CPU backend, the fallback where no optimized kernel exists, and the emulation
of quantized kernels: pairs are grouped by expert (no Python loop over tokens),
each expert that received tokens runs two dense GEMMs, and results land by
index, so a call costs two matrix products per active expert plus gathers.

Quantized schemes emulate what the real kernels compute: the input arrives
quantized from prepare and is dequantized, the weights are dequantized (per
expert, as the loop reaches it), the math runs in float32, and the intermediate
after the activation is quantized again the way the kernels feed the second GEMM
(dynamic 1x128 groups for block schemes, per token or per tensor for those keys,
``a2_scale`` / ``a2_global_scale`` for static parts). Unquantized layers compute
in the layer dtype, as the GPU kernels do (float32 accumulation inside the GEMM,
intermediate stored in the layer dtype).

Output: the Standard experts return the *unweighted* per-slot results
``[M, top_k, K]`` (``WeightAndReduce.CONTIGUOUS``; finalize applies the router
weights and sums, which keeps EP/DP combines simple); slots whose id is -1 are
zero. The Batched experts return ``[E_local, max_tokens, K]`` (``BATCHED``), zero
past each expert's count.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.kernels.activations import apply_activation
from moe_fsm.kernels.grouping import group_by_expert
from moe_fsm.modular.interfaces import ActivationFormat, ExpertScales, Experts, InputQuantizer, PreparedTokens
from moe_fsm.quantize.activations import activation_quant, input_quantizer, static_scale
from moe_fsm.quantize.weights import weight_format

_INDEX_BYTES = 8


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class ExpertMath:
    """The per-expert steps both layouts share, specialised to one layer's scheme by table lookups."""

    def __init__(self, layer: MoELayer) -> None:
        self.layer = layer
        self.weights = weight_format(layer.quant)
        self.act_quant = activation_quant(layer.quant)
        self.out_dtype = torch_dtype(layer.dtype)
        quantized = layer.quant.family is not QuantFamily.UNQUANTIZED
        self.compute_dtype = torch.float32 if quantized else self.out_dtype

    def input_quantizer(self, scales: Optional[ExpertScales]) -> Optional[InputQuantizer]:
        return input_quantizer(self.layer.quant, scales)

    def dequantize_input(self, hidden: torch.Tensor, scale: Optional[torch.Tensor], scales: ExpertScales) -> torch.Tensor:
        if self.act_quant is None:
            return hidden.to(self.compute_dtype)
        return self.act_quant.dequantize(hidden, scale, static_scale(self.act_quant, scales, 0), self.compute_dtype)

    def requantize(self, intermediate: torch.Tensor, scales: ExpertScales) -> torch.Tensor:
        """What the second GEMM sees of the intermediate: re-quantized as the kernels do, or itself."""
        if self.act_quant is None:
            return intermediate
        return self.act_quant.fake_quantize(intermediate, static_scale(self.act_quant, scales, 1), self.compute_dtype)

    def _weight(self, w: torch.Tensor, scale: Optional[torch.Tensor], global_scale: Optional[torch.Tensor], e: int) -> torch.Tensor:
        if self.weights is None:
            return w[e].to(self.compute_dtype)
        g = global_scale[e] if self.weights.has_global_scale else None
        return self.weights.dequantize(w[e], scale[e], g, self.compute_dtype)

    def gate_up(self, x: torch.Tensor, w1: torch.Tensor, scales: ExpertScales, e: int) -> torch.Tensor:
        """act(x @ w1[e]^T) for the rows ``x`` routed to expert ``e``."""
        h = x @ self._weight(w1, scales.w1_scale, scales.w1_global_scale, e).T
        return apply_activation(self.layer.activation.value, h, self.layer.swiglu_limit)

    def down(self, intermediate: torch.Tensor, w2: torch.Tensor, scales: ExpertScales, e: int) -> torch.Tensor:
        return (intermediate @ self._weight(w2, scales.w2_scale, scales.w2_global_scale, e).T).to(self.out_dtype)

    def workspace_bytes(self, rows: int, gathered_rows: int, intermediate_rows: int, output_rows: int) -> int:
        """Input view, one expert's gathered rows and GEMM-1 output, the intermediate, the output, one dequantized expert."""
        k, n = self.layer.hidden_size, self.layer.intermediate_size
        cd = torch.empty((), dtype=self.compute_dtype).element_size()
        od = torch.empty((), dtype=self.out_dtype).element_size()
        dequantized = 3 * n * k * cd if self.weights is not None else 0
        per_expert = gathered_rows * (k + 2 * n) * cd
        return rows * k * cd + per_expert + intermediate_rows * n * cd + output_rows * k * od + dequantized


class TorchExperts(Experts):
    """Standard format: tokens as rows, per-slot results out (finalize weights and reduces)."""

    name = "TorchExperts"

    def __init__(self, layer: MoELayer) -> None:
        self.layer = layer
        self.math = ExpertMath(layer)

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.STANDARD

    def input_quantizer(self, scales: Optional[ExpertScales] = None) -> Optional[InputQuantizer]:
        return self.math.input_quantizer(scales)

    def workspace_bytes(self, num_tokens: int) -> int:
        pairs = num_tokens * self.layer.top_k
        grouping = 5 * pairs * _INDEX_BYTES
        return self.math.workspace_bytes(num_tokens, num_tokens, pairs, pairs) + grouping

    def apply(
        self,
        prepared: PreparedTokens,
        w1: torch.Tensor,
        w2: torch.Tensor,
        scales: ExpertScales,
        *,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        """Unweighted ``[M, top_k, K]``; the router weight, if on the input, was applied by prepare."""
        scales = scales or ExpertScales()
        num_tokens, top_k = prepared.topk_ids.shape
        x = self.math.dequantize_input(prepared.hidden, prepared.scale, scales)
        groups = group_by_expert(prepared.topk_ids, w1.shape[0])
        active = groups.active_experts
        intermediate = x.new_empty((groups.num_pairs, self.layer.intermediate_size))
        for e in active:
            rows = groups.rows(e)
            intermediate[rows] = self.math.gate_up(x[groups.token[rows]], w1, scales, e)
        intermediate = self.math.requantize(intermediate, scales)
        out = torch.zeros((num_tokens * top_k, self.layer.hidden_size), dtype=self.math.out_dtype, device=x.device)
        for e in active:
            rows = groups.rows(e)
            out[groups.pair[rows]] = self.math.down(intermediate[rows], w2, scales, e)
        return out.view(num_tokens, top_k, self.layer.hidden_size)


class TorchBatchedExperts(Experts):
    """Batched format: ``[E_local, max_tokens, K]`` in, the same layout out, unweighted."""

    name = "TorchBatchedExperts"

    def __init__(self, layer: MoELayer) -> None:
        self.layer = layer
        self.math = ExpertMath(layer)

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.BATCHED

    def input_quantizer(self, scales: Optional[ExpertScales] = None) -> Optional[InputQuantizer]:
        return self.math.input_quantizer(scales)

    def workspace_bytes(self, num_tokens: int) -> int:
        """Worst case: every local expert's batch sized for all ``num_tokens`` tokens."""
        slots = self.layer.num_experts * num_tokens
        return self.math.workspace_bytes(slots, num_tokens, slots, slots)

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
        num_experts, max_tokens = prepared.hidden.shape[:2]
        x = self.math.dequantize_input(prepared.hidden, prepared.scale, scales)
        counts = prepared.expert_num_tokens.tolist()
        active = [(e, n) for e, n in enumerate(counts) if n]
        intermediate = x.new_zeros((num_experts, max_tokens, self.layer.intermediate_size))
        for e, n in active:
            intermediate[e, :n] = self.math.gate_up(x[e, :n], w1, scales, e)
        intermediate = self.math.requantize(intermediate, scales)
        out = torch.zeros((num_experts, max_tokens, self.layer.hidden_size), dtype=self.math.out_dtype, device=x.device)
        for e, n in active:
            out[e, :n] = self.math.down(intermediate[e, :n], w2, scales, e)
        return out
