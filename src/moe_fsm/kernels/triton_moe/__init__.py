"""Triton fused-MoE experts: alignment, two grouped GEMMs with fused epilogues, top-k sum.

Importing this package needs neither Triton nor CUDA; launching a kernel does,
and fails with ``BackendUnavailableError`` saying which is missing.
"""

from moe_fsm.kernels.triton_moe._runtime import HAS_TRITON
from moe_fsm.kernels.triton_moe.align import AlignedRouting, PairBlocks, align_tokens, max_padded_rows, pair_blocks
from moe_fsm.kernels.triton_moe.config import GemmConfig, MoEConfig, default_config, get_config
from moe_fsm.kernels.triton_moe.fused import (
    BatchedRows,
    Fp8Spec,
    fused_experts,
    fused_experts_batched,
    topk_sum,
    w1_gemm,
    w2_gemm,
)
from moe_fsm.kernels.triton_moe.quant import quantize_activation

__all__ = [
    "HAS_TRITON",
    "AlignedRouting",
    "BatchedRows",
    "Fp8Spec",
    "GemmConfig",
    "MoEConfig",
    "PairBlocks",
    "align_tokens",
    "default_config",
    "fused_experts",
    "fused_experts_batched",
    "get_config",
    "max_padded_rows",
    "pair_blocks",
    "quantize_activation",
    "topk_sum",
    "w1_gemm",
    "w2_gemm",
]
