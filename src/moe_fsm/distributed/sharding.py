"""Which part of the expert weights each rank holds.

Two splits, as in vLLM's ``FusedMoEParallelConfig``:

* expert parallelism: rank r holds whole experts, the contiguous block its
  :class:`ExpertPlacement` names (``shard_experts``);
* no expert parallelism with several ranks (TP, or DP without EP, where vLLM
  flattens TP across the DP ranks): every rank holds every expert but only a
  slice of the intermediate dimension N (``shard_intermediate``). Each rank's
  output is then a partial sum, which is why the data-parallel finalize is a
  reduce-scatter and not a plain scatter.

Scale tensors follow their weights. Per-tensor scales and the global (NVFP4)
scales are per expert only; per-channel, 128x128-block and NVFP4 16-element
block scales are cut along N where the weight is. Activation scales are the
same on every rank and are left whole.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch

from moe_fsm.distributed.expert_map import ExpertPlacement
from moe_fsm.errors import InputError, KernelInputError
from moe_fsm.modular.interfaces import ExpertScales

FP8_BLOCK = 128
NVFP4_BLOCK = 16


def shard_experts(
    w1: torch.Tensor, w2: torch.Tensor, scales: ExpertScales, placement: ExpertPlacement
) -> tuple[torch.Tensor, torch.Tensor, ExpertScales]:
    """This rank's experts: w1/w2 and every per-expert weight scale sliced to the local block."""

    def cut(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else placement.local_slice(t)

    return (
        placement.local_slice(w1),
        placement.local_slice(w2),
        replace(
            scales,
            w1_scale=cut(scales.w1_scale),
            w2_scale=cut(scales.w2_scale),
            w1_global_scale=cut(scales.w1_global_scale),
            w2_global_scale=cut(scales.w2_global_scale),
            w1_zero_point=cut(scales.w1_zero_point),
            w2_zero_point=cut(scales.w2_zero_point),
            w1_g_idx=cut(scales.w1_g_idx),
            w2_g_idx=cut(scales.w2_g_idx),
            w1_bias=cut(scales.w1_bias),
            w2_bias=cut(scales.w2_bias),
        ),
    )


def shard_intermediate(
    w1: torch.Tensor,
    w2: torch.Tensor,
    scales: ExpertScales,
    *,
    intermediate_size: int,
    rank: int,
    world_size: int,
) -> tuple[torch.Tensor, torch.Tensor, ExpertScales]:
    """Rank ``rank``'s slice [i0, i1) of the intermediate dimension N, for every expert.

    w1 [E, 2N, K] keeps gate rows i0:i1 and up rows N+i0:N+i1 (so act(gate) * up
    pairs stay together); w2 [E, K, N] keeps columns i0:i1 (packed NVFP4: bytes
    i0/2:i1/2). The slice must align with the scale blocks: N/world a multiple of
    128 for 128x128 block FP8, of 16 for NVFP4.
    """
    n = intermediate_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise InputError(f"rank {rank} is not in a world of {world_size}")
    if n % world_size:
        raise InputError(f"intermediate_size={n} must be divisible by the {world_size} ranks that share it")
    part = n // world_size
    i0, i1 = rank * part, (rank + 1) * part
    if w1.dim() != 3 or w1.shape[1] != 2 * n:
        raise KernelInputError(f"w1 must be [E, 2N={2 * n}, K or K/2], got shape {tuple(w1.shape)}")
    if w2.dim() != 3:
        raise KernelInputError(f"w2 must be [E, K, N or N/2], got shape {tuple(w2.shape)}")
    packed = w2.shape[2] * 2 == n and w2.dtype == torch.uint8

    def rows(t: torch.Tensor, per: int = 1) -> torch.Tensor:
        # gate rows then up rows, both cut to [i0, i1) (in units of ``per`` rows)
        half = t.shape[1] // 2
        a, b = i0 // per, i1 // per
        return torch.cat([t[:, a:b], t[:, half + a : half + b]], dim=1)

    def cols(t: torch.Tensor, per: int = 1) -> torch.Tensor:
        return t[:, :, i0 // per : i1 // per]

    w1_s = rows(w1)
    if packed:
        if part % 2:
            raise InputError(f"packed NVFP4 w2 needs an even N slice, got N/{world_size}={part}")
        w2_s = cols(w2, 2)
    elif w2.shape[2] == n:
        w2_s = cols(w2)
    else:
        raise KernelInputError(f"w2 must be [E, K, N={n}] (or uint8 [E, K, N/2]), got shape {tuple(w2.shape)}")

    def w1_scale(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None or t.dim() == 1:
            return t  # per tensor: one scale per expert
        if t.shape[1] == 2 * n:
            return rows(t)  # per channel [E, 2N] or NVFP4 block scales [E, 2N, K/16]
        if t.dim() == 3 and t.shape[1] == math.ceil(2 * n / FP8_BLOCK):
            _check_block(part, n, FP8_BLOCK, "128x128 block FP8")
            return rows(t, FP8_BLOCK)
        raise KernelInputError(f"w1_scale shape {tuple(t.shape)} matches no known layout for N={n}")

    def w2_scale(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None or t.dim() <= 2:
            return t  # per tensor [E] or per output channel [E, K]: N is summed away
        if t.shape[2] == n // NVFP4_BLOCK and packed:
            _check_block(part, n, NVFP4_BLOCK, "NVFP4")
            return cols(t, NVFP4_BLOCK)
        if t.shape[2] == math.ceil(n / FP8_BLOCK):
            _check_block(part, n, FP8_BLOCK, "128x128 block FP8")
            return cols(t, FP8_BLOCK)
        raise KernelInputError(f"w2_scale shape {tuple(t.shape)} matches no known layout for N={n}")

    if packed and scales.w1_scale is not None and scales.w1_scale.dim() == 3:
        _check_block(part, n, NVFP4_BLOCK, "NVFP4")
    return w1_s, w2_s, replace(scales, w1_scale=w1_scale(scales.w1_scale), w2_scale=w2_scale(scales.w2_scale))


def _check_block(part: int, n: int, block: int, what: str) -> None:
    if part % block:
        raise InputError(f"{what} scales come in blocks of {block} along N; the N slice {part} (N={n}) is not a multiple")
