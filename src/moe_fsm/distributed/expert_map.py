"""Which rank owns which experts, and global-to-local expert ids.

vLLM's default expert placement (``determine_expert_map``, linear strategy) gives
rank r a contiguous block of experts; when E is not a multiple of the world size
the first ``E % W`` ranks own one expert more. The expert map is a tensor [E]
holding the local id of each global expert on this rank and -1 for experts that
live elsewhere: the experts kernels take local ids and skip slots marked -1
(``moe_fsm.kernels.grouping.local_expert_ids`` applies it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe_fsm.errors import InputError, KernelInputError


@dataclass(frozen=True)
class ExpertPlacement:
    """Contiguous split of ``num_experts`` experts over ``world_size`` ranks, seen from ``rank``."""

    num_experts: int
    world_size: int
    rank: int

    def __post_init__(self) -> None:
        for name, minimum in (("num_experts", 1), ("world_size", 1), ("rank", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise InputError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if self.rank >= self.world_size:
            raise InputError(f"rank {self.rank} must be below world_size {self.world_size}")
        if self.world_size > self.num_experts:
            raise InputError(
                f"expert parallelism over {self.world_size} ranks needs at least one expert per rank, "
                f"but the layer has num_experts={self.num_experts}"
            )

    def count(self, rank: int) -> int:
        """How many experts ``rank`` owns: E // W, plus one for the first E % W ranks."""
        base, extra = divmod(self.num_experts, self.world_size)
        return base + (1 if rank < extra else 0)

    def start(self, rank: int) -> int:
        """Global id of ``rank``'s first expert."""
        base, extra = divmod(self.num_experts, self.world_size)
        return rank * base + min(rank, extra)

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(self.count(r) for r in range(self.world_size))

    @property
    def num_local_experts(self) -> int:
        return self.count(self.rank)

    @property
    def local_start(self) -> int:
        return self.start(self.rank)

    @property
    def local_end(self) -> int:
        return self.local_start + self.num_local_experts

    def owner_table(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """int64 [E]: the rank that owns each global expert."""
        counts = torch.tensor(self.counts, dtype=torch.int64, device=device)
        return torch.repeat_interleave(torch.arange(self.world_size, dtype=torch.int64, device=device), counts)

    def owner_mask(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """bool [E + 1, W]: row e marks the rank owning expert e; the last row, which id -1 indexes, marks none.

        ``owner_mask()[topk_ids].any(1)`` says which ranks each token must reach, in two kernels.
        """
        mask = torch.zeros((self.num_experts + 1, self.world_size), dtype=torch.bool, device=device)
        mask[torch.arange(self.num_experts, device=device), self.owner_table(device)] = True
        return mask

    def expert_map(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """int32 [E]: local id of each global expert on this rank, -1 where another rank owns it."""
        table = torch.full((self.num_experts,), -1, dtype=torch.int32, device=device)
        table[self.local_start : self.local_end] = torch.arange(self.num_local_experts, dtype=torch.int32, device=device)
        return table

    def local_slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a per-expert tensor [E, ...] (weights, per-expert scales)."""
        if tensor.dim() == 0 or tensor.shape[0] != self.num_experts:
            raise KernelInputError(
                f"expected a per-expert tensor with leading dimension num_experts={self.num_experts}, "
                f"got shape {tuple(tensor.shape)}"
            )
        return tensor[self.local_start : self.local_end]

    def to_json(self) -> dict:
        return {
            "num_experts": self.num_experts,
            "world_size": self.world_size,
            "rank": self.rank,
            "counts": list(self.counts),
        }

