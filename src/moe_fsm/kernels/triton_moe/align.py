"""The alignment step: (token, slot) pairs sorted by expert, each expert padded to BLOCK_M.

A grouped GEMM program handles BLOCK_M consecutive rows of one expert, so the
pairs routed to each expert are listed contiguously and each expert's run is
padded up to a multiple of BLOCK_M with a sentinel (``num_pairs``) that the GEMMs
mask out. Everything happens on the device and every buffer is sized from the
shapes alone (at most ``P + min(E, P) * (BLOCK_M - 1)`` rows for P pairs, since
at most min(E, P) experts are non-empty and each wastes fewer than BLOCK_M rows),
so nothing waits for the device and the step can be captured in a CUDA graph.
A decode batch (``SMALL_PAIRS``) is aligned by one program, in one launch; a single token,
and a few tokens whose pairs would read little weight twice, are not sorted at all
(``pair_blocks_pay``, ``pair_blocks``).

Slots whose id is -1 (owned by another rank) or outside [0, E) are not placed:
no GEMM row computes them. Pairs of one expert appear in atomic-counter order
(in pair order for a decode batch), which varies run to run; each row is computed
independently of its position in the block, so results do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.kernels.triton_moe._runtime import kernels, launch, require_device

_PAIRS_PER_PROGRAM = 1024
# a batch of at most this many pairs over at most this many experts (rounded up to a power of two) is aligned
# by one program in one launch (``align_small_kernel``): decode batches, up to 64 tokens at top-8
SMALL_PAIRS = 512
SMALL_EXPERTS = 256


@dataclass(frozen=True)
class AlignedRouting:
    """Where each GEMM row block reads from.

    ``sorted_ids`` [max_padded] int32: pair index t * top_k + j, or ``num_pairs`` for pads.
    ``block_expert`` [num_row_blocks] int32: the expert of each row block, -1 past the end.
    ``num_padded`` [1] int32: rows in use (a device value, never read on the host).
    """

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_pairs: int
    top_k: int

    @property
    def num_row_blocks(self) -> int:
        return self.block_expert.numel()


@dataclass(frozen=True)
class PairBlocks:
    """Row source without sorting: row block b computes pair b alone, its expert read from ``topk_ids``.

    Where ``pair_blocks_pay``: one token, whose top-k slots name distinct experts, or a decode batch
    whose pairs would read little weight twice (the experts they share). Skipping the sort saves the
    alignment's launches, which at decode are a visible share of the layer. Pairs that do share an
    expert stay correct, each reading its expert's weights again.
    """

    topk_ids: torch.Tensor
    block_m: int
    num_pairs: int
    top_k: int
    num_experts: int

    @property
    def num_row_blocks(self) -> int:
        return self.num_pairs


def expert_runs(routing: AlignedRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row block of its expert, that expert's row blocks) for every row block in use: what a GEMM needs
    to walk one expert's tiles together, so that the expert's weight tiles are read from memory once and its
    rows stay in L2 across them. One launch, on the device (a CUDA graph captures it)."""
    num_blocks = routing.num_row_blocks
    run_first = torch.empty(num_blocks, dtype=torch.int32, device=routing.block_expert.device)
    run_count = torch.empty_like(run_first)
    block = 256
    launch(
        kernels().expert_runs_kernel, (max(-(-num_blocks // block), 1),),
        (routing.block_expert, routing.num_padded, run_first, run_count, num_blocks),
        dict(BLOCK_M=routing.block_m, BLOCK=block, SEARCH_STEPS=max(num_blocks, 1).bit_length() + 1),
    )
    return run_first, run_count


# A batch past one token is left unsorted while it has at most UNSORTED_MAX_TOKENS tokens and the weight bytes its
# pairs are expected to read a second time (``expected_shared_pairs`` x one expert's bytes) stay within
# UNSORTED_REREAD_BYTES. Measured side by side on an H100 (docs/perf/vs_vllm.md, "Unsorted pair blocks past one
# token"; 8 layer shapes at 2 and 8 tokens): unsorted was faster at every point that re-reads up to 22 MB
# (by 2-17%) and slower or even at every point from 37 MB up (by up to 45%); the bound sits between them. (Why bytes
# rather than the count of shared experts: copies read at about the same time can come from L2; not measured.)
UNSORTED_MAX_TOKENS = 8
UNSORTED_REREAD_BYTES = 28 * 2**20


def expected_shared_pairs(num_pairs: int, num_experts: int) -> float:
    """Pairs expected to land on an expert that an earlier pair of the batch chose, for pairs spread uniformly over
    ``num_experts``: the pairs less the distinct experts they are expected to name."""
    if num_pairs <= 0 or num_experts <= 0:
        return 0.0
    return num_pairs - num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** num_pairs)


def pair_blocks_pay(num_tokens: int, top_k: int, num_experts: int, expert_bytes: int) -> bool:
    """Whether a batch skips the sort (``pair_blocks``): one token always (its slots name distinct experts); up to
    ``UNSORTED_MAX_TOKENS`` tokens while the weight bytes read twice stay within ``UNSORTED_REREAD_BYTES``.

    Sorting puts the pairs of one expert in one row block, so its weights are read once; unsorted, an expert that
    several pairs chose is read once per pair, but the alignment's launches are saved (one program for up to
    ``SMALL_EXPERTS`` experts; a memset and two launches past them: Qwen3-Next's 512). ``expert_bytes`` is one
    expert's w1 and w2 as stored (FP8 one byte a weight). Past ``UNSORTED_MAX_TOKENS`` nothing was measured, and
    each pair's block of BLOCK_M rows computes one of them.
    """
    if num_tokens <= 1:
        return True
    if num_tokens > UNSORTED_MAX_TOKENS:
        return False
    return expected_shared_pairs(num_tokens * top_k, num_experts) * expert_bytes <= UNSORTED_REREAD_BYTES


def pair_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> PairBlocks:
    """One row block per (token, slot) pair of ``topk_ids`` [M, top_k]; no device work."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(
            f"topk_ids must be int32/int64 [M, top_k]; got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    ids = topk_ids.contiguous()
    return PairBlocks(ids.reshape(-1), block_m, ids.numel(), ids.shape[1], num_experts)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case rows after padding: every non-empty expert wastes at most block_m - 1."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRouting:
    """Sort the pairs of ``topk_ids`` [M, top_k] by expert with per-expert padding to ``block_m``."""
    require_device(topk_ids)
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(
            f"topk_ids must be int32/int64 [M, top_k]; got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    if block_m < 1 or block_m & (block_m - 1):
        raise KernelInputError(f"block_m must be a power of two, got {block_m}")
    ids = topk_ids.contiguous()
    num_tokens, top_k = ids.shape
    num_pairs = num_tokens * top_k
    max_padded = max(max_padded_rows(num_pairs, num_experts, block_m), block_m)
    num_row_blocks = -(-max_padded // block_m)
    device = ids.device

    sorted_ids = torch.empty(num_row_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_row_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)

    k = kernels()
    e_pow2 = max(16, 1 << (num_experts - 1).bit_length())
    if 0 < num_pairs <= SMALL_PAIRS and e_pow2 <= SMALL_EXPERTS:
        launch(
            k.align_small_kernel, (1,),
            (ids, sorted_ids, block_expert, num_padded, num_pairs, num_experts, sorted_ids.numel(), num_row_blocks),
            dict(BLOCK_M=block_m, P_POW2=max(16, 1 << (num_pairs - 1).bit_length()), E_POW2=e_pow2, FILL=1024,
                 BLOCKS=64),
        )
        return AlignedRouting(sorted_ids, block_expert, num_padded, block_m, num_pairs, top_k)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(max(num_pairs, 1), dtype=torch.int32, device=device)
    launch(
        k.align_count_kernel, (-(-sorted_ids.numel() // _PAIRS_PER_PROGRAM),),
        (ids, counts, rank, sorted_ids, num_pairs, sorted_ids.numel(), num_experts), dict(BLOCK=_PAIRS_PER_PROGRAM),
    )
    blocks_per_program = max(16, min(128, 16384 // e_pow2))
    grid = max(-(-num_pairs // _PAIRS_PER_PROGRAM), -(-num_row_blocks // blocks_per_program), 1)
    launch(
        k.align_scatter_kernel, (grid,),
        (ids, counts, rank, sorted_ids, block_expert, num_padded, num_pairs, num_experts, num_row_blocks),
        dict(BLOCK_M=block_m, E_POW2=e_pow2, BLOCK=_PAIRS_PER_PROGRAM, BLOCKS_PER_PROGRAM=blocks_per_program),
    )
    return AlignedRouting(sorted_ids, block_expert, num_padded, block_m, num_pairs, top_k)
