"""Experts that run on any torch device: unquantized math, and the emulation of every quantized format.

The CPU backend, the fallback where no optimized kernel exists, and the emulation
of quantized kernels. Pairs are grouped by expert (no Python loop over tokens)
and gathered once into expert-sorted rows; each expert that received tokens runs
its two GEMMs straight into its slice of a shared buffer; the activation and any
re-quantization run once over all rows; one scatter puts the results in place.
So a call is two matrix products per active expert plus a handful of whole-batch ops.

Quantized schemes emulate what the real kernels compute: the input arrives
quantized from prepare and is dequantized, the weights are dequantized (per
expert, as the loop reaches it), the math runs in float32, and the intermediate
after the activation is quantized again the way the kernels feed the second GEMM
(dynamic 1x128 groups for block schemes, per token or per tensor for those keys,
``a2_scale`` / ``a2_global_scale`` for static parts). Formats come from the
weight and activation tables (FP8, NVFP4, MXFP4/MXFP8 with E8M0 scales, INT8
W8A8, INT4/INT8 group weights with zero points); a kernel that quantizes 16-bit
inputs itself (W4A8-INT8) gets its quantizer applied to both GEMM inputs here.
Biases (gpt-oss) are added after each GEMM, in the compute dtype. Unquantized layers compute
in the layer dtype, as the GPU kernels do (float32 accumulation inside the GEMM,
intermediate stored in the layer dtype).

Output: the Standard experts return the *unweighted* per-slot results
``[M, top_k, K]`` (``WeightAndReduce.CONTIGUOUS``; finalize applies the router
weights and sums, which keeps EP/DP combines simple); slots whose id is -1 are
zero. The Batched experts return ``[E_local, max_tokens, K]`` (``BATCHED``), zero
past each expert's count.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Callable, Optional, Sequence

import torch

from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.kernels.activations import apply_activation
from moe_fsm.kernels.grouping import group_by_expert
from moe_fsm.modular.interfaces import ActivationFormat, ExpertScales, Experts, InputQuantizer, PreparedTokens
from moe_fsm.quantize.activations import activation_quant, input_quantizer, kernel_activation_quant, static_scale
from moe_fsm.quantize.weights import weight_extras, weight_format

_INDEX_BYTES = 8


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _nonempty(t: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """Row blocks of ``t`` for the non-zero ``counts``, in order.

    A view per active expert: one ``narrow`` each when few experts are active (a
    decode step's top-k of many), one split otherwise (which makes a view per expert).
    """
    active = [(e, n) for e, n in enumerate(counts) if n]
    if 4 * len(active) >= len(counts):
        return [part for part, n in zip(torch.split(t, counts), counts) if n]
    offsets = list(accumulate(counts, initial=0))
    return [t.narrow(0, offsets[e], n) for e, n in active]


def _expert_gemms(blocks: list[torch.Tensor], weight_t: Callable[[int], torch.Tensor], active: list[int],
                  out: torch.Tensor, counts: list[int]) -> None:
    """``out``'s block of expert e = ``blocks[i] @ weight_t(e)``: written in place when inference; when
    autograd records (training), through copies into single-view slices, which it can follow."""
    if torch.is_grad_enabled() and (blocks[0].requires_grad or weight_t(active[0]).requires_grad):
        offsets = list(accumulate(counts, initial=0))
        for e, x in zip(active, blocks):
            out.narrow(0, offsets[e], x.shape[0]).copy_(torch.mm(x, weight_t(e)))
        return
    for e, x, o in zip(active, blocks, _nonempty(out, counts)):
        torch.mm(x, weight_t(e), out=o)


class ExpertMath:
    """The per-expert steps both layouts share, specialised to one layer's scheme by table lookups.

    Dequantized expert weights are kept, up to ``DEQUANTIZED_BUDGET_BYTES`` per instance: an engine
    shares one kernel between identical layers, which call it with the same weights, and dequantizing
    every active expert on every call made a 58-layer block-FP8 model take over a minute on a CPU.
    The key holds the tensors' storage and version counters, so weights changed in place are
    dequantized again, and the cache keeps the source tensors alive, so no other tensor can take their
    address; past the budget, experts are dequantized per call as before.
    """

    DEQUANTIZED_BUDGET_BYTES = 1 << 30

    def __init__(self, layer: MoELayer) -> None:
        self.layer = layer
        self._dequantized: dict[tuple, torch.Tensor] = {}
        self._dequantized_bytes = 0
        self._sources: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self.weights = weight_format(layer.quant)
        self.act_quant = activation_quant(layer.quant)
        self.kernel_quant = kernel_activation_quant(layer.quant)
        self.out_dtype = torch_dtype(layer.dtype)
        quantized = layer.quant.family is not QuantFamily.UNQUANTIZED
        self.compute_dtype = torch.float32 if quantized else self.out_dtype

    def input_quantizer(self, scales: Optional[ExpertScales]) -> Optional[InputQuantizer]:
        return input_quantizer(self.layer.quant, scales)

    def dequantize_input(self, hidden: torch.Tensor, scale: Optional[torch.Tensor], scales: ExpertScales) -> torch.Tensor:
        if self.kernel_quant is not None:
            return self.kernel_quant.fake_quantize(hidden, None, self.compute_dtype)
        if self.act_quant is None:
            return hidden.to(self.compute_dtype)
        return self.act_quant.dequantize(hidden, scale, static_scale(self.act_quant, scales, 0), self.compute_dtype)

    def requantize(self, intermediate: torch.Tensor, scales: ExpertScales) -> torch.Tensor:
        """What the second GEMM sees of the intermediate: re-quantized as the kernels do, or itself."""
        if self.kernel_quant is not None:
            return self.kernel_quant.fake_quantize(intermediate, None, self.compute_dtype)
        if self.act_quant is None:
            return intermediate
        return self.act_quant.fake_quantize(intermediate, static_scale(self.act_quant, scales, 1), self.compute_dtype)

    def _weights_t(self, w: torch.Tensor, scales: ExpertScales, prefix: str) -> Callable[[int], torch.Tensor]:
        """Expert ``e``'s weight, transposed for ``rows @ w^T``, dense in the compute dtype."""
        if self.weights is None:
            wt = w.transpose(1, 2) if w.dtype == self.compute_dtype else w.transpose(1, 2).to(self.compute_dtype)
            return lambda e: wt[e]
        fmt, dtype = self.weights, self.compute_dtype
        scale, extras = getattr(scales, f"{prefix}_scale"), weight_extras(fmt, scales, prefix)
        sources = (w, scale, *extras.values())
        key = tuple((t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.device) for t in sources)

        def expert(e: int) -> torch.Tensor:
            cached = self._dequantized.get((key, e))
            if cached is not None:
                return cached
            dense = fmt.dequantize(w[e], scale[e], {name: t[e] for name, t in extras.items()}, dtype).T
            size = dense.numel() * dense.element_size()
            if self._dequantized_bytes + size <= self.DEQUANTIZED_BUDGET_BYTES:
                self._dequantized[(key, e)] = dense
                self._dequantized_bytes += size
                self._sources.setdefault(key, sources)  # kept alive: a freed tensor's address could be reused
            return dense

        return expert

    def _add_bias(self, out: torch.Tensor, bias: Optional[torch.Tensor], counts: list[int], active: list[int]) -> torch.Tensor:
        """Each expert's bias row added to its rows (float32, before the activation or the output cast)."""
        if bias is None or not active:
            return out
        per_row = torch.repeat_interleave(bias[active].to(out.dtype), torch.tensor([counts[e] for e in active], device=out.device), dim=0)
        return out + per_row

    def run(self, rows: torch.Tensor, offsets: Sequence[int], w1: torch.Tensor, w2: torch.Tensor, scales: ExpertScales) -> torch.Tensor:
        """``w2[e] . act(w1[e] . x)`` for rows [P, K] sorted by expert (expert e owns ``offsets[e]:offsets[e+1]``).

        Each GEMM writes straight into its slice of one buffer, so the activation
        and the re-quantization run once over all rows (a dynamic per-tensor scale
        then covers every routed row, as in the kernels) and the loop holds only GEMMs.
        """
        counts = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        active = [e for e, n in enumerate(counts) if n]
        h = rows.new_empty((rows.shape[0], 2 * self.layer.intermediate_size))
        w1t = self._weights_t(w1, scales, "w1")
        if active:
            _expert_gemms(_nonempty(rows, counts), w1t, active, h, counts)
        h = self._add_bias(h, scales.w1_bias, counts, active)
        intermediate = self.requantize(apply_activation(self.layer.activation.value, h, self.layer.swiglu_limit), scales)
        y = rows.new_empty((rows.shape[0], self.layer.hidden_size))
        w2t = self._weights_t(w2, scales, "w2")
        if active:
            _expert_gemms(_nonempty(intermediate, counts), w2t, active, y, counts)
        y = self._add_bias(y, scales.w2_bias, counts, active)
        return y.to(self.out_dtype)

    def workspace_bytes(self, rows: int, pairs: int, output_rows: int) -> int:
        """Input view, gathered rows, GEMM-1 output, intermediate, GEMM-2 output, the output, one dequantized expert."""
        k, n = self.layer.hidden_size, self.layer.intermediate_size
        cd = torch.empty((), dtype=self.compute_dtype).element_size()
        od = torch.empty((), dtype=self.out_dtype).element_size()
        dequantized = 3 * n * k * cd if self.weights is not None else 0
        return rows * k * cd + pairs * (k + 2 * n + n + k) * cd + output_rows * k * od + dequantized


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
        return self.math.workspace_bytes(num_tokens, pairs, pairs) + grouping

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
        y = self.math.run(x[groups.token], groups.offsets, w1, w2, scales)
        slots = num_tokens * top_k
        fresh = torch.zeros if groups.num_pairs < slots else torch.empty
        out = fresh((slots, self.layer.hidden_size), dtype=self.math.out_dtype, device=x.device)
        out[groups.pair] = y
        return out.view(num_tokens, top_k, self.layer.hidden_size)


def batched_rows(counts: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """Flat indices into ``[E * max_tokens]`` of the filled rows, expert by expert."""
    experts = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    return experts * max_tokens + torch.arange(experts.numel(), device=counts.device) - starts[experts]


class TorchBatchedExperts(Experts):
    """Batched format: ``[E_local, max_tokens, K]`` in, the same layout out, unweighted, zero past each count."""

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
        pairs = num_tokens * self.layer.top_k
        return self.math.workspace_bytes(slots, pairs, slots) + pairs * _INDEX_BYTES

    def apply(
        self,
        prepared: PreparedTokens,
        w1: torch.Tensor,
        w2: torch.Tensor,
        scales: ExpertScales,
        *,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        """Only the filled rows are computed, so padding never reaches a dynamic scale."""
        scales = scales or ExpertScales()
        num_experts, max_tokens = prepared.hidden.shape[:2]
        x = self.math.dequantize_input(prepared.hidden, prepared.scale, scales)
        x = x.reshape(num_experts * max_tokens, self.layer.hidden_size)
        counts = prepared.expert_num_tokens.long()
        filled = batched_rows(counts, max_tokens)
        offsets = [0, *torch.cumsum(counts, 0).tolist()]
        y = self.math.run(x[filled], offsets, w1, w2, scales)
        out = torch.zeros((num_experts * max_tokens, self.layer.hidden_size), dtype=self.math.out_dtype, device=x.device)
        out[filled] = y
        return out.view(num_experts, max_tokens, self.layer.hidden_size)
