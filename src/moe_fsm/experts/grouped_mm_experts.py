"""GROUPED_MM experts: the torch grouped-GEMM pipeline behind the Experts interface.

An extension backend: a baseline from torch operators alone (``torch._grouped_mm``
for bf16, ``torch._scaled_grouped_mm`` for row-wise FP8), useful where it is
eligible and as the yardstick the Triton kernels must beat. The registry asks
``grouped_mm_eligibility`` (re-exported here) for its verdict and reason.
The experts weight and sum over top-k themselves (``WeightAndReduce.EXPERTS``).
"""

from __future__ import annotations

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.backends.grouped_mm_eligibility import grouped_mm_eligibility
from moe_fsm.kernels.grouped_mm import grouped_mm_moe
from moe_fsm.modular.interfaces import ActivationFormat, ExpertScales, Experts, PreparedTokens, WeightAndReduce

__all__ = ["GroupedMMExperts", "grouped_mm_eligibility"]

_ACTIVATION = {"tensor": "tensor", "token": "token"}


class GroupedMMExperts(Experts):
    """Standard format: ``[M, K]`` bf16 rows in, the reduced ``[M, K]`` output out.

    Takes the input unquantized (no ``input_quantizer``): for row-wise FP8 it
    quantizes the gathered rows itself, since that is what the op consumes.
    """

    name = "GroupedMMExperts"

    def __init__(self, layer: MoELayer) -> None:
        if layer.quant.family not in (QuantFamily.UNQUANTIZED, QuantFamily.FP8):
            raise KernelInputError(f"GroupedMMExperts runs bf16 and row-wise FP8 layers; got {layer.quant.describe()}")
        self.layer = layer
        self.fp8_activation = (
            _ACTIVATION.get(layer.quant.activation.granularity.value) if layer.quant.family is QuantFamily.FP8 else None
        )
        if layer.quant.family is QuantFamily.FP8 and self.fp8_activation is None:
            raise KernelInputError(
                f"GroupedMMExperts takes per-tensor or per-token FP8 activations; got {layer.quant.activation}"
            )

    @property
    def activation_format(self) -> ActivationFormat:
        return ActivationFormat.STANDARD

    @property
    def weight_and_reduce(self) -> WeightAndReduce:
        return WeightAndReduce.EXPERTS

    def workspace_bytes(self, num_tokens: int) -> int:
        """Gathered rows, GEMM-1 output and intermediate, GEMM-2 output and its fp32 per-slot copy."""
        pairs = num_tokens * self.layer.top_k
        k, n = self.layer.hidden_size, self.layer.intermediate_size
        return pairs * (2 * k + 2 * 2 * n + 2 * n + 2 * k + 2 * 4 * k) + 4 * 8 * pairs

    def apply(
        self,
        prepared: PreparedTokens,
        w1: torch.Tensor,
        w2: torch.Tensor,
        scales: ExpertScales,
        *,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        """The reduced ``[M, K]``; a router weight on the input was applied by prepare, so outputs stay unweighted."""
        if prepared.scale is not None:
            raise KernelInputError("GroupedMMExperts takes unquantized prepared tokens (it has no input quantizer)")
        scales = scales or ExpertScales()
        static = self.layer.quant.activation is not None and self.layer.quant.activation.static
        weights = torch.ones_like(prepared.topk_weights) if apply_router_weight_on_input else prepared.topk_weights
        return grouped_mm_moe(
            prepared.hidden,
            w1,
            w2,
            weights,
            prepared.topk_ids,
            activation=self.layer.activation.value,
            swiglu_limit=self.layer.swiglu_limit,
            fp8_activation=self.fp8_activation,
            w1_scale=scales.w1_scale,
            w2_scale=scales.w2_scale,
            a1_scale=scales.a1_scale if static else None,
            a2_scale=scales.a2_scale if static else None,
        )
