"""The modular-kernel contract: prepare/finalize moves tokens, experts compute.

vLLM splits a fused MoE layer into a prepare/finalize object (quantize the
activations and move tokens to the ranks that own their experts, then bring
the results back and reduce over top-k) and an experts object (the grouped
GEMMs and the activation). We keep that split so that the selection engine can
pair any experts kernel with any token-movement strategy that shares its
activation format, and so each side can be tested alone.

Tensor conventions (E experts, M tokens, K hidden, N intermediate):
  hidden_states  [M, K]       float (bf16/fp16/fp32)
  w1             [E, 2N, K]   gate rows first, then up rows; fp8 e4m3, or uint8 [E, 2N, K//2] for NVFP4
  w2             [E, K, N]    likewise; NVFP4 uint8 [E, K, N//2]
  topk_ids       [M, top_k]   int, global expert ids
  topk_weights   [M, top_k]   float32
  output         [M, K]       hidden_states' dtype
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Optional, Protocol

import torch

from moe_fsm.inputs.formats import ActivationFormat  # noqa: F401  (re-exported: the runtime's name for it)


class WeightAndReduce(str, Enum):
    """Who applies the top-k weights and sums over top-k.

    EXPERTS: the experts already produced the reduced [M, K] output.
    CONTIGUOUS: the experts produced unweighted [M, top_k, K]; finalize reduces.
    BATCHED: the experts produced unweighted [E_local, max_tokens, K]; finalize scatters back.
    """

    EXPERTS = "experts"
    CONTIGUOUS = "contiguous"
    BATCHED = "batched"


@dataclass(frozen=True)
class ExpertScales:
    """Every scale a quantized expert set can carry; the scheme says which are present.

    FP8: w1_scale/w2_scale are [E] (per tensor), [E, 2N] / [E, K] (per channel) or
    [E, ceil(2N/128), ceil(K/128)] / [E, ceil(K/128), ceil(N/128)] (128x128 blocks);
    a1_scale/a2_scale are the static activation scales (scalar, or [M]/[1] per token).
    NVFP4: w1_scale/w2_scale are e4m3 block scales [E, 2N, K//16] / [E, K, N//16];
    w1_global_scale/w2_global_scale are fp32 [E] (dequantize: value * block_scale * global);
    a1_global_scale/a2_global_scale are the fp32 activation quantization multipliers [E] or scalar.
    MXFP4/MXFP8: w1_scale/w2_scale are E8M0 exponents (uint8) [E, 2N, K//32] / [E, K, N//32].
    INT4/INT8 weights (int_wna16, w4a8, w4a8_int8): w1_scale/w2_scale are group scales
    [E, 2N, K//G] / [E, K, N//G] (G = the row length for per-channel scales);
    w1_zero_point/w2_zero_point are their uint8 zero points when the weights are asymmetric;
    w1_g_idx/w2_g_idx (int32 [E, K] / [E, N]) each column's group when they are activation-ordered.
    INT8 W8A8: w1_scale/w2_scale fp32 [E, 2N] / [E, K] per channel, [E] per tensor.

    Per-expert terms that are not scales ride along because they are sliced and
    moved exactly like them: w1_bias [E, 2N] and w2_bias [E, K] (layers with biases),
    added after each GEMM in float32.
    """

    w1_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    w1_global_scale: Optional[torch.Tensor] = None
    w2_global_scale: Optional[torch.Tensor] = None
    a1_scale: Optional[torch.Tensor] = None
    a2_scale: Optional[torch.Tensor] = None
    a1_global_scale: Optional[torch.Tensor] = None
    a2_global_scale: Optional[torch.Tensor] = None
    w1_zero_point: Optional[torch.Tensor] = None
    w2_zero_point: Optional[torch.Tensor] = None
    w1_g_idx: Optional[torch.Tensor] = None
    w2_g_idx: Optional[torch.Tensor] = None
    w1_bias: Optional[torch.Tensor] = None
    w2_bias: Optional[torch.Tensor] = None


class InputQuantizer(Protocol):
    """Quantizes activations as the experts expect; prepare calls it (before or after moving tokens)."""

    def __call__(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]: ...


@dataclass(frozen=True)
class DynamicFP8RowQuantizer:
    """An InputQuantizer for dynamic per-token (``rows="token"``) or 1x128-group (``"group"``) FP8 that says so.

    Both give float8_e4m3fn rows and float32 scales ``max(amax, 1e-10) / 448`` per row or per 128 columns, with
    correctly rounded divisions, so any implementation gives the same bytes. Knowing that, an expert-parallel
    dispatch quantizes while it packs its send rows (one pass over the tokens instead of two); everyone else
    just calls it.
    """

    rows: str
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, Optional[torch.Tensor]]]

    def __call__(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self.quantize(hidden)


@dataclass
class PreparedTokens:
    """What prepare hands to the experts.

    Standard: ``hidden`` [M', K] (M' tokens on this rank after dispatch), ``topk_ids``
    local expert ids (-1 for slots another rank computes), ``topk_weights`` alike.
    Batched: ``hidden`` [E_local, max_tokens, K] and ``expert_num_tokens`` [E_local].
    ``scale`` is the activation scale when ``hidden`` is quantized: 2-D means one row of
    scales per row of ``hidden`` (per token, per 1x128 group, NVFP4 block scales), so
    dispatch must move it with the tokens; 0-D or 1-D means one scale shared by all
    rows (per tensor). ``state`` is
    private to the prepare/finalize object that made it (what finalize needs to undo
    the dispatch).
    """

    hidden: torch.Tensor
    scale: Optional[torch.Tensor]
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    expert_num_tokens: Optional[torch.Tensor] = None
    state: object = None


class PrepareFinalize(ABC):
    """Moves tokens to the experts and back.

    ``host_sync_free``: prepare and finalize only launch device work and never read a device value on
    the host, so a call can be captured in a CUDA graph (``eager_graphs.py``). False unless a class says so.
    """

    name: str = "PrepareFinalize"
    host_sync_free: bool = False

    @property
    @abstractmethod
    def activation_format(self) -> ActivationFormat: ...

    @abstractmethod
    def prepare(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        num_experts: int,
        expert_map: Optional[torch.Tensor],
        apply_router_weight_on_input: bool,
        quantize: Optional[InputQuantizer],
    ) -> PreparedTokens: ...

    @abstractmethod
    def finalize(
        self,
        output: torch.Tensor,
        expert_output: torch.Tensor,
        prepared: PreparedTokens,
        *,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        reduce: WeightAndReduce,
    ) -> None:
        """Write the layer's result for this rank's tokens into ``output`` [M, K]."""


class Experts(ABC):
    """Computes w2 . act(w1 . x) for the tokens routed to each local expert.

    ``host_sync_free``: ``apply`` only launches device work and never reads a device value on the host
    (no ``.tolist()``, no value-dependent shapes), so a call can be captured in a CUDA graph.
    """

    name: str = "Experts"
    host_sync_free: bool = False

    @property
    @abstractmethod
    def activation_format(self) -> ActivationFormat: ...

    @property
    def weight_and_reduce(self) -> WeightAndReduce:
        return WeightAndReduce.CONTIGUOUS if self.activation_format is ActivationFormat.STANDARD else WeightAndReduce.BATCHED

    def input_quantizer(self, scales: Optional[ExpertScales] = None) -> Optional[InputQuantizer]:
        """How prepare should quantize activations; None: the experts take them unquantized.

        ``scales`` are the call's expert scales: static schemes read their activation
        scale from them (a1_scale for FP8, a1_global_scale for NVFP4), so the modular
        kernel passes the scales it was called with.
        """
        return None

    def workspace_bytes(self, num_tokens: int) -> int:
        """Scratch memory one call needs for ``num_tokens`` tokens (for capacity planning)."""
        return 0

    @abstractmethod
    def apply(
        self,
        prepared: PreparedTokens,
        w1: torch.Tensor,
        w2: torch.Tensor,
        scales: ExpertScales,
        *,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        """Return the expert output in the layout ``weight_and_reduce`` names."""
